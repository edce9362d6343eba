"""Teacher top-k vs union support vs full vocabulary (teacher.output=hidden) on the CPU demo: held-out accuracy.

    python benchmarks/support_learning_table.py [--seeds 1 2] [--only 0 3]

Each row is the demo CLI (`python -m recipe_gkd.main`, the cpu_demo preset: two_step_off, 150 steps,
500 held-out prompts, teacher.top_k=8) with the row's overrides, once per seed (data.seed: prompt order
and sampling). A run directory under runs/support_learning_table/ whose resolved config equals the row's
and whose evaluation reached the last step is reused, not run again. Prints a markdown table and writes
benchmarks/results/support_learning_table.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from demo_runs import REPO, print_final_table, run_demo

RUNS = REPO / "runs" / "support_learning_table"
RESULTS = REPO / "benchmarks" / "results" / "support_learning_table.json"
SUPPORTS: list[tuple[str, tuple[str, ...]]] = [
    ("teacher top-8 + tail", ()),
    ("union, k_s=8", ("algorithm.support=union", "rollout.student_top_k=8")),
    ("full vocabulary (teacher.output=hidden)", ("teacher.output=hidden",)),
]
ROWS: list[tuple[str, tuple[str, ...]]] = [
    (f"{div}, {name}", (f"algorithm.divergence={div}", *extra))
    for div in ("reverse_kl", "jsd")
    for name, extra in SUPPORTS
]


def run_dir(row: int, seed: int) -> Path:
    return RUNS / f"row{row}_seed{seed}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="*", default=[1, 2], help="data.seed values (default: 1 2)")
    parser.add_argument("--only", type=int, nargs="*", help="row indices to run")
    args = parser.parse_args()
    results = []
    for seed in args.seeds:
        for index, (name, overrides) in enumerate(ROWS):
            if args.only and index not in args.only:
                continue
            curve, wall = run_demo((*overrides, f"data.seed={seed}"), run_dir(index, seed))
            results.append(
                {"row": index, "name": name, "overrides": list(overrides), "seed": seed, "curve": curve, "wall_s": wall}
            )
    start = results[0]["curve"][0][1]
    print(f"\nheld-out accuracy after 150 steps (%), CPU demo (two_step_off); step 0: {100 * start:.1f}%\n")
    print_final_table([name for name, _ in ROWS], results, args.seeds, start)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
