"""The demo recipe (`python -m recipe_gkd.main`) against the in-process loop TRL's GKDTrainer runs.

    python benchmarks/bench_vs_inprocess.py [--rounds 2] [--schedules sync,one_step_off,two_step_off]
                                            [--baseline-root DIR] [--steps 150]

The in-process loop is benchmarks/bench_demo_distill.py (one process, no Ray, no server: sample
with the student, teacher forward, student step), the recipe is the CLI on the demo preset;
same models, data and hyperparameters (batch 64, the preset's lr, forward KL, lmbda 1, 16 new tokens,
evaluation every 25 steps on the 500 held-out prompts). `--baseline-root` adds the CLI of
another checkout (e.g. the commit before a change) as one more row. The runs alternate round
by round, so load from other processes on a shared machine hits every row alike; the table
gives medians over rounds. Columns: seconds per training step (median of the steps after the
first 3), its phases, training seconds until held-out accuracy first reached +30 points over
step 0, accuracy at the last step, and the whole process's wall time. Writes
benchmarks/results/vs_inprocess.json.
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

from recipe_gkd.config import load_config

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "vs_inprocess.json"
WARMUP_STEPS = 3
GAIN = 0.30
PHASES = ("generate_s", "teacher_s", "train_s", "sync_s", "step_s")
EVAL_EVERY = 25
# The in-process loop trains at the demo preset's learning rate (the recipe's).
PRESET_LR = load_config(None).actor.optim.lr


def in_process(run_dir: Path, steps: int) -> dict[str, Any]:
    """bench_demo_distill.py in a fresh process; its per-step phases and accuracy curve."""
    out = run_dir / "demo_distill.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_demo_distill.py"),
        f"--steps={steps}",
        f"--eval-every={EVAL_EVERY}",
        f"--lr={PRESET_LR}",
        f"--out={out}",
    ]
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    run = json.loads(out.read_text())["runs"][0]
    curve = [(c["step"], c["accuracy"], c["train_seconds"]) for c in run["curve"]]
    return summarize(run["phases"], curve, wall)


def recipe(run_dir: Path, steps: int, schedule: str, root: Path) -> dict[str, Any]:
    """The CLI of the checkout at `root` on the demo preset; phases from metrics.jsonl, curve from eval.jsonl."""
    cmd = [
        sys.executable,
        "-m",
        "recipe_gkd.main",
        f"trainer.run_dir={run_dir}",
        f"trainer.total_steps={steps}",
        f"trainer.eval_every={EVAL_EVERY}",
        f"algorithm.schedule={schedule}",
    ]
    env = {**os.environ, "PYTHONPATH": str(root)}
    start = time.perf_counter()
    subprocess.run(cmd, cwd=root, check=True, stdout=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    elapsed = {0: 0.0}
    for row in rows:
        elapsed[row["step"]] = elapsed[row["step"] - 1] + row["step_s"]
    curve = [(e["step"], e["eval_reward"], elapsed[e["step"]]) for e in evals]
    return summarize(rows, curve, wall)


def summarize(steps: list[dict[str, Any]], curve: list[tuple[int, float, float]], wall: float) -> dict[str, Any]:
    timed = steps[WARMUP_STEPS:]
    phases = {p: statistics.median(s.get(p, 0.0) for s in timed) for p in PHASES}
    start_accuracy = curve[0][1]
    reached = [seconds for _, acc, seconds in curve if acc >= start_accuracy + GAIN]
    return {
        **{p: round(v, 4) for p, v in phases.items()},
        "seconds_to_gain": round(reached[0], 2) if reached else None,
        "final_accuracy": curve[-1][1],
        "start_accuracy": start_accuracy,
        "process_wall_s": round(wall, 2),
    }


def median_row(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in rounds[0]:
        values = [r[key] for r in rounds if r[key] is not None]
        out[key] = statistics.median(values) if values else None
    return out


def table(rows: dict[str, dict[str, Any]]) -> str:
    base = rows["in-process loop"]
    head = f"{'':28}{'s/step':>8}{'ratio':>7}{'gen':>7}{'teacher':>8}{'train':>7}{'sync':>7}"
    head += f"{'s to +30':>9}{'acc':>7}{'wall s':>8}{'ratio':>7}"
    lines = [head]
    for name, r in rows.items():
        gain = "-" if r["seconds_to_gain"] is None else f"{r['seconds_to_gain']:.1f}"
        lines.append(
            f"{name:28}{r['step_s']:>8.3f}{r['step_s'] / base['step_s']:>7.2f}{r['generate_s']:>7.3f}"
            f"{r['teacher_s']:>8.3f}{r['train_s']:>7.3f}{r['sync_s']:>7.3f}{gain:>9}"
            f"{100 * r['final_accuracy']:>6.1f}%{r['process_wall_s']:>8.1f}{r['process_wall_s'] / base['process_wall_s']:>7.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--schedules", default="sync,one_step_off,two_step_off")
    parser.add_argument("--baseline-root", type=Path, default=None, help="another checkout's CLI as one more row")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    variants: dict[str, Any] = {"in-process loop": lambda d: in_process(d, args.steps)}
    if args.baseline_root:
        variants["recipe sync (baseline)"] = lambda d: recipe(d, args.steps, "sync", args.baseline_root.resolve())
    for schedule in args.schedules.split(","):
        variants[f"recipe {schedule}"] = lambda d, s=schedule: recipe(d, args.steps, s, ROOT)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for i, (name, run) in enumerate(variants.items()):
                result = run(Path(tmp) / f"r{round_}_{i}")
                results[name].append(result)
                print(f"round {round_} {name}: {result}", flush=True)
    rows = {name: median_row(rounds) for name, rounds in results.items()}
    text = table(rows)
    print(
        f"\n{args.steps} steps, medians over {args.rounds} rounds (seconds; phases: median step after {WARMUP_STEPS})"
    )
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"steps": args.steps, "rounds": args.rounds, "table": text, "medians": rows, "runs": results}
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
