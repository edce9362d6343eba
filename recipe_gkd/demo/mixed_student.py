"""Build the two-teacher demo's student offline and deterministically: the demo student's shape, warmed
up on both tasks (configs/presets/cpu_two_teachers.yaml's model.student_path).

    python -m recipe_gkd.demo.mixed_student [--out assets/two_teachers] [--force]

A short SFT warm-up (recipe_gkd.demo.sft) on the mixed training set's reference responses
(assets/two_teachers/data/train.jsonl: reversals and worked running sums, the answers both teachers were
trained to give), starting from the demo's student (assets/demo/student: 30% of reversals, no sums; its
bytes are part of the recipe), stopped at the first check where every
task's held-out dev accuracy reaches its target: the student starts with some of each task and well below
both teachers, room to learn both. The dev splits are the two tasks' build-time dev splits
(task.generate_splits / sum_task.generate_splits), in neither the training nor the held-out file.

Writes `student/` and `manifest.json` (recipe, the training file's sha256, dev and held-out accuracy per
task, seconds, the sha256 of every file) under --out. A second run with a complete manifest whose recipe
matches does nothing (unless --force). Same determinism as recipe_gkd.demo.build_assets (fixed seeds,
deterministic torch algorithms, one thread): a rebuild on the same machine and torch version gives the
same bytes.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recipe_gkd.demo import sum_task, task
from recipe_gkd.demo.build_assets import (
    BUILD_THREADS,
    STUDENT,
    Laps,
    ModelRecipe,
    _model_recipe,
    asset_command,
    build_unless_current,
    recipe_manifest_problem,
    sha256_file,
)
from recipe_gkd.demo.evaluate import accuracy_on
from recipe_gkd.demo.sft import SFTConfig, sft_train

DEFAULT_OUT = Path("assets/two_teachers")
TRAIN_FILE = "data/train.jsonl"  # under --out: written by python -m recipe_gkd.demo.two_teachers
MANIFEST = "manifest.json"
BUILD_VERSION = 1
# The demo student's shape and seed (build_assets.STUDENT, which INIT_FROM was built with); `sft.steps` is
# only the cap.
MIXED_STUDENT = ModelRecipe(
    spec=STUDENT.spec,
    init_seed=STUDENT.init_seed,
    sft=SFTConfig(steps=1200, batch_size=128, lr=3e-3, warmup_steps=10, seed=2),
)
# Where the warm-up starts. Reversal is learnt in a jump (tens of steps once it starts), sums gradually:
# from a fresh model (1 reversal : 1 sum) reversal was still 0% on dev after 350 steps, from the running-sum
# student (3 : 1) after 330, so the warm-up starts past the reversal jump and adds sums.
INIT_FROM = Path("assets/demo/student")
CHECK_FROM_STEP = 10
# The preset's data.eval_batch_size: its held-out set is the first 200 records, 100 per task.
EVAL_RECORDS = 200
CHECK_EVERY = 10


@dataclass(frozen=True)
class TaskCheck:
    """One task's share of the warm-up, its dev split and the warm-up's stop target on it."""

    prefix: str  # the task's prompt prefix: which records of the mixed set are this task's
    share: int  # records of this task per round of the warm-up's training order
    target: float  # the warm-up stops once every task's dev accuracy reaches its target
    match: str  # data.answer_match of the task's own preset
    max_new_tokens: int


# Keyed by teacher name (the preset's `teachers:`). Targets: about where the single-task students start
# (assets/demo 30%, assets/paper 23% held-out), far below the teachers (99.8%, 96%). Shares: a reversal
# (5-8 letters + EOS) has about a third of a worked sum's response tokens (up to 25 + EOS), so at 1 : 4 the
# sums carry ~90% of the token-mean loss; at 1 : 2 reversal reached 74% on dev before sums reached 20%.
TASKS = {
    "reverse": TaskCheck(task.PROMPT_PREFIX, share=1, target=0.25, match="exact", max_new_tokens=16),
    "sum": TaskCheck(sum_task.PROMPT_PREFIX, share=4, target=0.20, match="suffix", max_new_tokens=32),
}


def recipe() -> dict[str, Any]:
    """Everything the student's bytes depend on besides torch and the training file (hashed separately)."""
    return {
        "build_version": BUILD_VERSION,
        "threads": BUILD_THREADS,
        "student": _model_recipe(MIXED_STUDENT),
        "stop": {
            "check_from_step": CHECK_FROM_STEP,
            "check_every": CHECK_EVERY,
            "targets": {name: t.target for name, t in TASKS.items()},
            "shares": {name: t.share for name, t in TASKS.items()},
        },
        "init_from": {"path": str(INIT_FROM), "sha256": sha256_file(INIT_FROM / "model.safetensors")},
        "dev": {"reverse_seed": task.DEFAULT_SEED, "sum_seed": sum_task.DEFAULT_SEED},
    }


def dev_splits() -> dict[str, list[task.Example]]:
    """Each task's build-time dev split (held out from both the training and the evaluation files)."""
    return {"reverse": task.generate_splits().dev, "sum": sum_task.generate_splits().dev}


def manifest_problem(out: Path) -> str | None:
    """Why `out` does not hold a complete student of the current recipe and training file (None when it does)."""
    problem = recipe_manifest_problem(out, recipe(), ("student/model.safetensors",))
    if problem is None and json.loads((out / MANIFEST).read_text()).get("train_file_sha256") != sha256_file(
        out / TRAIN_FILE
    ):
        return f"{out / TRAIN_FILE} changed since the student was built"
    return problem


def _accuracies(model: torch.nn.Module, tokenizer: Any, examples: dict[str, list[task.Example]]) -> dict[str, float]:
    return {
        name: accuracy_on(model, tokenizer, examples[name], TASKS[name].match, TASKS[name].max_new_tokens)
        for name in TASKS
    }


def warm_up(model_dir: Path, train: list[task.Example]) -> dict[str, Any]:
    """Copy INIT_FROM to `model_dir` and train it on `train` until every task's dev target is met."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(INIT_FROM, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    dev = dev_splits()
    checks: list[dict[str, Any]] = []

    def reached_targets(steps_done: int) -> bool:
        if steps_done < CHECK_FROM_STEP or steps_done % CHECK_EVERY:
            return False
        checks.append({"step": steps_done, **_accuracies(model, tokenizer, dev)})
        print(f"  step {steps_done}: dev " + " ".join(f"{n}={checks[-1][n]:.1%}" for n in TASKS), flush=True)
        return all(checks[-1][name] >= t.target for name, t in TASKS.items())

    losses = sft_train(model, tokenizer, train, MIXED_STUDENT.sft, stop=reached_targets)
    if not checks or not all(checks[-1][name] >= t.target for name, t in TASKS.items()):
        raise RuntimeError(
            f"mixed student warm-up: dev accuracy {checks[-1:]} did not reach every target "
            f"{ {n: t.target for n, t in TASKS.items()} } in {MIXED_STUDENT.sft.steps} steps; raise MIXED_STUDENT.sft.steps"
        )
    model.save_pretrained(str(model_dir), safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "steps": len(losses), "final_loss": losses[-1], "dev_checks": checks}


def read_train(path: Path) -> list[task.Example]:
    """The warm-up's SFT examples: the mixed training set's reference responses, each task's `share` records
    per round in file order until a task has too few left for a round (sft_train shuffles them each epoch)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    known = tuple(t.prefix for t in TASKS.values())
    unknown = [r["prompt"] for r in records if not r["prompt"].startswith(known)]
    if unknown:
        raise ValueError(f"{path}: {len(unknown)} prompts of no known task, e.g. {unknown[0]!r}")
    by_task = {
        name: [
            task.Example(r["prompt"], r["response"], r["answer"]) for r in records if r["prompt"].startswith(t.prefix)
        ]
        for name, t in TASKS.items()
    }
    rounds = min(len(by_task[name]) // t.share for name, t in TASKS.items())
    return [
        e for i in range(rounds) for name, t in TASKS.items() for e in by_task[name][i * t.share : (i + 1) * t.share]
    ]


def heldout_accuracy(model_dir: Path, eval_file: Path, n: int) -> dict[str, float]:
    """Greedy accuracy per task on the first `n` records of the mixed held-out file (the preset's eval set)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    records = task.read_jsonl(eval_file, limit=n)
    by_task = {name: [r for r in records if r.prompt.startswith(t.prefix)] for name, t in TASKS.items()}
    return _accuracies(model, tokenizer, by_task)


def build(out: Path, force: bool = False) -> dict[str, Any]:
    """Build the student into `out/student` unless a complete matching manifest is there; returns the manifest."""
    train_path = out / TRAIN_FILE
    if not train_path.is_file():
        raise FileNotFoundError(
            f"no {train_path}: build the mixed data set first: python -m recipe_gkd.demo.two_teachers"
        )

    def build_into(work: Path) -> dict[str, Any]:
        import transformers

        laps = Laps()
        student = warm_up(work / "student", read_train(train_path))
        laps.lap("warm_up")
        student["eval_accuracy"] = heldout_accuracy(work / "student", out / "data/eval.jsonl", EVAL_RECORDS)
        laps.lap("eval")
        return {
            "recipe": recipe(),
            "train_file_sha256": sha256_file(train_path),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "student": student,
            "seconds": laps.total()["total"],
        }

    manifest, built = build_unless_current(
        out, "mixed student", manifest_problem(out), force, build_into, entries=("student",)
    )
    if built:
        student = manifest["student"]
        accuracy = " ".join(f"{n}={a:.1%}" for n, a in student["eval_accuracy"].items())
        print(
            f"mixed student: {student['params']:,} params, {student['steps']} steps, held-out accuracy {accuracy} "
            f"(first {EVAL_RECORDS} records of {out / 'data/eval.jsonl'}); built in {manifest['seconds']:.0f} s"
        )
    return manifest


def main(argv: list[str] | None = None) -> int:
    return asset_command(argv, __doc__, DEFAULT_OUT, build)


if __name__ == "__main__":
    sys.exit(main())
