"""The layout page, docs/layout.md, generated from the tree: every package and module with its docstring's first sentence.

A module without a docstring is an error naming it, so the page cannot leave one out; a test fails
when the committed page differs from what the tree generates (as for the configuration reference).

    python -m recipe_gkd.layout_reference            # writes docs/layout.md
    python -m recipe_gkd.layout_reference --check    # exit 1 when the committed page differs
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from recipe_gkd import config
from recipe_gkd.config_reference import write_or_check

PAGE = config.REPO_ROOT / "docs" / "layout.md"
COMMAND = "python -m recipe_gkd.layout_reference"
PACKAGES = ("recipe_gkd", "teacher_server")
# A sentence ends at a period followed by a space or the end, not after "e.g" / "i.e".
SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)\.(\s|$)")

INTRO = f"""# Layout

```bash
python -m pytest tests/test_architecture.py    # the seams below
```

Generated from the tree by `{COMMAND}`: each package and module with the first sentence of its
docstring (a test fails when this page differs from what the tree generates; edit the docstring, then rerun it).

The seams `tests/test_architecture.py` checks: no import cycle, and no strongly connected component of the import graph
across two packages (a package's `__init__` counted); the wings in layers, each importing only its own and the ones
below (bottom up: the teacher server; messages, envs; teacher_prompt; config; batch, data, the stop set, the parallel
layout, the weight sync, process memory, losses, the model families, the offline models; cross_tokenizer; actor;
rollout; the target kinds; the loop's pools contract and the plan; observe and the preflight; the runtime; the exit
codes and the loop; the doctor, the self-check, the demo; the CLI and the reference generators); Ray imported by `runtime/ray_pools.py` and
`runtime/ray_cluster.py` only; vLLM by one module on each side (`rollout/vllm.py`, `teacher_server/server/backends/vllm.py`);
megatron-core inside `recipe_gkd/actor/` only; `teacher_server/` imports nothing of `recipe_gkd`, and inside it
`wire/` and `config/` import neither `server/` nor `client/` (nor each other) and `client/` imports no `server/`
module; the product imports nothing of `recipe_gkd/demo/`. (A bad config or a dry run imports none of torch, Ray, vLLM,
megatron-core: `tests/recipe_gkd/config/test_config.py`.)
"""

AROUND = """## Around the packages

| folder | what it holds |
|---|---|
| `configs/presets/` | the presets: GPU splits (one GPU, one node, several nodes) and the CPU demos ([gpu_splits.md](gpu_splits.md#presets-configspresets)) |
| `configs/teacher/` | standalone teacher server yamls (`python -m teacher_server --config PATH`) |
| `launch/` | the launch scripts: Ray on each node, the teacher server, the run |
| `benchmarks/` | each script prints a table and writes JSON under `benchmarks/results/` ([benchmarks.md](benchmarks.md)) |
| `tests/` | the tree's mirror: a module's tests under its own path (`recipe_gkd/rollout/multi_turn.py`: `tests/recipe_gkd/rollout/`, `launch/`: `tests/launch/`); `e2e/` the whole program through the CLI; `support/` the helpers tests share; markers `slow`, `vllm`, `gpu` |
| `docs/` | the guides; `docs/results/` the measurement reports they cite |
| `assets/` | the CPU demos' models and data, built offline (`python -m recipe_gkd.demo.build_assets`) |
"""

ADDING_A_MODEL_FAMILY = """## Adding a model family

A student family the megatron actor reproduces is one module and one registry line:

1. `recipe_gkd/models/<family>.py`: a `ModelFamily` subclass (`recipe_gkd/models/base.py`) with its `model_types`,
   what it refuses (`refuse`: an `UnsupportedModelError` naming the feature), its shape facts (`qkv_bias`,
   `qk_layernorm`), its decoder layer's table (`layer`: each megatron tensor with the HF tensors it converts from and
   how) and, where they differ from the dense base's, its megatron fields (`transformer_config`, `layer_spec`); where
   transformers stacks tensors the checkpoint holds one by one (Qwen3-MoE's experts), `stacked`: the HF rollout
   engine's views of them under the checkpoint's names;
2. its instance in `FAMILIES` (`recipe_gkd/models/__init__.py`);
3. its config in `CONFIGS` of `tests/recipe_gkd/models/test_model_families.py`: its table is checked against
   transformers' own model, its refusals by message.

The plan's shape, the conversion (`actor/hf_convert.py`) and the megatron model (`actor/mcore_model.py`) read the family
from the student's `HFArch` and test none; a new way of converting a tensor is one entry of hf_convert's `TO_MCORE` and
`TO_HF`.
"""


ADDING_A_TRANSPORT = """## Adding a weight-sync transport or payload

One class each, in `recipe_gkd/weight_sync/`: a transport (how bytes reach the engines: `transports.py`, beside
`ObjectStore`, `Gloo`, `Nccl`, `InProcess`) implements `Transport` and is chosen in `runtime/ray_pools.py
ray_transport`, the one place that reads `weight_sync.transport`; a payload (what is synced: `payload.py`, beside
`FullStudent`) implements `SyncPayload` (the actor's export, the engine's load) and is chosen in `build_payload`
([weight_sync.md](weight_sync.md#adding-a-transport-or-a-synced-payload)).
"""

ADDING_A_CHECK = """## Adding a check before the first step

A check is a function of the config returning its one-line figure (or a `Finding`, for a warning or a report), raising
`ConfigError(key, message)` when the run must not start: wrap it in `Check(name, function)` and list it where it runs,
`START_CHECKS` or `DRY_RUN_CHECKS` (`recipe_gkd/preflight.py`, every start and every dry run), or the doctor's
`STATIC_CHECKS` (`recipe_gkd/doctor.py`, for what costs more than a start should:
[before_the_first_step.md](before_the_first_step.md#the-doctor)). Its test feeds it the wrong input and checks the key.
"""


class UndocumentedModuleError(ValueError):
    """A module without a docstring: the layout page would leave it out."""


@dataclass(frozen=True)
class Entry:
    """One module (or a package's `__init__.py`) and what it holds."""

    path: str
    summary: str


def first_sentence(docstring: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line."""
    paragraph = " ".join(docstring.split("\n\n")[0].split())
    end = SENTENCE_END.search(paragraph)
    return paragraph[: end.start() + 1] if end else paragraph


def summary_of(path: Path, root: Path) -> str:
    """`path`'s docstring's first sentence; a module without one raises, naming it."""
    docstring = ast.get_docstring(ast.parse(path.read_text(), filename=str(path)))
    if not docstring:
        raise UndocumentedModuleError(
            f"{path.relative_to(root)} has no module docstring: add one whose first sentence says what it holds; "
            f"docs/layout.md is generated from it (`{COMMAND}`)"
        )
    return first_sentence(docstring)


def package_dirs(root: Path) -> list[Path]:
    """Every package directory under PACKAGES (an `__init__.py` in it), in path order."""
    found = [init.parent for name in PACKAGES for init in (root / name).rglob("__init__.py")]
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def entries(package: Path, root: Path) -> list[Entry]:
    """The modules directly in `package`, `__init__.py` first (as the package's own line)."""
    modules = sorted(p for p in package.glob("*.py") if p.name != "__init__.py")
    return [Entry(str(p.relative_to(root)), summary_of(p, root)) for p in [package / "__init__.py", *modules]]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(root: Path = config.REPO_ROOT) -> str:
    """The whole page: the intro, a table per package, then the folders around them."""
    parts = [INTRO]
    for package in package_dirs(root):
        init, *modules = entries(package, root)
        parts.append(f"## `{package.relative_to(root)}/`\n\n{init.summary}\n")
        if modules:
            parts.append("| module | what it holds |\n|---|---|")
            parts.extend(f"| `{Path(e.path).name}` | {_cell(e.summary)} |" for e in modules)
            parts.append("")
    parts.append(AROUND)
    parts += [ADDING_A_MODEL_FAMILY, ADDING_A_TRANSPORT, ADDING_A_CHECK]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from the tree's")
    parser.add_argument("--out", type=Path, default=PAGE, help=f"the page (default {PAGE})")
    args = parser.parse_args(argv)
    return write_or_check(render(), args.out, check=args.check, command=COMMAND, source="the tree")


if __name__ == "__main__":
    sys.exit(main())
