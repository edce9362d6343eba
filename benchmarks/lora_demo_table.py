"""LoRA students against full training on the CPU demo, through the CLI: held-out accuracy, bytes and seconds per
weight sync, the actor's resident memory.

    .venv/bin/python benchmarks/lora_demo_table.py [--steps 150] [--out runs/lora_table]

Runs the demo preset (configs/presets/cpu_demo.yaml) three times or more: the whole student trained (its lr,
3e-4), and adapters of rank 8 and 32 on every linear (qkv, proj, fc1, fc2) at 10x that lr (LoRA's usual
setting: the adapters start at B = 0 and move a low-rank update only), each with debug.log_memory. A run
directory holding a finished run of exactly that config is reused. Writes benchmarks/results/lora_demo_table.json
and prints the markdown table docs/lora.md quotes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from demo_runs import run_demo  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "lora_demo_table.json"
# (row name, overrides): the demo's own lr for the whole student, 10x for the adapters.
ROWS: list[tuple[str, tuple[str, ...]]] = [
    ("full student (lr 3e-4)", ()),
    ("LoRA rank 8 (lr 3e-3)", ("actor.lora.rank=8", "actor.lora.alpha=16", "actor.optim.lr=3e-3")),
    ("LoRA rank 32 (lr 3e-3)", ("actor.lora.rank=32", "actor.lora.alpha=64", "actor.optim.lr=3e-3")),
    ("LoRA rank 8 (lr 3e-4)", ("actor.lora.rank=8", "actor.lora.alpha=16")),
]


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(name: str, run_dir: Path, curve: list[tuple[int, float]], wall: float | None) -> dict[str, Any]:
    rows = metrics(run_dir)
    synced = [r for r in rows if r.get("sync_bytes")]
    rss = [v for r in rows for k, v in r.items() if k.startswith("actor") and k.endswith("_rss_mb") and v]
    return {
        "run": name,
        "run_dir": str(run_dir),
        "start_accuracy": curve[0][1],
        "final_accuracy": curve[-1][1],
        "best_accuracy": max(a for _, a in curve),
        "sync_bytes": statistics.median(r["sync_bytes"] for r in synced),
        "sync_s": statistics.median(r["sync_s"] for r in synced),
        "train_s": statistics.median(r["train_s"] for r in rows),
        "actor_rss_mb_max": max(rss) if rss else None,
        "wall_s": wall,
    }


def print_table(results: list[dict[str, Any]]) -> None:
    print("| run | held-out accuracy, start -> end (best) | bytes per sync | sync s (median) | train s per step "
          "(median) | actor resident MiB (max) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in results:
        memory = f"{r['actor_rss_mb_max']:.0f}" if r["actor_rss_mb_max"] else "-"
        print(
            f"| {r['run']} | {100 * r['start_accuracy']:.1f}% -> {100 * r['final_accuracy']:.1f}% "
            f"({100 * r['best_accuracy']:.1f}%) | {r['sync_bytes'] / 1024:.0f} KiB | {r['sync_s']:.3f} | "
            f"{r['train_s']:.2f} | {memory} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "lora_table")
    parser.add_argument("--rows", type=int, nargs="*", help="row indices to run (default: all)")
    args = parser.parse_args()
    chosen = args.rows if args.rows else range(len(ROWS))
    results = []
    for index in chosen:
        name, overrides = ROWS[index]
        common = (f"trainer.total_steps={args.steps}", "debug.log_memory=true")
        run_dir = args.out / f"row{index}"
        curve, wall = run_demo((*common, *overrides), run_dir)
        results.append(summarize(name, run_dir, curve, wall))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
