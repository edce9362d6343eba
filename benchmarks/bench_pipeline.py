"""Step time of the three schedules on the CPU demo models, in one run: does the overlap pay?

    .venv/bin/python benchmarks/bench_pipeline.py [--steps 12] [--latencies 0,auto]

Runs the real CLI (`python -m recipe_gkd.main`) once per (schedule, teacher latency) with
the same config, reads metrics.jsonl, and reports medians after warm-up: per-phase seconds
(generate, teacher, train, sync, as measured inside the workers), the step time, the step time
divided by the slowest stage, and the speedup over sync. On a 2-core machine generation,
scoring and training compete for the same cores, so the overlap is also measured with an
emulated remote teacher (debug.teacher_latency_s: a sleep that uses no CPU).
Writes benchmarks/results/bench_pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recipe_gkd.observe.metrics import read_metrics  # noqa: E402

SCHEDULES = ("sync", "one_step_off", "two_step_off")
PHASES = ("generate_s", "teacher_s", "train_s", "sync_s")
WARMUP_STEPS = 2
RESULTS = ROOT / "benchmarks" / "results" / "bench_pipeline.json"


def run_schedule(schedule: str, steps: int, latency: float, overrides: list[str], out: Path) -> dict[str, float]:
    run_dir = out / f"{schedule}_lat{latency:g}"
    cmd = [
        sys.executable,
        "-m",
        "recipe_gkd.main",
        f"algorithm.schedule={schedule}",
        f"trainer.total_steps={steps}",
        "trainer.eval_every=0",
        f"debug.teacher_latency_s={latency}",
        f"trainer.run_dir={run_dir}",
        "teacher.address=tcp://127.0.0.1:0",
        *overrides,
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{schedule} failed:\n{proc.stderr[-3000:]}")
    rows = read_metrics(run_dir)[WARMUP_STEPS:]
    result = {k: statistics.median(r[k] for r in rows) for k in (*PHASES, "step_s")}
    result["wall_s"] = time.perf_counter() - start
    return result


def slowest_stage(schedule: str, r: dict[str, float]) -> float:
    """The time a step cannot go below under `schedule`: its longest stage that does not overlap.

    sync: nothing overlaps (the sum). one_step_off: a rollout (generate + score) beside a train
    step. two_step_off: generate, score and train all beside each other. The weight sync is
    never overlapped, so it is added in every case.
    """
    if schedule == "sync":
        return r["generate_s"] + r["teacher_s"] + r["train_s"] + r["sync_s"]
    if schedule == "one_step_off":
        return max(r["generate_s"] + r["teacher_s"], r["train_s"]) + r["sync_s"]
    return max(r["generate_s"], r["teacher_s"], r["train_s"]) + r["sync_s"]


def summarize(runs: dict[str, dict[str, float]], latency: float) -> list[dict[str, float | str]]:
    table = []
    sync_step = runs["sync"]["step_s"]
    for schedule, r in runs.items():
        slowest = slowest_stage(schedule, r)
        table.append(
            {
                "schedule": schedule,
                "teacher_latency_s": latency,
                **{k: round(r[k], 4) for k in (*PHASES, "step_s")},
                "step_over_slowest": round(r["step_s"] / slowest, 3),
                "speedup_vs_sync": round(sync_step / r["step_s"], 3),
            }
        )
    return table


def print_table(rows: list[dict[str, float | str]]) -> None:
    cols = ["schedule", "teacher_latency_s", *PHASES, "step_s", "step_over_slowest", "speedup_vs_sync"]
    print(" | ".join(f"{c:>17}" for c in cols))
    for row in rows:
        print(" | ".join(f"{row[c]!s:>17}" for c in cols))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--latencies", default="0,auto", help="teacher latencies in s; 'auto' = the sync run's train + generate time"
    )
    parser.add_argument("overrides", nargs="*", help="extra key=value for every run")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench_pipeline_"))
    all_rows: list[dict[str, float | str]] = []
    auto_latency = None
    for spec in args.latencies.split(","):
        latency = auto_latency if spec == "auto" else float(spec)
        if latency is None:
            raise SystemExit("'auto' must follow a measured latency (e.g. --latencies 0,auto)")
        runs = {s: run_schedule(s, args.steps, latency, args.overrides, out) for s in SCHEDULES}
        if auto_latency is None:
            auto_latency = round(runs["sync"]["train_s"] + runs["sync"]["generate_s"], 2)
        all_rows += summarize(runs, latency)
    print_table(all_rows)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"steps": args.steps, "warmup": WARMUP_STEPS, "rows": all_rows}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
