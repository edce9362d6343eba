"""Run the demo CLI once per (overrides, run directory), reusing a finished run of exactly that config.

Shared by the learning tables (sampled_rkl_table.py, support_learning_table.py): a run directory whose
resolved config equals the requested one and whose evaluation reached the last step is not run again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from recipe_gkd.config import load_config, to_yaml

REPO = Path(__file__).resolve().parents[1]
Curve = list[tuple[int, float]]


def accuracy_curve(overrides: tuple[str, ...], out: Path, config: Path | None = None) -> Curve | None:
    """The run's (step, held-out accuracy) when `out` holds a finished run of exactly this config
    (`config`: the preset, None for the CPU demo's)."""
    cfg = load_config(config, [*overrides, f"trainer.run_dir={out}"])
    resolved, evals = out / "resolved_config.yaml", out / "eval.jsonl"
    if not (resolved.is_file() and evals.is_file()) or resolved.read_text() != to_yaml(cfg):
        return None
    rows = [json.loads(line) for line in evals.read_text().splitlines()]
    if not rows or rows[-1]["step"] != cfg.trainer.total_steps:
        return None
    return [(r["step"], r["eval_reward"]) for r in rows]


def run_demo(
    overrides: tuple[str, ...], out: Path, timeout_s: float = 1800, config: Path | None = None
) -> tuple[Curve, float | None]:
    """One demo CLI run (reused when finished before): its accuracy curve and wall time (None when reused).

    `config`: the preset (`--config`; None: the CPU demo's). The run's console goes to `<out>.log` beside
    the run directory."""
    curve = accuracy_curve(overrides, out, config)
    if curve is not None:
        return curve, None
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    preset = ["--config", str(config)] if config is not None else []
    cmd = [sys.executable, "-m", "recipe_gkd.main", *preset, *overrides, f"trainer.run_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log_path = out.parent / f"{out.name}.log"
    start = time.monotonic()
    with log_path.open("w") as log:
        subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=timeout_s)
    wall = time.monotonic() - start
    print(f"  {out.name}: {wall:.0f} s", flush=True)
    curve = accuracy_curve(overrides, out, config)
    if curve is None:
        raise RuntimeError(f"{out} did not finish; see {log_path}")
    return curve, wall
