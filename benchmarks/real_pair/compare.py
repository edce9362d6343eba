"""The GKD paper's comparison on the real pair: on-policy vs supervised KD vs mixed, held-out measures.

    python -m benchmarks.real_pair.compare [--steps 8] [--seeds 1,2,3] [--divergences forward_kl,jsd] [--jobs 2]
    python -m benchmarks.real_pair.compare --render benchmarks/results/real_pair.json   # only the docs

Builds the pair first if needed (benchmarks/real_pair/build.py). Each cell (algorithm.lmbda x
divergence x data.seed) is one run of the real CLI on configs/presets/cpu_real_pair.yaml through
benchmarks/paper_table.py's run_cli, all with the same steps x data.train_batch_size prompts; the
exported student is then scored on the held-out prompts (scoring.py): (a) KL(teacher || student)
over the full vocabulary on the student's own greedy responses, (b) the teacher's mean token
logprob of those responses, (c) ROUGE-L F1 against the teacher's greedy responses. A finished
run's scores are kept in its run directory (benchmarks/results/real_pair_runs/) with the preset's
sha256, so an interrupted grid resumes (a changed preset reruns every cell). Writes benchmarks/results/real_pair.json, docs/results/real_pair_table.md
(the generated table) and docs/results/real_pair.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from paper_table import LMBDA_NAMES, LMBDAS, grid_overrides, run_cli  # noqa: E402

from benchmarks.real_pair.build import DEFAULT_CACHE, DEFAULT_OUT, MAX_NEW_TOKENS, build  # noqa: E402
from benchmarks.real_pair.scoring import score_student  # noqa: E402
from recipe_gkd.demo.build_assets import sha256_file  # noqa: E402
from recipe_gkd.observe.metrics import read_metrics  # noqa: E402

PRESET = ROOT / "configs" / "presets" / "cpu_real_pair.yaml"
RUNS = ROOT / "benchmarks" / "results" / "real_pair_runs"
RESULTS = ROOT / "benchmarks" / "results" / "real_pair.json"
DOCS = ROOT / "docs" / "results"
SCORES_FILE = "real_pair_scores.json"
EXPORT_DIR = "final_student"  # recipe_gkd.gkd.FINAL_EXPORT_DIR (not imported: it pulls in the driver)
METRICS = {
    "teacher_kl": "(a) KL(teacher || student) on the student's greedy responses, nats/token (lower is better)",
    "teacher_logprob": "(b) teacher's mean token logprob of the student's responses (higher is better)",
    "rouge_l": "(c) ROUGE-L F1 against the teacher's greedy responses (higher is better)",
}
# Scoring loads two models and generates: one thread, beside the runs that hold the other core.
SCORE_THREADS = 1
Run = dict[str, Any]


def held_out(assets: Path) -> tuple[list[str], list[str]]:
    rows = [json.loads(line) for line in (assets / "data" / "eval.jsonl").read_text().splitlines()]
    return [r["prompt"] for r in rows], [r["response"] for r in rows]


def load(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(str(model_dir))


def score_dir(student_dir: Path, teacher: Any, assets: Path) -> dict[str, Any]:
    student, tokenizer = load(student_dir)
    prompts, references = held_out(assets)
    scores, responses = score_student(student, teacher, tokenizer, prompts, references, MAX_NEW_TOKENS)
    return {**asdict(scores), "examples": [r.text for r in responses[:4]]}


def run_cell(lmbda: float, divergence: str, seed: int, steps: int, teacher: Any, assets: Path) -> Run:
    """One run of the CLI and the scores of its exported student (reused when already there)."""
    run_dir = RUNS / f"{divergence}_l{lmbda}_s{seed}_n{steps}"
    saved = run_dir / SCORES_FILE
    preset = sha256_file(PRESET)
    if saved.is_file() and json.loads(saved.read_text()).get("preset_sha256") == preset:
        return json.loads(saved.read_text())
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an unfinished run, or one of another preset: run it again
    wall_s = run_cli(PRESET, grid_overrides(lmbda, divergence, seed, steps, eval_every=0), run_dir)
    start = time.perf_counter()
    scores = score_dir(run_dir / EXPORT_DIR, teacher, assets)
    rows = read_metrics(run_dir)
    run = {
        "lmbda": lmbda,
        "divergence": divergence,
        "seed": seed,
        "steps": steps,
        "preset_sha256": preset,
        "response_tokens": sum(r["response_tokens"] for r in rows),
        "train_loss": [r["loss"] for r in rows],
        "run_s": round(wall_s, 1),
        "score_s": round(time.perf_counter() - start, 1),
        **scores,
    }
    saved.write_text(json.dumps(run, indent=2))
    print(
        f"  {divergence:<10} lmbda={lmbda} seed={seed}: KL {run['teacher_kl']:.3f} logprob "
        f"{run['teacher_logprob']:.3f} ROUGE-L {run['rouge_l']:.3f} ({run['run_s']:.0f} + {run['score_s']:.0f} s)",
        flush=True,
    )
    return run


def mean_std(values: list[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} +- {spread:.3f} (n={len(values)})"


def table(runs: list[Run], start: dict[str, Any], metric: str) -> str:
    divergences = sorted({r["divergence"] for r in runs})
    width = 28
    lines = [METRICS[metric], f"{'divergence':<12}" + "".join(f"{LMBDA_NAMES[lm]:>{width}}" for lm in LMBDAS)]
    for div in divergences:
        cells = [[r[metric] for r in runs if r["divergence"] == div and r["lmbda"] == lm] for lm in LMBDAS]
        lines.append(f"{div:<12}" + "".join(f"{mean_std(c) if c else '-':>{width}}" for c in cells))
    lines.append(f"student before distillation: {start[metric]:.3f}")
    return "\n".join(lines)


TITLES = {
    "teacher_kl": "(a) KL(teacher || student), nats/token (lower: better)",
    "teacher_logprob": "(b) teacher's mean token logprob (higher: better)",
    "rouge_l": "(c) ROUGE-L F1 vs the teacher (higher: better)",
}


def plot(runs: list[Run], start: dict[str, Any], out: Path) -> Path:
    """One panel per measure: each run as a dot, the cell mean +- std as a bar, the starting student as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    divergences = sorted({r["divergence"] for r in runs})
    fig, axes = plt.subplots(1, len(METRICS), figsize=(15, 4))
    offset = 0.25
    for ax, metric in zip(axes, METRICS, strict=True):
        for d, div in enumerate(divergences):
            for i, lm in enumerate(LMBDAS):
                values = [r[metric] for r in runs if r["divergence"] == div and r["lmbda"] == lm]
                if not values:
                    continue
                x = i + (d - (len(divergences) - 1) / 2) * offset
                spread = statistics.stdev(values) if len(values) > 1 else 0.0
                ax.errorbar(x, statistics.mean(values), yerr=spread, fmt="s", color=f"C{d}", capsize=4,
                            label=div if i == 0 else None)  # fmt: skip
                ax.scatter([x + 0.06] * len(values), values, color=f"C{d}", s=10, alpha=0.6)
        ax.axhline(start[metric], color="gray", linestyle="--", label="student before")
        ax.set_xticks(range(len(LMBDAS)), [f"lmbda={lm:g}" for lm in LMBDAS])
        ax.set_xlim(-0.5, len(LMBDAS) - 0.5)
        ax.set_title(TITLES[metric], fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def markdown(payload: dict[str, Any]) -> str:
    runs, start = payload["runs"], payload["start"]
    tables = "\n\n".join(f"```\n{table(runs, start, m)}\n```" for m in METRICS)
    rows = "\n".join(
        f"| {r['divergence']} | {r['lmbda']} | {r['seed']} | {r['teacher_kl']:.3f} | {r['teacher_logprob']:.3f} | "
        f"{r['rouge_l']:.3f} | {r['mean_response_tokens']:.1f} | {r['response_tokens']} | {r['run_s']:.0f} |"
        for r in runs
    )
    return (
        f"`{payload['command']}`: {len(runs)} runs in {payload['wall_s'] / 60:.1f} min "
        f"({payload['steps']} steps x {payload['batch']} prompts each).\n\n"
        f"{tables}\n\n![held-out measures per cell](real_pair.png)\n\n"
        "| divergence | lmbda | seed | (a) KL | (b) teacher logprob | (c) ROUGE-L | mean response tokens | "
        "response tokens trained | run s |\n|---|---|---|---|---|---|---|---|---|\n" + rows + "\n"
    )


def collect(steps: int, wall_s: float) -> dict[str, Any]:
    """The payload of the cells of `steps` steps finished so far; the starting student's scores from the manifest
    (the builder scores it on the same held-out prompts with the same code)."""
    runs = [json.loads(p.read_text()) for p in sorted(RUNS.glob(f"*_n{steps}/{SCORES_FILE}"))]
    runs.sort(key=lambda r: (r["seed"], r["lmbda"], r["divergence"]))
    start = json.loads((DEFAULT_OUT / "manifest.json").read_text())["student"]["eval_healed"]
    command = f"python -m benchmarks.real_pair.compare --steps {steps} (cut short: {len(runs)} cells)"
    return {"command": command, "steps": steps, "batch": 8, "wall_s": wall_s, "start": start, "runs": runs}


def write_docs(payload: dict[str, Any], docs: Path) -> None:
    plot(payload["runs"], payload["start"], docs / "real_pair.png")
    (docs / "real_pair_table.md").write_text(markdown(payload))
    print(f"wrote {docs / 'real_pair_table.md'}, {docs / 'real_pair.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--divergences", default="forward_kl,jsd")
    parser.add_argument("--lmbdas", default=",".join(f"{lm:g}" for lm in LMBDAS))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--docs", type=Path, default=DOCS)
    parser.add_argument("--render", type=Path, default=None, help="only write the docs from this results JSON")
    parser.add_argument("--collect", type=float, default=None, metavar="WALL_S", help="only write the docs from the cells "
                        "finished so far (a grid cut short), stating WALL_S seconds of wall time")  # fmt: skip
    args = parser.parse_args()
    if args.render:
        write_docs(json.loads(args.render.read_text()), args.docs)
        return
    if args.collect is not None:
        write_docs(collect(args.steps, args.collect), args.docs)
        return
    torch.set_num_threads(SCORE_THREADS)
    start_time = time.perf_counter()
    build(DEFAULT_OUT, DEFAULT_CACHE)
    teacher, _ = load(DEFAULT_OUT / "teacher")
    start = score_dir(DEFAULT_OUT / "student", teacher, DEFAULT_OUT)
    print(f"student before: KL {start['teacher_kl']:.3f} ROUGE-L {start['rouge_l']:.3f}", flush=True)
    lmbdas = [float(x) for x in args.lmbdas.split(",")]
    # Seed by seed, so that a grid cut short holds whole seeds.
    seeds = [int(s) for s in args.seeds.split(",")]
    grid = [(lm, div, seed) for seed in seeds for lm in lmbdas for div in args.divergences.split(",")]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(lambda g: run_cell(*g, args.steps, teacher, DEFAULT_OUT), grid))
    wall = time.perf_counter() - start_time
    command = "python -m benchmarks.real_pair.compare " + " ".join(sys.argv[1:])
    batch = 8  # data.train_batch_size of the preset
    payload = {"command": command.strip(), "steps": args.steps, "batch": batch, "wall_s": wall, "start": start}
    payload["runs"] = runs
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(payload, indent=2))
    for metric in METRICS:
        print(table(runs, start, metric))
    write_docs(payload, args.docs)


if __name__ == "__main__":
    main()
