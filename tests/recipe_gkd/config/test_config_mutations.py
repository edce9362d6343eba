"""Random mutations of every preset yaml (wrong types, unknown keys, impossible GPU splits) through the
real entry point `recipe_gkd.main.main([... --dry-run])`: exit 0 or exit 2 with one line naming a key,
never an uncaught exception."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from recipe_gkd.config import CONFIG_DIR
from recipe_gkd.exit_codes import EXIT_BAD_CONFIG
from recipe_gkd.main import main

PRESETS = sorted((CONFIG_DIR / "presets").glob("*.yaml"))
MUTATIONS = 400
SEED = 20261122
WRONG_VALUES: list[Any] = ["abc", "", -1, 0, 2.5, -3.0, True, None, [], [1, "x"], {}, {"a": 1}, "1e999", 10**12]
SPLIT_KEYS = [
    ("cluster", "gpus_per_node"),
    ("cluster", "nnodes"),
    ("actor", "gpus_per_node"),
    ("actor", "nnodes"),
    ("actor", "node_offset"),
    ("rollout", "gpus_per_node"),
    ("rollout", "nnodes"),
    ("rollout", "tp"),
    ("teacher", "replicas"),
    ("teacher", "gpus_per_replica"),
    ("actor", "megatron"),
]


def _leaves(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for key, value in tree.items():
        path = (*prefix, str(key))
        out.extend(_leaves(value, path) if isinstance(value, dict) and value else [path])
    return out


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            return
    node[path[-1]] = value


def wrong_type(tree: dict[str, Any], rng: random.Random) -> str:
    path = rng.choice(_leaves(tree))
    value = rng.choice(WRONG_VALUES)
    _set(tree, path, value)
    return f"{'.'.join(path)}={value!r}"


def unknown_key(tree: dict[str, Any], rng: random.Random) -> str:
    sections = [()] + [p[:-1] for p in _leaves(tree) if len(p) > 1]
    parent = rng.choice(sections)
    name = rng.choice(["learning_rate", "n_server_workers", "gpus", "tp_size", "foo", "actor", "lr"]) + str(
        rng.randint(0, 2) or ""
    )
    _set(tree, (*parent, name), rng.choice([1, "x", {"y": 2}]))
    return f"{'.'.join((*parent, name))} (new)"


def impossible_split(tree: dict[str, Any], rng: random.Random) -> str:
    changed = []
    for _ in range(rng.randint(1, 3)):
        section, key = rng.choice(SPLIT_KEYS)
        value: Any = {"tp": rng.randint(0, 9)} if key == "megatron" else rng.randint(-1, 17)
        _set(tree, (section, key), value)
        changed.append(f"{section}.{key}={value}")
    return ", ".join(changed)


def drop_section(tree: dict[str, Any], rng: random.Random) -> str:
    key = rng.choice(list(tree))
    tree[key] = rng.choice([None, [], "none", 3])
    return f"{key}={tree[key]!r}"


MUTATORS: list[Callable[[dict[str, Any], random.Random], str]] = [
    wrong_type,
    unknown_key,
    impossible_split,
    drop_section,
]


def test_random_preset_mutations_exit_0_or_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(SEED)
    bases = {p: yaml.safe_load(p.read_text()) for p in PRESETS}
    outcomes = {0: 0, EXIT_BAD_CONFIG: 0}
    for i in range(MUTATIONS):
        preset = rng.choice(PRESETS)
        tree = copy.deepcopy(bases[preset])
        mutator = rng.choice(MUTATORS)
        what = mutator(tree, rng)
        path = tmp_path / f"m{i}.yaml"
        path.write_text(yaml.safe_dump(tree))
        try:
            code = main(["--config", str(path), "--dry-run"])
        except SystemExit as exit_:  # argparse and friends: still an exit code, not a traceback
            code = exit_.code  # type: ignore[assignment]
        err = capsys.readouterr().err
        context = f"mutation {i} of {preset.name} ({mutator.__name__}: {what})"
        assert code in outcomes, f"{context}: exit {code}\n{err}"
        outcomes[code] += 1
        if code == EXIT_BAD_CONFIG:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: config error at `"), f"{context}: {err}"
    assert outcomes[EXIT_BAD_CONFIG] > MUTATIONS // 2, outcomes
