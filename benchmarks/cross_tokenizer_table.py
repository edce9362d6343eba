"""The demo across tokenizers (algorithm.cross_tokenizer) against the same-tokenizer demo: held-out accuracy
from step 0 to 150, the teacher's own accuracy, the alignment figures and the teacher's scoring cost per token.

    python benchmarks/cross_tokenizer_table.py [--only NAME ...]

Each row is the CLI (`python -m recipe_gkd.main --config PRESET`, 150 steps, 500 held-out prompts) with the
row's overrides. Needs assets/demo (make demo) and assets/demo_xtok (python -m recipe_gkd.demo.cross_tokenizer_teacher).
A run directory under runs/cross_tokenizer_table/ whose resolved config equals the row's and whose evaluation
reached the last step is reused. Prints a markdown table and writes benchmarks/results/cross_tokenizer_table.json.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from demo_runs import REPO, finished_evals, run_demo

PRESETS = REPO / "configs" / "presets"
RUNS = REPO / "runs" / "cross_tokenizer_table"
RESULTS = REPO / "benchmarks" / "results" / "cross_tokenizer_table.json"
SAMPLED = ("algorithm.divergence=sampled_reverse_kl", "teacher.top_k=0", "algorithm.ratio_clip=0.1")
# (row name, preset, overrides)
ROWS: list[tuple[str, str, tuple[str, ...]]] = [
    ("same tokenizer, forward_kl", "cpu_demo.yaml", ()),
    ("cross, span, forward_kl (preset)", "cpu_cross_tokenizer.yaml", ()),
    ("cross, span, jsd", "cpu_cross_tokenizer.yaml", ("algorithm.divergence=jsd",)),
    ("cross, uld (forward_kl on shared pieces)", "cpu_cross_tokenizer.yaml", ("algorithm.cross_tokenizer=uld",)),
    ("same tokenizer, sampled_reverse_kl", "cpu_demo_sampled_reverse_kl.yaml", ()),
    ("cross, sampled_reverse_kl (span advantage)", "cpu_cross_tokenizer.yaml", SAMPLED),
]


def row_figures(out: Path, evals: list[dict]) -> dict:
    """Accuracy curve, the teacher's accuracy, alignment means and teacher seconds per response token."""
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    teacher = re.search(r"teacher held-out accuracy\s+([\d.]+)%", (out / "summary.txt").read_text())
    figures = {
        "accuracy": [(e["step"], e["eval_reward"]) for e in evals],
        "teacher_accuracy": float(teacher.group(1)) / 100 if teacher else None,
        # The rollout worker's wall time in teacher.score (client, wire, server, alignment) per response token.
        "teacher_us_per_token": 1e6 * sum(s["teacher_s"] for s in steps) / sum(s["response_tokens"] for s in steps),
    }
    for key in ("align_one_to_one_frac", "align_shared_span_frac", "align_span_len"):
        values = [s[key] for s in steps if s.get(key) is not None]
        figures[key] = statistics.mean(values) if values else None
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="row names to run (default: all)")
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    for i, (name, preset, overrides) in enumerate(ROWS):
        if args.only and name not in args.only:
            continue
        out = RUNS / f"row{i}"
        print(f"{name}: {out}", flush=True)
        run_demo(overrides, out, preset=PRESETS / preset)
        evals = finished_evals(overrides, out, PRESETS / preset)
        assert evals is not None
        results[name] = row_figures(out, evals)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(
        "| run | held-out accuracy, step 0 -> 150 | teacher | 1:1 tokens | shared spans | span len | teacher us/token |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, f in results.items():
        first, last = f["accuracy"][0][1], f["accuracy"][-1][1]
        fmt = lambda v, p="{:.1%}": "-" if v is None else p.format(v)  # noqa: E731
        print(
            f"| {name} | {first:.1%} -> {last:.1%} | {fmt(f['teacher_accuracy'])} | {fmt(f['align_one_to_one_frac'])} "
            f"| {fmt(f['align_shared_span_frac'])} | {fmt(f['align_span_len'], '{:.3f}')} | {f['teacher_us_per_token']:.0f} |"
        )


if __name__ == "__main__":
    main()
