"""Build the two-teacher CPU demo's mixed data set offline (configs/presets/cpu_two_teachers.yaml).

    python -m recipe_gkd.demo.two_teachers [--out assets/two_teachers/data]
    python -m recipe_gkd.demo.two_teachers --evaluate MODEL_DIR [MODEL_DIR ...]

--evaluate prints each model's greedy held-out accuracy per task on the records the preset evaluates
(the first data.eval_batch_size of the mixed eval file), as the README's table reports it.

Interleaves the string-reversal demo's records (assets/demo/data, teacher `reverse`) with the
running-sum task's (assets/paper/data, teacher `sum`), one of each in turn, and writes the record's
teacher in the field `teacher` (the preset's data.teacher_key). Both tasks' assets share one char
tokenizer (recipe_gkd.demo.build_assets). Deterministic: the first TRAIN_PER_TASK / EVAL_PER_TASK
records of each task's files, in file order, so the first 2n held-out records hold n of each task.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Task name (= its teacher's name in the preset) -> its built assets' data directory.
TASKS = {"reverse": Path("assets/demo/data"), "sum": Path("assets/paper/data")}
TRAIN_PER_TASK = 8000
EVAL_PER_TASK = 250
DEFAULT_OUT = Path("assets/two_teachers/data")


def read_records(path: Path, count: int) -> list[dict[str, object]]:
    """The first `count` records of a jsonl file."""
    records: list[dict[str, object]] = []
    with path.open() as f:
        for line in f:
            if line.strip():
                records.append(json.loads(line))
            if len(records) == count:
                return records
    raise ValueError(f"{path} holds {len(records)} records, fewer than the {count} the mixed set takes")


def mixed(split: str, per_task: int) -> list[dict[str, object]]:
    """`per_task` records of each task's `split`, alternating task by task, each naming its teacher."""
    by_task = [
        [{**r, "teacher": name} for r in read_records(d / f"{split}.jsonl", per_task)] for name, d in TASKS.items()
    ]
    return [record for group in zip(*by_task, strict=True) for record in group]


def task_accuracy(model_dir: str) -> dict[str, float | None]:
    """Greedy accuracy of `model_dir` per task on the preset's held-out records (its data settings)."""
    from recipe_gkd.config import CONFIG_DIR, load_config
    from recipe_gkd.rollout.answer_accuracy import model_answer_accuracy

    cfg = load_config(CONFIG_DIR / "presets" / "cpu_two_teachers.yaml")
    records = read_records(Path(cfg.data.eval_files[0]), cfg.data.eval_batch_size)
    return {
        name: model_answer_accuracy(
            model_dir, [r for r in records if r["teacher"] == name], cfg.data, cfg.rollout.sampling.max_new_tokens
        ).accuracy
        for name in TASKS
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe_gkd.demo.two_teachers", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--evaluate", nargs="+", metavar="MODEL_DIR", help="print per-task accuracy of these models")
    args = parser.parse_args(argv)
    if args.evaluate:
        for model_dir in args.evaluate:
            figures = task_accuracy(model_dir)
            print(model_dir, " ".join(f"{n}={'-' if a is None else f'{100 * a:.1f}%'}" for n, a in figures.items()))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for split, per_task in (("train", TRAIN_PER_TASK), ("eval", EVAL_PER_TASK)):
        records = mixed(split, per_task)
        path = args.out / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
        print(f"wrote {path}: {len(records)} records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
