"""docs/configuration.md is what the schema generates, and a schema field without a docstring is refused."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from recipe_gkd import config_reference
from recipe_gkd.config_reference import UndocumentedFieldError, main, render, walk_schema


@dataclass
class _Inner:
    depth: int = 3
    """How deep."""
    mode: str = "fast"


@dataclass
class _Outer:
    name: str = "x"
    """The name."""
    inner: _Inner = field(default_factory=_Inner)
    """The inner section."""


@dataclass
class _Documented:
    size: int = 2
    """Size of
    the thing | in units."""


def test_the_committed_page_is_what_the_schema_generates() -> None:
    page = config_reference.PAGE
    assert page.is_file(), f"{page} is missing: run `{config_reference.COMMAND}`"
    assert page.read_text() == render(), f"{page} is stale: run `{config_reference.COMMAND}` and commit it"


def test_check_exits_1_on_a_stale_page_and_0_on_a_fresh_one(tmp_path: Path) -> None:
    out = tmp_path / "configuration.md"
    assert main(["--check", "--out", str(out)]) == 1  # missing
    assert main(["--out", str(out)]) == 0
    assert main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text().replace("Nodes in the run.", "Nodes."))
    assert main(["--check", "--out", str(out)]) == 1


def test_every_key_of_the_schema_has_a_row() -> None:
    page = render()
    for key in ("cluster.nnodes", "actor.megatron.tp", "teacher.client.max_inflight", "algorithm.divergence"):
        assert f"| `{key}` |" in page
    # Allowed values come from the enum, the declared choices and bounds.
    assert "forward_kl \\| reverse_kl \\| jsd \\| sampled_reverse_kl" in page
    assert "| `data.answer_match` | str | `exact` | exact \\| suffix |" in page
    assert "| `algorithm.beta` | float | `0.5` | [0, 1] |" in page


def test_a_field_without_a_docstring_is_refused_by_name() -> None:
    with pytest.raises(
        UndocumentedFieldError, match=r"config key inner\.mode \(field _Inner\.mode, .*test_config_reference\.py:\d+\)"
    ):
        list(walk_schema(_Outer))


def test_a_documented_dataclass_gives_its_rows() -> None:
    (row,) = walk_schema(_Documented)
    assert (row.key, row.type, row.default, row.meaning) == ("size", "int", "2", "Size of the thing | in units.")


def test_the_layout_page_is_what_the_tree_generates() -> None:
    from recipe_gkd import layout_reference

    assert layout_reference.PAGE.read_text() == layout_reference.render(), (
        f"docs/layout.md is stale: run `{layout_reference.COMMAND}` and commit it"
    )


def test_the_layout_page_refuses_a_module_without_a_docstring(tmp_path: Path) -> None:
    from recipe_gkd import layout_reference

    for package in layout_reference.PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text('"""The package. More words."""\n')
    (tmp_path / "recipe_gkd" / "good.py").write_text('"""Holds a thing (e.g. a map). And more."""\n')
    page = layout_reference.render(tmp_path)
    assert "| `good.py` | Holds a thing (e.g. a map). |" in page
    assert "The package." in page and "More words" not in page
    (tmp_path / "teacher_server" / "bare.py").write_text("x = 1\n")
    with pytest.raises(layout_reference.UndocumentedModuleError, match=r"teacher_server/bare\.py"):
        layout_reference.render(tmp_path)


def test_the_teacher_servers_own_keys_are_in_the_reference() -> None:
    """The `server:` section of a teacher yaml (not in a run's schema) has its table, a row per field."""
    import dataclasses as dc

    from teacher_server.server.settings import ServerSection

    page = render()
    section = page[page.index("## server\n") :]
    for f in dc.fields(ServerSection):
        assert f"| `server.{f.name}` |" in section, f.name
