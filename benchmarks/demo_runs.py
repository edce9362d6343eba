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


def finished_evals(overrides: tuple[str, ...], out: Path, preset: Path | None = None) -> list[dict] | None:
    """The run's eval.jsonl rows when `out` holds a finished run of exactly this config (preset None: the demo's)."""
    cfg = load_config(preset, [*overrides, f"trainer.run_dir={out}"])
    resolved, evals = out / "resolved_config.yaml", out / "eval.jsonl"
    if not (resolved.is_file() and evals.is_file()) or resolved.read_text() != to_yaml(cfg):
        return None
    rows = [json.loads(line) for line in evals.read_text().splitlines()]
    return rows if rows and rows[-1]["step"] == cfg.trainer.total_steps else None


def accuracy_curve(overrides: tuple[str, ...], out: Path, preset: Path | None = None) -> Curve | None:
    """The run's (step, held-out accuracy) when `out` holds a finished run of exactly this config."""
    rows = finished_evals(overrides, out, preset)
    return None if rows is None else [(r["step"], r["eval_reward"]) for r in rows]


def run_demo(
    overrides: tuple[str, ...], out: Path, timeout_s: float = 1800, preset: Path | None = None
) -> tuple[Curve, float | None]:
    """One CLI run of `preset` (None: the demo's) with `overrides`, reused when finished before: its accuracy curve
    and wall time (None when reused). The run's console goes to `<out>.log` beside the run directory."""
    curve = accuracy_curve(overrides, out, preset)
    if curve is not None:
        return curve, None
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = ["--config", str(preset)] if preset is not None else []
    cmd = [sys.executable, "-m", "recipe_gkd.main", *config, *overrides, f"trainer.run_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log_path = out.parent / f"{out.name}.log"
    start = time.monotonic()
    with log_path.open("w") as log:
        subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=timeout_s)
    wall = time.monotonic() - start
    print(f"  {out.name}: {wall:.0f} s", flush=True)
    curve = accuracy_curve(overrides, out, preset)
    if curve is None:
        raise RuntimeError(f"{out} did not finish; see {log_path}")
    return curve, wall


def print_final_table(names: list[str], results: list[dict], seeds: list[int], start: float) -> None:
    """One markdown row per named row: each seed's final held-out accuracy, their mean and its gain over `start`.

    `results`: dicts with "row" (an index into names), "seed" and "curve" (run_demo's)."""
    print(f"| run | {' | '.join(f'seed {s}' for s in seeds)} | mean | gain (points) |")
    print(f"|---|{'---|' * len(seeds)}---|---|")
    for index, name in enumerate(names):
        final = {r["seed"]: r["curve"][-1][1] for r in results if r["row"] == index}
        if not final:
            continue
        cells = [f"{100 * final[s]:.1f}" if s in final else "-" for s in seeds]
        mean = sum(final.values()) / len(final)
        print(f"| {name} | {' | '.join(cells)} | {100 * mean:.1f} | {100 * (mean - start):+.1f} |")
