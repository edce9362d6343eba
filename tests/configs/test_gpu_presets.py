"""Every GPU preset is a run a user can launch as is: its dry run exits 0 and prints a run with evaluation and
checkpoints, and the yaml itself sets the run (not the schema's defaults) under a header saying what it needs."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from recipe_gkd.config import CONFIG_DIR, load_config
from recipe_gkd.main import main

GPU_PRESETS = sorted(p for p in (CONFIG_DIR / "presets").glob("*.yaml") if not p.name.startswith("cpu_"))
CPU_PRESETS = sorted((CONFIG_DIR / "presets").glob("cpu_*.yaml"))
# Keys a launchable run sets itself: left to the schema, a run trains 100 steps on `sync`, never evaluates and
# never writes a checkpoint.
RUN_KEYS = (
    "trainer.total_steps",
    "trainer.eval_every",
    "trainer.save_every",
    "trainer.keep_last",
    "algorithm.schedule",
    "actor.optim.lr",
    "data.eval_files",
)


def test_every_gpu_preset_is_covered() -> None:
    names = {p.stem for p in GPU_PRESETS}
    assert {"1x1_colocated", "1x8_a1_r3_t4", "2x8_a8_r4_t4"} <= names and len(names) >= 7


@pytest.mark.parametrize("path", GPU_PRESETS, ids=lambda p: p.stem)
def test_gpu_preset_sets_its_run(path: Path) -> None:
    raw = OmegaConf.load(path)
    missing = [key for key in RUN_KEYS if OmegaConf.select(raw, key, default=None) in (None, [], "")]
    assert not missing, f"{path.name} leaves {missing} to the schema's defaults"
    cfg = load_config(path)
    assert cfg.trainer.eval_every > 0 and cfg.trainer.save_every > 0
    assert cfg.trainer.save_every <= cfg.trainer.total_steps and cfg.trainer.eval_every <= cfg.trainer.total_steps
    header = path.read_text().splitlines()[0]
    assert header.startswith("# Needs: ") and "GPU" in header and "GB" in header, header


@pytest.mark.parametrize("path", GPU_PRESETS, ids=lambda p: p.stem)
def test_gpu_preset_dry_run_prints_a_run_with_evaluation_and_checkpoints(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    cfg = load_config(path)
    run = next(line for line in out.splitlines() if line.startswith("run: "))
    tr = cfg.trainer
    assert run.startswith(f"run: {tr.total_steps} steps, schedule {cfg.algorithm.schedule.value}, ")
    assert f"evaluation every {tr.eval_every} steps on the first {cfg.data.eval_batch_size} records of " in run
    assert f"a checkpoint every {tr.save_every} steps, the last {tr.keep_last} kept in {tr.run_dir}" in run
    assert out.rstrip().endswith("dry run: config valid, nothing started")


@pytest.mark.parametrize("path", CPU_PRESETS, ids=lambda p: p.stem)
def test_cpu_preset_says_whether_it_checkpoints(path: Path) -> None:
    """A CPU preset chooses save_every itself (0 for the demos of a few minutes), with the reason beside it."""
    raw = OmegaConf.load(path)
    assert OmegaConf.select(raw, "trainer.save_every", default=None) is not None, path.name
    lines = path.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("save_every:"))
    assert lines[at - 1].strip().startswith("#"), f"{path.name}: a comment above save_every says why"


def test_dry_run_says_when_a_run_never_checkpoints(capsys: pytest.CaptureFixture[str]) -> None:
    path = CONFIG_DIR / "presets" / "1x1_colocated.yaml"
    assert main(["--config", str(path), "--dry-run", "trainer.save_every=0", "trainer.eval_every=0"]) == 0
    run = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("run: "))
    assert "no evaluation (trainer.eval_every=0)" in run
    assert "no checkpoints (trainer.save_every=0): a stopped run starts again from step 0" in run
