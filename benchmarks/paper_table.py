"""The GKD paper's comparison: student-data fraction (lmbda) x divergence, held-out accuracy.

    .venv/bin/python benchmarks/paper_table.py [--config configs/presets/cpu_paper.yaml]
                                               [--steps 150] [--seeds 1,2,3] [--jobs 2]

Runs the real CLI on a CPU preset once per (algorithm.lmbda, divergence, data.seed), all with
the same number of steps, and reads the held-out accuracy from eval.jsonl. lmbda = 0 is
supervised KD on the dataset's responses, 1 is fully on-policy (GKD's lambda); jsd is
generalized JSD with beta = 0.5. The default preset is the paper task (cpu_paper.yaml: digit
sums in any order, recipe_gkd/demo/sum_task.py), whose assets are built first if missing.
Prints the table in the paper's layout (rows: divergence, columns: lmbda; mean +- std over
seeds), and writes benchmarks/results/paper_table.json, docs/results/paper_table.md (the table, each
run, the curves) and docs/results/paper_table.png (accuracy over steps per cell, seeds averaged).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recipe_gkd.observe.metrics import read_metrics  # noqa: E402

LMBDAS = (0.0, 0.5, 1.0)
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
LMBDA_NAMES = {0.0: "supervised KD (lmbda=0)", 0.5: "mixed (lmbda=0.5)", 1.0: "on-policy (lmbda=1)"}
PAPER_PRESET = ROOT / "configs" / "presets" / "cpu_paper.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "paper_table.json"
DOCS = ROOT / "docs" / "results"
Run = dict[str, Any]


def grid_overrides(lmbda: float, divergence: str, seed: int, steps: int, eval_every: int) -> list[str]:
    """The CLI overrides of one cell of the grid (jsd: generalized JSD with beta = 0.5)."""
    return [
        f"algorithm.lmbda={lmbda}",
        f"algorithm.divergence={divergence}",
        "algorithm.beta=0.5",
        f"data.seed={seed}",
        f"trainer.total_steps={steps}",
        f"trainer.eval_every={eval_every}",
    ]


def run_cli(config: Path, overrides: list[str], run_dir: Path) -> float:
    """Run `python -m recipe_gkd.main` on `config` with `overrides` into `run_dir`; returns its wall seconds."""
    cmd = [sys.executable, "-m", "recipe_gkd.main", f"--config={config}", *overrides, f"trainer.run_dir={run_dir}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def run_one(config: Path, lmbda: float, divergence: str, seed: int, steps: int, eval_every: int, out: Path) -> Run:
    run_dir = out / f"{divergence}_l{lmbda}_s{seed}"
    wall_s = run_cli(config, grid_overrides(lmbda, divergence, seed, steps, eval_every), run_dir)
    evals = read_metrics(run_dir, "eval.jsonl")
    result = {
        "lmbda": lmbda,
        "divergence": divergence,
        "seed": seed,
        "steps": steps,
        "start_accuracy": evals[0]["eval_reward"],
        "final_accuracy": evals[-1]["eval_reward"],
        "final_teacher_kl": evals[-1]["eval_teacher_kl"],
        "curve": [(e["step"], e["eval_reward"]) for e in evals],
        "wall_s": round(wall_s, 1),
    }
    print(f"  {divergence:<10} lmbda={lmbda} seed={seed}: {100 * result['final_accuracy']:.1f}%", flush=True)
    return result


# Second view of the same runs: the mean of the last LATE_EVALS evaluations of each run, less
# sensitive than one greedy evaluation to where the last step happened to land.
LATE_EVALS = 3


def final(run: Run) -> float:
    return float(run["final_accuracy"])


def late_mean(run: Run) -> float:
    return statistics.mean(a for _, a in run["curve"][-LATE_EVALS:])


def cell(results: list[Run], divergence: str, lmbda: float, metric: Any = final) -> list[float]:
    return [metric(r) for r in results if r["divergence"] == divergence and r["lmbda"] == lmbda]


def table(results: list[Run], metric: Any = final) -> str:
    width = 26
    lines = [f"{'divergence':<12}" + "".join(f"{LMBDA_NAMES[lm]:>{width}}" for lm in LMBDAS)]
    for div in DIVERGENCES:
        cells = []
        for lm in LMBDAS:
            accs = cell(results, div, lm, metric)
            spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
            cells.append(f"{100 * statistics.mean(accs):.1f} +- {100 * spread:.1f} (n={len(accs)})")
        lines.append(f"{div:<12}" + "".join(f"{c:>{width}}" for c in cells))
    start = statistics.mean(float(r["start_accuracy"]) for r in results)
    lines.append(f"student before distillation: {100 * start:.1f}%  (held-out accuracy, %)")
    return "\n".join(lines)


def plot(results: list[Run], out: Path) -> Path:
    """Held-out accuracy over steps, one panel per divergence, one line per lmbda (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(DIVERGENCES), figsize=(15, 4), sharey=True)
    for ax, div in zip(axes, DIVERGENCES, strict=True):
        for lm in LMBDAS:
            runs = [r for r in results if r["divergence"] == div and r["lmbda"] == lm]
            steps = [s for s, _ in runs[0]["curve"]]
            means = [100 * statistics.mean(r["curve"][i][1] for r in runs) for i in range(len(steps))]
            ax.plot(steps, means, marker="o", label=LMBDA_NAMES[lm])
        ax.set_title(div)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out accuracy, % (mean over seeds)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def markdown(results: list[Run], config: str, steps: int, seeds: str, wall_s: float) -> str:
    rows = "\n".join(
        f"| {r['divergence']} | {r['lmbda']} | {r['seed']} | {100 * r['start_accuracy']:.1f} | "
        f"{100 * r['final_accuracy']:.1f} | {r['final_teacher_kl']:.4f} | "
        + " ".join(f"{100 * a:.0f}" for _, a in r["curve"])
        + " |"
        for r in results
    )
    late = LATE_EVALS
    return (
        "# The GKD paper's table on the CPU paper task\n\n"
        f"`python benchmarks/paper_table.py --config {config} --steps {steps} --seeds {seeds}`: "
        f"{len(results)} runs in {wall_s / 60:.1f} min on a 2-core machine. Held-out accuracy (500 prompts, greedy, "
        f"the response must end with the true sum) after {steps} steps, mean +- std over seeds (`data.seed`: data "
        "order and sampling).\n\n"
        f"```\n{table(results)}\n```\n\n"
        f"The same runs, each run's mean over its last {late} evaluations (less sensitive to where one "
        f"greedy evaluation lands):\n\n```\n{table(results, late_mean)}\n```\n\n"
        "![accuracy over steps](paper_table.png)\n\n"
        "| divergence | lmbda | seed | start % | final % | final KL(teacher \\|\\| student), top-k + tail | "
        "accuracy at each evaluation, % |\n|---|---|---|---|---|---|---|\n" + rows + "\n"
    )


def ensure_assets(config: Path) -> None:
    """Build the paper task's assets when its preset is used and they are missing (a few minutes)."""
    if config.resolve() == PAPER_PRESET.resolve():
        cmd = [sys.executable, "-m", "recipe_gkd.demo.build_assets", "--task", "paper"]
        subprocess.run(cmd, cwd=ROOT, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(PAPER_PRESET))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (2 on 2 cores: a sync run keeps ~1 busy)")
    parser.add_argument("--docs", type=Path, default=DOCS, help="where paper_table.md and .png go")
    parser.add_argument("--render", type=Path, default=None, help="only write the docs from this results JSON")
    args = parser.parse_args()
    if args.render:
        write_docs(json.loads(args.render.read_text()), args.docs)
        return
    config = Path(args.config).resolve()
    ensure_assets(config)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(tempfile.mkdtemp(prefix="paper_table_"))
    grid = list(itertools.product(LMBDAS, DIVERGENCES, seeds))
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda g: run_one(config, *g, args.steps, args.eval_every, out), grid))
    wall = time.perf_counter() - start
    text = table(results)
    print(text)
    print(f"{len(results)} runs in {wall / 60:.1f} min")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    config_name = str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else str(config)
    payload = {"config": config_name, "steps": args.steps, "seeds": args.seeds, "wall_s": wall, "runs": results}
    RESULTS.write_text(json.dumps({**payload, "table": text}, indent=2))
    write_docs(payload, args.docs)
    print(f"wrote {RESULTS}")


def write_docs(payload: dict[str, Any], docs: Path) -> None:
    """docs/results/paper_table.md and docs/results/paper_table.png from a results payload (this run's or a saved JSON)."""
    docs.mkdir(parents=True, exist_ok=True)
    runs = payload["runs"]
    plot(runs, docs / "paper_table.png")
    seeds = payload["seeds"] if isinstance(payload["seeds"], str) else ",".join(map(str, payload["seeds"]))
    text = markdown(runs, payload["config"], payload["steps"], seeds, payload["wall_s"])
    (docs / "paper_table.md").write_text(text)
    print(f"wrote {docs / 'paper_table.md'}, {docs / 'paper_table.png'}")


if __name__ == "__main__":
    main()
