"""The GKD paper's comparison on the demo task: student-data fraction x divergence, held-out accuracy.

    .venv/bin/python benchmarks/paper_table.py [--steps 100] [--seeds 1,2] [--jobs 1]

Runs the real CLI on the CPU demo preset once per (algorithm.lmbda, divergence, data.seed),
all with the same number of steps, and reads the final held-out exact-match accuracy from
eval.jsonl. lmbda = 0 is supervised KD on the dataset's responses, 1 is fully on-policy
(GKD's lambda); jsd is generalized JSD with beta = 0.5. Prints the table in the paper's
layout (rows: divergence, columns: lmbda; mean +- std over seeds) and writes
benchmarks/results/paper_table.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recipe_gkd.metrics import read_metrics  # noqa: E402

LMBDAS = (0.0, 0.5, 1.0)
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
LMBDA_NAMES = {0.0: "supervised KD (lmbda=0)", 0.5: "mixed (lmbda=0.5)", 1.0: "on-policy (lmbda=1)"}
RESULTS = ROOT / "benchmarks" / "results" / "paper_table.json"


def run_one(lmbda: float, divergence: str, seed: int, steps: int, out: Path) -> dict[str, float | str | int]:
    run_dir = out / f"{divergence}_l{lmbda}_s{seed}"
    cmd = [
        sys.executable,
        "-m",
        "recipe_gkd.main",
        f"algorithm.lmbda={lmbda}",
        f"algorithm.divergence={divergence}",
        "algorithm.beta=0.5",
        f"data.seed={seed}",
        f"trainer.total_steps={steps}",
        f"trainer.eval_every={steps}",
        f"trainer.run_dir={run_dir}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{proc.stderr[-3000:]}")
    evals = read_metrics(run_dir, "eval.jsonl")
    return {
        "lmbda": lmbda,
        "divergence": divergence,
        "seed": seed,
        "steps": steps,
        "start_accuracy": evals[0]["eval_reward"],
        "final_accuracy": evals[-1]["eval_reward"],
        "final_teacher_kl": evals[-1]["eval_teacher_kl"],
    }


def table(results: list[dict[str, float | str | int]]) -> str:
    width = 26
    lines = [f"{'divergence':<12}" + "".join(f"{LMBDA_NAMES[lm]:>{width}}" for lm in LMBDAS)]
    for div in DIVERGENCES:
        cells = []
        for lm in LMBDAS:
            accs = [float(r["final_accuracy"]) for r in results if r["divergence"] == div and r["lmbda"] == lm]
            spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
            cells.append(f"{100 * statistics.mean(accs):.1f} +- {100 * spread:.1f} (n={len(accs)})")
        lines.append(f"{div:<12}" + "".join(f"{c:>{width}}" for c in cells))
    start = statistics.mean(float(r["start_accuracy"]) for r in results)
    lines.append(f"student before distillation: {100 * start:.1f}%  (held-out exact match, %)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (each uses ~2 cores at peak)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(tempfile.mkdtemp(prefix="paper_table_"))
    grid = list(itertools.product(LMBDAS, DIVERGENCES, seeds))
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda g: run_one(*g, args.steps, out), grid))
    text = table(results)
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"steps": args.steps, "seeds": seeds, "runs": results, "table": text}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
