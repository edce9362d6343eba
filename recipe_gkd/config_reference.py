"""The configuration reference, docs/configuration.md, generated from the schema dataclasses.

Every key `section.key` with its type, default, allowed values (the enum's members, the choices or
bounds declared on the field) and its meaning, the attribute docstring under the field (read with
`ast` from the dataclass's source file, as vLLM documents its config). A field without one is an error
naming it, so the page cannot leave a key out.

    python -m recipe_gkd.config_reference            # writes docs/configuration.md
    python -m recipe_gkd.config_reference --check    # exit 1 when the committed page differs
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import sys
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from recipe_gkd import config

PAGE = config.REPO_ROOT / "docs" / "configuration.md"
COMMAND = "python -m recipe_gkd.config_reference"
# Allowed values that a rule in validate() checks rather than the field's declaration.
CHECKED_IN_VALIDATE: dict[str, str] = {"trainer.loggers": "each of " + ", ".join(config.VALID_LOGGERS)}

# The topic pages (docs/) that explain each section, linked under its heading.
SECTION_PAGES: dict[str, tuple[str, ...]] = {
    "cluster": ("gpu_splits.md",),
    "actor": ("gpu_splits.md", "memory_plan.md"),
    "rollout": ("gpu_splits.md", "memory_plan.md"),
    "teacher": ("teacher_server.md",),
    "teachers": ("teachers.md",),
    "data": ("data.md",),
    "algorithm": ("objectives.md", "schedules.md"),
    "weight_sync": ("weight_sync.md",),
    "trainer": ("checkpoints_and_failures.md", "metrics.md"),
    "debug": ("memory_plan.md", "checkpoints_and_failures.md"),
    "server": ("teacher_server.md",),
}

INTRO = f"""# Configuration reference

```bash
python -m recipe_gkd.main [--config PATH] [--dry-run] [key=value ...]
python -m recipe_gkd.main --config configs/presets/1x8_a1_r3_t4.yaml --dry-run actor.megatron.tp=2
```

The schema (`recipe_gkd/config/schema.py`) <- the yaml <- the overrides. A misspelled key fails with
"did you mean"; a bad value or an impossible split exits 2 with one line naming the key.
The resolved config is saved as `<run_dir>/resolved_config.yaml`.

This page is generated from the schema's dataclasses and their field docstrings by
`{COMMAND}` (a test fails when it differs from what the schema generates);
edit the docstrings in `recipe_gkd/config/schema.py` (the `teacher` section: `teacher_server/config/teacher.py`), then rerun it.
Allowed values are the enum members, the choices or the bounds declared on the field; the rules that
tie several keys together live in `validate()` and print the key to change.
"""


class UndocumentedFieldError(ValueError):
    """A schema field without an attribute docstring: the reference would leave its key out."""


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    """One row of the reference."""

    key: str
    type: str
    default: str
    allowed: str
    meaning: str


@functools.cache
def _module_tree(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text(), filename=path)


def field_docstrings(cls: type) -> dict[str, str]:
    """The attribute docstrings of `cls`: the string literal on the line after each annotated field."""
    source = inspect.getsourcefile(cls)
    if source is None:
        raise UndocumentedFieldError(f"{cls.__qualname__}: no source file to read its field docstrings from")
    for node in ast.walk(_module_tree(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return _docstrings_in(node)
    raise UndocumentedFieldError(f"{cls.__qualname__}: no class of that name in {source}")


def class_docstring(cls: type) -> str:
    """The class docstring written in `cls`'s source (not the signature dataclasses fill `__doc__` with), one line."""
    source = inspect.getsourcefile(cls)
    for node in ast.walk(_module_tree(source or "")):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return " ".join((ast.get_docstring(node) or "").split())
    return ""


def _docstrings_in(node: ast.ClassDef) -> dict[str, str]:
    docs: dict[str, str] = {}
    for stmt, after in zip(node.body, [*node.body[1:], None], strict=True):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[stmt.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def walk_schema(cls: type, prefix: str = "") -> Iterator[KeyDoc]:
    """A row for every field of `cls` and its nested sections, in field order; a nested section's row first."""
    hints = typing.get_type_hints(cls)
    docs = field_docstrings(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if f.name not in docs:
            line = _field_line(cls, f.name)
            raise UndocumentedFieldError(
                f"config key {key} (field {cls.__qualname__}.{f.name}, {line}) has no docstring: add a string "
                f"literal on the line after the field saying what it does; the configuration reference "
                f"({PAGE.relative_to(config.REPO_ROOT)}) is generated from it"
            )
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            # The section's own class docstring, where it has one, says more than the field's line.
            yield KeyDoc(key, "section", "", "", class_docstring(hint) or docs[f.name])
            yield from walk_schema(typing.cast(type, hint), key)
            continue
        yield KeyDoc(key, _type_text(hint), _default_text(f), _allowed_text(key, hint, f), docs[f.name])


def _field_line(cls: type, name: str) -> str:
    source = inspect.getsourcefile(cls) or "?"
    for node in ast.walk(_module_tree(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
                    return f"{source}:{stmt.lineno}"
    return source


def _type_text(hint: Any) -> str:
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "str"
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return " or ".join(_type_text(a) for a in args) + " or null"
    origin = typing.get_origin(hint)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_text(a) for a in typing.get_args(hint))}]"
    return getattr(hint, "__name__", str(hint))


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return _value_text(f.default)
    factory = typing.cast(Callable[[], Any], f.default_factory)
    return _value_text(factory())


def _value_text(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_value_text(v) for v in value) + "]"
    if isinstance(value, str) and not value:
        return '""'
    return str(value)


def _allowed_text(key: str, hint: Any, f: dataclasses.Field[Any]) -> str:
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return " \\| ".join(str(m.value) for m in hint)
    if key in CHECKED_IN_VALIDATE:
        return CHECKED_IN_VALIDATE[key]
    m = f.metadata
    if "choices" in m:
        return " \\| ".join(m["choices"])
    if not m:
        return ""
    low = f"[{m['ge']}" if m["ge"] is not None else f"({m['gt']}" if m["gt"] is not None else ""
    if m["le"] is not None:
        bound = f"{low or '(-inf'}, {m['le']}]"
    else:
        bound = f">= {m['ge']}" if m["ge"] is not None else f"> {m['gt']}"
    return f"{bound} ({m['note']})" if m["note"] else bound


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\\\\|", "\\|")


def render(schema: type = config.GKDConfig) -> str:
    """The whole page: the intro, then one table per top-level section of `schema`."""
    parts = [INTRO]
    section_docs = field_docstrings(schema)
    rows = list(walk_schema(schema))
    for f in dataclasses.fields(schema):
        see = ", ".join(f"[{name}]({name})" for name in SECTION_PAGES.get(f.name, ()))
        parts.append(f"## {f.name}\n\n{section_docs[f.name]}" + (f" More: {see}." if see else "") + "\n")
        parts.append("| key | type | default | allowed | meaning |\n|---|---|---|---|---|")
        for row in rows:
            if row.key.startswith(f.name + ".") or (row.key == f.name and row.type != "section"):  # a top-level map
                cells = [f"`{row.key}`", row.type, f"`{row.default}`" if row.default else "", row.allowed, row.meaning]
                parts.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        parts.append("")
    parts.extend(_server_section())
    aliases = "\n".join(f"| `{name}` | `{key}` |" for name, key in config.KEY_ALIASES.items())
    parts.append(
        "## Names from other recipes\n\nAn override with one of these names fails and names the key it means:\n\n"
        f"| name | key |\n|---|---|\n{aliases}\n"
    )
    return "\n".join(parts)


def _server_section() -> list[str]:
    """The teacher server's own `server:` keys (a standalone teacher yaml, `python -m teacher_server`)."""
    from teacher_server.server.settings import ServerSection

    see = ", ".join(f"[{name}]({name})" for name in SECTION_PAGES["server"])
    parts = [f"## server\n\n{class_docstring(ServerSection)} More: {see}.\n"]
    parts.append("| key | type | default | allowed | meaning |\n|---|---|---|---|---|")
    for row in walk_schema(ServerSection, "server"):
        cells = [f"`{row.key}`", row.type, f"`{row.default}`" if row.default else "", row.allowed, row.meaning]
        parts.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    parts.append("")
    return parts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from the schema's")
    parser.add_argument("--out", type=Path, default=PAGE, help=f"the page (default {PAGE})")
    args = parser.parse_args(argv)
    return write_or_check(render(), args.out, check=args.check, command=COMMAND, source="the schema")


def write_or_check(page: str, out: Path, *, check: bool, command: str, source: str) -> int:
    """Write a generated page, or (check) exit 1 when the committed one differs: the generated docs' one CLI."""
    if check:
        if not out.is_file() or out.read_text() != page:
            print(f"{out} is not what {source} generates: run `{command}` and commit it", file=sys.stderr)
            return 1
        print(f"{out} is up to date")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
