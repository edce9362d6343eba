"""The two-teacher CPU demo's table (docs/teachers.md): held-out accuracy per task at step 0 and after the
preset's steps, two teachers (each record its own) against each teacher alone on the same mixed prompts.

    python benchmarks/two_teachers_table.py [--seeds 1 2]

Each row is the CLI (`python -m recipe_gkd.main --config configs/presets/cpu_two_teachers.yaml`) with the
row's overrides, once per seed (data.seed: prompt order and sampling). "Alone" scores every record by one
teacher (`data.teacher_key=no_such_field data.default_teacher=NAME`). Accuracy: greedy, per task, on the
preset's held-out records (100 per task), as `python -m recipe_gkd.demo.two_teachers --evaluate` prints
it. A run directory under runs/two_teachers_table/ whose resolved config equals the row's and whose
evaluation reached the last step is reused, not run again (its wall time then comes from the last results
file). Prints a markdown table and writes benchmarks/results/two_teachers_table.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from demo_runs import REPO, run_demo

from recipe_gkd.config import CONFIG_DIR, load_config
from recipe_gkd.demo.two_teachers import TASKS, task_accuracy

PRESET = CONFIG_DIR / "presets" / "cpu_two_teachers.yaml"
RUNS = REPO / "runs" / "two_teachers_table"
RESULTS = REPO / "benchmarks" / "results" / "two_teachers_table.json"
ALONE = "data.teacher_key=no_such_field"
# (row name, overrides, the seeds it runs: None for --seeds). The last two rows train on one task's prompts
# only (its own assets' training file), the step budget all on that task.
ROWS: list[tuple[str, tuple[str, ...], tuple[int, ...] | None]] = [
    ("two teachers, each record its own", (), None),
    ("the reversal teacher alone", (ALONE, "data.default_teacher=reverse"), None),
    ("the running-sum teacher alone", (ALONE, "data.default_teacher=sum"), None),
    (
        "the reversal teacher alone, reversal prompts only",
        (ALONE, "data.default_teacher=reverse", "data.train_files=[assets/demo/data/train.jsonl]"),
        (1,),
    ),
    (
        "the running-sum teacher alone, sum prompts only",
        (ALONE, "data.default_teacher=sum", "data.train_files=[assets/paper/data/train.jsonl]"),
        (1,),
    ),
]


def run_dir(row: int, seed: int) -> Path:
    return RUNS / f"row{row}_seed{seed}"


def _previous_walls() -> dict[tuple[int, int], float]:
    if not RESULTS.is_file():
        return {}
    rows = json.loads(RESULTS.read_text()).get("runs", [])
    return {(r["row"], r["seed"]): r["wall_s"] for r in rows if r.get("wall_s") is not None}


def _cells(accuracy: dict[str, float | None]) -> str:
    return " | ".join("-" if accuracy[n] is None else f"{100 * accuracy[n]:.1f}%" for n in TASKS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    cfg = load_config(PRESET)
    walls = _previous_walls()
    start = task_accuracy(cfg.model.student_path)
    teachers = {name: task_accuracy(section.model_path) for name, section in cfg.teachers.items()}
    runs = []
    for seed in sorted({*args.seeds, *(s for *_, seeds in ROWS for s in seeds or ())}):  # a seed's rows, then the next
        for index, (name, overrides, row_seeds) in enumerate(ROWS):
            if seed not in (row_seeds or args.seeds):
                continue
            out = run_dir(index, seed)
            _, wall = run_demo((*overrides, f"data.seed={seed}"), out, preset=PRESET)
            runs.append(
                {
                    "row": index,
                    "name": name,
                    "overrides": list(overrides),
                    "seed": seed,
                    "accuracy": task_accuracy(str(out / "final_student")),
                    "wall_s": wall if wall is not None else walls.get((index, seed)),
                }
            )
    print(f"\nheld-out greedy accuracy per task after {cfg.trainer.total_steps} steps, seeds {args.seeds}\n")
    print("| student | seed | reversal | running sum | wall |\n|---|---:|---:|---:|---:|")
    print(f"| step 0 ({cfg.model.student_path}) | | {_cells(start)} | |")
    for run in runs:
        wall = "-" if run["wall_s"] is None else f"{run['wall_s']:.0f} s"
        print(f"| {run['name']} | {run['seed']} | {_cells(run['accuracy'])} | {wall} |")
    for name, accuracy in teachers.items():
        print(f"| teacher `{name}` ({cfg.teachers[name].model_path}) | | {_cells(accuracy)} | |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"step0": start, "teachers": teachers, "runs": runs}, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
