"""check_placement on fake GPUs: what each worker sees from inside equals the plan, per preset."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipe_gkd.config import CONFIG_DIR, load_config
from recipe_gkd.placement import build_plan

FAKE = ["cluster.fake_gpus=true", "cluster.ray_address=null", "cluster.placement_timeout_s=60"]
# These presets have cpu_demo.yaml's cluster section: cpu_demo.yaml is enough.
SAME_AS_DEMO = ("cpu_paper.yaml", "cpu_real_pair.yaml")
MULTI_GPU = [
    p
    for p in sorted((CONFIG_DIR / "presets").glob("*.yaml"))
    if load_config(p).cluster.gpus_per_node > 1 and p.name not in SAME_AS_DEMO
]


def _check(path: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "recipe_gkd.check_placement", "--config", str(path), *FAKE, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False, env=env)


def _seen_rows(stdout: str) -> list[tuple[str, int, int, str]]:
    section = stdout.split("seen from inside the workers:")[1].splitlines()[2:]
    rows = [line.split() for line in section if line and line.split()[0] in ("actor", "rollout")]
    return [(r[0], int(r[1]), int(r[2]), r[3]) for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("path", MULTI_GPU, ids=lambda p: p.name)
def test_workers_see_the_planned_gpus(path: Path) -> None:
    assert len(MULTI_GPU) >= 5
    proc = _check(path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "placement OK" in proc.stdout
    plan = build_plan(load_config(path, FAKE))
    expected = [(s.role, s.rank, s.node, s.cuda_visible_devices) for s in plan.workers]
    assert _seen_rows(proc.stdout) == expected


def test_a_preset_mask_maps_plan_ids_to_its_devices() -> None:
    """CUDA_VISIBLE_DEVICES=3,5,6,7 (a shared node): Ray hands the actor 3 and the rollout 5, and the
    plan's check expects exactly those (the teacher's --gpu-ids 6,7: tests/unit/test_placement.py)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "3,5,6,7"}
    proc = _check(CONFIG_DIR / "presets" / "1x4_a1_r1_t2.yaml", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [row[3] for row in _seen_rows(proc.stdout)] == ["3", "5"]


def test_bad_config_exits_2() -> None:
    proc = _check(CONFIG_DIR / "presets" / "1x8_a1_r3_t4.yaml", "actor.gpus_per_node=6", "rollout.gpus_per_node=4")
    assert proc.returncode == 2 and "actor.gpus_per_node" in proc.stderr
