"""check_placement on fake GPUs: what each worker sees from inside equals the plan, per preset."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipe_gkd.config import CONFIG_DIR, load_config
from recipe_gkd.plan.placement import build_plan

FAKE = ["cluster.fake_gpus=true", "cluster.ray_address=null", "cluster.placement_timeout_s=60"]


# What Ray itself decides (a bundle's GPUs and node, seen from inside its worker) in each distinct situation: GPUs kept
# back for the teacher under a CUDA_VISIBLE_DEVICES mask (1x4_a1_r1_t2, below), one node given whole to the workers
# (1x8_a4_r4_t0_remote), two nodes with the teacher's GPUs kept back on the second (2x8_a8_r4_t4). Every preset's plan
# is checked in-process (tests/recipe_gkd/plan/test_placement.py, tests/configs/test_gpu_presets.py); the other
# presets place the same way with other counts, and each check starts a Ray cluster (~10-30 s of the suite).
MULTI_GPU = [
    CONFIG_DIR / "presets" / name for name in ("1x4_a1_r1_t2.yaml", "1x8_a4_r4_t0_remote.yaml", "2x8_a8_r4_t4.yaml")
]


def _check(path: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "recipe_gkd.runtime.check_placement", "--config", str(path), *FAKE, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False, env=env)


def _seen_rows(stdout: str) -> list[tuple[str, int, int, str]]:
    section = stdout.split("seen from inside the workers:")[1].splitlines()[2:]
    rows = [line.split() for line in section if line and line.split()[0] in ("actor", "rollout")]
    return [(r[0], int(r[1]), int(r[2]), r[3]) for r in rows]


# A shared node: CUDA_VISIBLE_DEVICES=3,5,6,7 before the run. Ray hands out those devices, and the plan's check
# expects the masked ones (plan id i -> MASK[i]; the teacher's --gpu-ids 6,7: tests/recipe_gkd/plan/test_placement.py).
MASK = "3,5,6,7"
MASKED_PRESET = "1x4_a1_r1_t2.yaml"


@pytest.mark.slow
@pytest.mark.parametrize("path", MULTI_GPU, ids=lambda p: p.name)
def test_workers_see_the_planned_gpus(path: Path) -> None:
    """Each distinct placement; the 1x4 preset under a CUDA_VISIBLE_DEVICES mask (its plan ids map to the mask's)."""
    assert MASKED_PRESET in [p.name for p in MULTI_GPU]
    masked = path.name == MASKED_PRESET
    proc = _check(path, env={**os.environ, "CUDA_VISIBLE_DEVICES": MASK} if masked else None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "placement OK" in proc.stdout
    plan = build_plan(load_config(path, FAKE))
    expected = [(s.role, s.rank, s.node, s.cuda_visible_devices) for s in plan.workers]
    if masked:
        expected = [(role, rank, node, MASK.split(",")[int(ids)]) for role, rank, node, ids in expected]
        assert [row[3] for row in expected] == ["3", "5"]
    assert _seen_rows(proc.stdout) == expected


def test_bad_config_exits_2() -> None:
    proc = _check(CONFIG_DIR / "presets" / "1x8_a1_r3_t4.yaml", "actor.gpus_per_node=6", "rollout.gpus_per_node=4")
    assert proc.returncode == 2 and "actor.gpus_per_node" in proc.stderr
