"""Does a model recover from a slip? The mechanism behind the paper task, measured on exported students.

    .venv/bin/python benchmarks/paper_recovery.py RUNS_DIR [--examples 500]

RUNS_DIR is what benchmarks/paper_table.py ran in (one run directory per cell and seed, each
with its exported `final_student/`). For each student, the teacher and the student before
distillation (assets/paper), on held-out prompts: greedy accuracy from the prompt alone, and
greedy accuracy when the response is forced to start with one wrong intermediate total (the
slip of recipe_gkd/demo/sum_task.py `with_slip`, fixed per prompt), i.e. how often the model
still ends with the true sum. Prints a table and writes benchmarks/results/paper_recovery.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recipe_gkd.demo import sum_task  # noqa: E402
from recipe_gkd.demo.evaluate import greedy_responses  # noqa: E402
from recipe_gkd.demo.task import Example, read_jsonl, reward  # noqa: E402

ASSETS = ROOT / "assets" / "paper"
RESULTS = ROOT / "benchmarks" / "results" / "paper_recovery.json"
MAX_NEW_TOKENS = 32


def measure(model_dir: Path, examples: list[Example]) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    slipped = []
    for e in examples:
        text, (_, end) = sum_task.with_slip(e, random.Random(f"recovery:{e.prompt}"))
        slipped.append(text[:end])  # up to and including the wrong total
    prompts = [e.prompt for e in examples]
    clean = greedy_responses(model, tokenizer, prompts, max_new_tokens=MAX_NEW_TOKENS)
    after_slip = greedy_responses(model, tokenizer, prompts, max_new_tokens=MAX_NEW_TOKENS, prefixes=slipped)

    def accuracy(responses: list[str]) -> float:
        return statistics.mean(reward(r, e.answer, "suffix") for r, e in zip(responses, examples, strict=True))

    return {"accuracy": accuracy(clean), "recovery": accuracy(after_slip)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path)
    parser.add_argument("--examples", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(1)
    examples = read_jsonl(ASSETS / "data" / "eval.jsonl", limit=args.examples)
    rows: dict[str, Any] = {
        "teacher": measure(ASSETS / "teacher", examples),
        "student before": measure(ASSETS / "student", examples),
    }
    for run in sorted(p for p in args.runs.iterdir() if (p / "final_student").is_dir()):
        rows[run.name] = measure(run / "final_student", examples)
        print(f"{run.name:<24} {rows[run.name]}", flush=True)
    print(f"\n{'model':<24}{'accuracy':>10}{'after a slip':>14}")
    for name, r in rows.items():
        print(f"{name:<24}{100 * r['accuracy']:>9.1f}%{100 * r['recovery']:>13.1f}%")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"examples": len(examples), "models": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
