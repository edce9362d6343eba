"""The demo recipe on Ray (the CLI) against the same recipe in one process (local pools), per phase.

    python benchmarks/bench_recipe_overhead.py [--steps 40] [--schedule sync] [key=value ...]

Both runs use the demo preset, its models and data, evaluation off, the same seed: the
in-process run is `gkd.train` on `recipe_gkd.runtime.local_pools` (the real actor, rollout worker and
the teacher server's HF backend, called directly), the Ray run is `python -m recipe_gkd.main`.
Prints the median seconds of each phase (steps after the first 3), the ratio Ray / in-process,
and each run's process wall time; writes JSON to benchmarks/results/recipe_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "recipe_overhead.json"
PHASES = ("generate_s", "teacher_s", "rollout_wait_s", "train_s", "sync_s", "step_s")
WARMUP_STEPS = 3


EXTRA: list[str] = []  # key=value overrides from the command line, for both runs


def overrides(run_dir: Path, steps: int, schedule: str) -> list[str]:
    return [
        f"trainer.run_dir={run_dir}",
        f"trainer.total_steps={steps}",
        "trainer.eval_every=0",
        f"algorithm.schedule={schedule}",
        *EXTRA,
    ]


def in_process(run_dir: Path, steps: int, schedule: str) -> float:
    """Wall seconds of the whole in-process run (set-up, training, export), in a fresh process."""
    code = (
        "import sys\n"
        "from recipe_gkd import gkd\n"
        "from recipe_gkd.config import load_config\n"
        "from recipe_gkd.runtime.local_pools import local_pools\n"
        "from recipe_gkd.observe.metrics import MetricsLogger\n"
        "cfg = load_config(None, sys.argv[1:])\n"
        "metrics = MetricsLogger(cfg.trainer.run_dir, ['jsonl'], cfg.trainer.total_steps)\n"
        "with local_pools(cfg) as pools:\n"
        "    gkd.train(cfg, pools, metrics, None)\n"
        "metrics.close()\n"
    )
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, *overrides(run_dir, steps, schedule)], cwd=ROOT, check=True)
    return time.perf_counter() - start


def on_ray(run_dir: Path, steps: int, schedule: str) -> float:
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "recipe_gkd.main", *overrides(run_dir, steps, schedule)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return time.perf_counter() - start


def phases(run_dir: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][WARMUP_STEPS:]
    return {p: statistics.median(r[p] for r in rows) for p in PHASES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--schedule", default="sync", choices=("sync", "one_step_off", "two_step_off"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("overrides", nargs="*", help="key=value for both runs, e.g. cluster.worker_threads=1")
    args = parser.parse_args()
    EXTRA.extend(args.overrides)
    results: dict[str, Any] = {
        "steps": args.steps,
        "schedule": args.schedule,
        "overrides": args.overrides,
        "warmup_steps": WARMUP_STEPS,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in (("in_process", in_process), ("ray", on_ray)):
            run_dir = Path(tmp) / name
            wall = run(run_dir, args.steps, args.schedule)
            results[name] = {"process_wall_s": round(wall, 2), **{k: round(v, 4) for k, v in phases(run_dir).items()}}
    print(
        f"\n{args.steps} steps, schedule {args.schedule} {' '.join(args.overrides)}; medians after {WARMUP_STEPS} steps, s"
    )
    print(f"{'':16}{'in-process':>12}{'ray':>10}{'ray / in':>10}")
    for key in (*PHASES, "process_wall_s"):
        inproc, ray = results["in_process"][key], results["ray"][key]
        print(f"{key:16}{inproc:>12.4f}{ray:>10.4f}{ray / inproc if inproc else float('nan'):>10.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
