"""Build a CPU task's assets offline and deterministically: tokenizer, task data, teacher, student.

    python -m recipe_gkd.demo.build_assets [--task demo|paper] [--out DIR] [--force]

`demo` (assets/demo): string reversal, the CPU demo. `paper` (assets/paper): digit sums in any
order with every running total (recipe_gkd/demo/sum_task.py), for benchmarks/paper_table.py.

1. Write the char tokenizer and the task's train / held-out eval jsonl files.
2. Train the teacher with the project's SFT loop until it is accurate.
3. Warm the (5x smaller) student up the same way, only until it gets the task's target share
   of a held-out dev split right, so it starts clearly worse than the teacher.
4. Evaluate both on the eval split (greedy exact match) and write `manifest.json` with
   sizes, parameter counts, accuracies, seconds and the sha256 of every file.

A second run with a complete manifest whose recipe matches does nothing (unless --force).
Fixed seeds, deterministic torch algorithms and a fixed thread count make a rebuild on the
same machine and torch version reproduce the same bytes (measured: three builds, one of them
with two threads, gave identical files). Another CPU or torch version may round differently.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from recipe_gkd.demo import sum_task, task
from recipe_gkd.demo.evaluate import accuracy_on, greedy_accuracy
from recipe_gkd.demo.sft import EncodedExample, SFTConfig, encode_example, sft_train
from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm

DEFAULT_OUT = Path("assets/demo")
MANIFEST = "manifest.json"
# Bump when the build changes in a way the recipe below does not show.
BUILD_VERSION = 1
# Fixed thread count, in case float reductions (matmul splits) depend on it. One thread: these
# matmuls are too small to gain much from two, and two threads slow down ~4x when another
# process shares the 2 cores (measured; 1 and 2 threads gave the same bits here).
BUILD_THREADS = 1
# The asset entries of the out dir; nothing else in it is touched.
ENTRIES = ("data", "teacher", "student")
REQUIRED_FILES = (
    "data/train.jsonl",
    "data/eval.jsonl",
    "teacher/model.safetensors",
    "teacher/config.json",
    "teacher/tokenizer.json",
    "student/model.safetensors",
    "student/config.json",
    "student/tokenizer.json",
)
HASH_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class ModelRecipe:
    """How one demo model is initialised and trained."""

    spec: TinyModelSpec
    init_seed: int
    sft: SFTConfig


TEACHER = ModelRecipe(
    spec=TinyModelSpec(hidden_size=128, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=4),
    init_seed=1,
    sft=SFTConfig(steps=300, batch_size=128, lr=3e-3, warmup_steps=20, min_lr_ratio=0.1, seed=1),
)
# The student's warm-up stops at the first check where its dev accuracy reaches the target;
# `sft.steps` is only the cap. Accuracy on this task jumps within a few tens of steps, so
# stopping on accuracy (not on a step count) is what lands the student in the target range.
STUDENT = ModelRecipe(
    spec=TinyModelSpec(hidden_size=96, intermediate_size=192, num_layers=2, num_heads=3, num_kv_heads=3),
    init_seed=2,
    sft=SFTConfig(steps=400, batch_size=128, lr=3e-3, warmup_steps=10, seed=2),
)
STUDENT_TARGET_DEV_ACCURACY = 0.30
STUDENT_CHECK_FROM_STEP = 60
STUDENT_CHECK_EVERY = 2
# The paper task (sum_task.py): longer responses (up to 25 characters + EOS).
PAPER_MAX_NEW_TOKENS = 32
PAPER_TEACHER_STEPS = 800
PAPER_STUDENT_STEPS = 2000
PAPER_STUDENT_TARGET = 0.30


@dataclass(frozen=True)
class TaskAssets:
    """One task's assets: its data, its two models' recipes and how answers are checked."""

    name: str
    out: Path
    describe: Callable[[], dict[str, Any]]  # the task's part of the manifest recipe
    splits: Callable[[], task.Splits]
    teacher: ModelRecipe
    student: ModelRecipe
    student_target: float
    check_from_step: int
    check_every: int
    answer_match: str = "exact"  # data.answer_match of the task's preset
    max_new_tokens: int = 16
    teacher_encode: Callable[[Any, task.Example], EncodedExample] = encode_example  # the teacher's SFT examples


def _demo_task() -> dict[str, Any]:
    return {
        "name": task.TASK_NAME,
        "prefix": task.PROMPT_PREFIX,
        "letters": [task.MIN_LETTERS, task.MAX_LETTERS],
        "seed": task.DEFAULT_SEED,
        "train": task.TRAIN_SIZE,
        "dev": task.DEV_SIZE,
        "eval": task.EVAL_SIZE,
    }


def _paper_task() -> dict[str, Any]:
    return {
        "name": sum_task.TASK_NAME,
        "prefix": sum_task.PROMPT_PREFIX,
        "digits": [sum_task.MIN_DIGITS, sum_task.MAX_DIGITS],
        "order": "left_to_right",
        "teacher_slip_fraction": sum_task.TEACHER_SLIP_FRACTION,
        "max_slip": sum_task.MAX_SLIP,
        "seed": sum_task.DEFAULT_SEED,
        "dev": sum_task.DEV_SIZE,
        "eval": sum_task.EVAL_SIZE,
        "answer_match": "suffix",
        "max_new_tokens": PAPER_MAX_NEW_TOKENS,
    }


DEMO = TaskAssets(
    name="demo",
    out=DEFAULT_OUT,
    describe=_demo_task,
    splits=task.generate_splits,
    teacher=TEACHER,
    student=STUDENT,
    student_target=STUDENT_TARGET_DEV_ACCURACY,
    check_from_step=STUDENT_CHECK_FROM_STEP,
    check_every=STUDENT_CHECK_EVERY,
)
PAPER = TaskAssets(
    name="paper",
    out=Path("assets/paper"),
    describe=_paper_task,
    splits=sum_task.generate_splits,
    teacher=ModelRecipe(
        spec=TinyModelSpec(hidden_size=128, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=4),
        init_seed=1,
        sft=SFTConfig(steps=PAPER_TEACHER_STEPS, batch_size=128, lr=3e-3, warmup_steps=20, min_lr_ratio=0.1, seed=1),
    ),
    student=ModelRecipe(
        spec=TinyModelSpec(hidden_size=96, intermediate_size=192, num_layers=2, num_heads=3, num_kv_heads=3),
        init_seed=2,
        sft=SFTConfig(steps=PAPER_STUDENT_STEPS, batch_size=128, lr=3e-3, warmup_steps=10, seed=2),
    ),
    student_target=PAPER_STUDENT_TARGET,
    check_from_step=100,
    check_every=20,
    answer_match="suffix",
    max_new_tokens=PAPER_MAX_NEW_TOKENS,
    teacher_encode=sum_task.encode_with_slip,
)
TASKS = {t.name: t for t in (DEMO, PAPER)}


def recipe(assets: TaskAssets = DEMO) -> dict[str, Any]:
    """Everything the asset bytes depend on (besides torch itself); a manifest must match it."""
    return {
        "build_version": BUILD_VERSION,
        "threads": BUILD_THREADS,
        "task": assets.describe(),
        "teacher": _model_recipe(assets.teacher),
        "student": _model_recipe(assets.student),
        "student_warmup_stop": {
            "target_dev_accuracy": assets.student_target,
            "check_from_step": assets.check_from_step,
            "check_every": assets.check_every,
        },
    }


# TinyModelSpec fields added after the assets were built, at the values that leave the bytes as they were.
# The expert fields shape a qwen3_moe model only: a dense model's bytes never depend on them.
EXPERT_SPEC_DEFAULTS = {"num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 64}
SPEC_FIELDS_AT_THEIR_DEFAULT = {"vocab_size": 0, "head_dim": 0, "save_dtype": "float32", **EXPERT_SPEC_DEFAULTS}


def without_expert_defaults(described: dict[str, Any]) -> dict[str, Any]:
    """A model recipe (asdict of one with a `spec`) without the expert fields at their default, which leave a dense
    model's bytes as they were: the recipe of assets built before those fields existed."""
    spec = described["spec"]
    for name, default in EXPERT_SPEC_DEFAULTS.items():
        if spec.get(name) == default:
            spec.pop(name)
    return described


def _model_recipe(model: Any) -> dict[str, Any]:
    """A model's part of the recipe; spec fields that keep their byte-neutral default are left out."""
    described = asdict(model)
    spec = described["spec"]
    for name, default in SPEC_FIELDS_AT_THEIR_DEFAULT.items():
        if spec.get(name) == default:
            del spec[name]
    return described


@contextlib.contextmanager
def deterministic_torch(threads: int = BUILD_THREADS) -> Iterator[None]:
    """Deterministic algorithms and a fixed thread count for the block; restores both after."""
    old_threads = torch.get_num_threads()
    old_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old_deterministic)
        torch.set_num_threads(old_threads)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def file_table(root: Path, entries: Sequence[str] = ENTRIES) -> dict[str, dict[str, Any]]:
    """{relative path: {bytes, sha256}} of every file under the asset entries of `root`."""
    table: dict[str, dict[str, Any]] = {}
    for entry in entries:
        for path in sorted((root / entry).rglob("*")):
            if path.is_file():
                table[path.relative_to(root).as_posix()] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return table


def manifest_problem(out: Path, assets: TaskAssets = DEMO) -> str | None:
    """Why `out` does not hold complete assets of the current recipe (None when it does)."""
    return recipe_manifest_problem(out, recipe(assets), REQUIRED_FILES)


def recipe_manifest_problem(out: Path, current_recipe: dict[str, Any], required: Sequence[str]) -> str | None:
    """Why `out` does not hold what `current_recipe` builds (None when it does): no manifest, another recipe, a
    `required` file missing from the manifest, or a file that differs from it. Every asset builder's check."""
    path = out / MANIFEST
    if not path.is_file():
        return f"no {path}"
    manifest = json.loads(path.read_text())
    if manifest.get("recipe") != json.loads(json.dumps(current_recipe)):
        return "the recipe changed since the last build"
    files = manifest.get("files", {})
    missing = [name for name in required if name not in files]
    if missing:
        return f"the manifest lacks {missing}"
    return files_problem(out, files)


def files_problem(out: Path, files: dict[str, Any]) -> str | None:
    """Why the files under `out` differ from a manifest's `files` table (None when they all match)."""
    for name, entry in files.items():
        file = out / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != entry["bytes"] or sha256_file(file) != entry["sha256"]:
            return f"{file} differs from the manifest"
    return None


def load_model(model_dir: Path) -> tuple[Any, Any]:
    """(model in float32, tokenizer) of a built model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model, tokenizer


def train_teacher(model_dir: Path, splits: task.Splits, assets: TaskAssets) -> dict[str, Any]:
    """Initialise and fully train the teacher in `model_dir`; returns its manifest entry."""
    build_tiny_causal_lm(model_dir, seed=assets.teacher.init_seed, spec=assets.teacher.spec)
    model, tokenizer = load_model(model_dir)
    losses = sft_train(model, tokenizer, splits.train, assets.teacher.sft, encode=assets.teacher_encode)
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return {"params": count_params(model), "steps": len(losses), "final_loss": losses[-1]}


def train_student(model_dir: Path, splits: task.Splits, assets: TaskAssets) -> dict[str, Any]:
    """Initialise the student in `model_dir` and warm it up until its dev accuracy hits the target."""
    student = assets.student
    build_tiny_causal_lm(model_dir, seed=student.init_seed, spec=student.spec)
    model, tokenizer = load_model(model_dir)
    dev_accuracy: list[float] = []

    def reached_target(steps_done: int) -> bool:
        if steps_done < assets.check_from_step or steps_done % assets.check_every:
            return False
        dev_accuracy.append(accuracy_on(model, tokenizer, splits.dev, assets.answer_match, assets.max_new_tokens))
        return dev_accuracy[-1] >= assets.student_target

    losses = sft_train(model, tokenizer, splits.train, student.sft, stop=reached_target)
    if not dev_accuracy or dev_accuracy[-1] < assets.student_target:
        raise RuntimeError(
            f"student warm-up: dev accuracy {dev_accuracy[-1:]} never reached {assets.student_target} "
            f"in {student.sft.steps} steps; raise the student's sft.steps"
        )
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return {
        "params": count_params(model),
        "steps": len(losses),
        "final_loss": losses[-1],
        "dev_accuracy": dev_accuracy[-1],
    }


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build(out: Path, force: bool = False, assets: TaskAssets = DEMO) -> dict[str, Any]:
    """Build the assets into `out` unless a complete matching manifest is there; returns the manifest."""
    manifest, built = build_unless_current(
        out, f"{assets.name} assets", manifest_problem(out, assets), force, lambda work: _build_into(work, assets)
    )
    if built:
        _print_summary(out, manifest, assets)
    return manifest


def build_unless_current(
    out: Path,
    label: str,
    problem: str | None,
    force: bool,
    build_into: Callable[[Path], dict[str, Any]],
    entries: Sequence[str] = ENTRIES,
    threads: int = BUILD_THREADS,
) -> tuple[dict[str, Any], bool]:
    """Every asset builder's frame: (the manifest, whether it was built now). With `problem` None (the manifest
    matches) and no `force`, the manifest already there. Otherwise `build_into(work)` runs with deterministic torch
    on `threads` threads, its `entries` replace `out`'s (install_built), and the manifest it returned, with the
    file table and their total bytes, is written last."""
    if problem is None and not force:
        print(f"{label}: {out} is complete and matches the recipe; nothing to do (--force rebuilds)")
        return json.loads((out / MANIFEST).read_text()), False
    print(f"{label}: building into {out} ({'--force' if problem is None else problem})", flush=True)

    def deterministic(work: Path) -> dict[str, Any]:
        with deterministic_torch(threads):
            return build_into(work)

    manifest = install_built(out, deterministic, entries)
    manifest["total_bytes"] = sum(f["bytes"] for f in manifest["files"].values())
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest, True


class Laps:
    """A builder's phase timer: `lap(name)` records and prints the seconds since the previous lap."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.start = self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self.last, 2)
        print(f"  {name}: {self.seconds[name]:.1f} s", flush=True)
        self.last = now

    def total(self) -> dict[str, float]:
        """The laps and the total since the timer started."""
        return {**self.seconds, "total": round(time.perf_counter() - self.start, 2)}


def _build_into(work: Path, assets: TaskAssets) -> dict[str, Any]:
    import transformers

    laps = Laps()
    splits = assets.splits()
    task.write_jsonl(work / "data/train.jsonl", splits.train)
    task.write_jsonl(work / "data/eval.jsonl", splits.eval)
    laps.lap("data")
    teacher = train_teacher(work / "teacher", splits, assets)
    laps.lap("teacher_train")
    student = train_student(work / "student", splits, assets)
    laps.lap("student_warmup")
    eval_file = work / "data/eval.jsonl"
    for entry, model in ((teacher, "teacher"), (student, "student")):
        entry["eval_accuracy"] = greedy_accuracy(
            work / model, eval_file, match=assets.answer_match, max_new_tokens=assets.max_new_tokens
        )
    laps.lap("eval")
    return {
        "recipe": recipe(assets),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "data": {"train": len(splits.train), "eval": len(splits.eval)},
        "teacher": teacher,
        "student": student,
        "seconds": laps.total(),
    }


def install_built(
    out: Path, build_into: Callable[[Path], dict[str, Any]], entries: Sequence[str] = ENTRIES
) -> dict[str, Any]:
    """Build into a fresh directory beside `out` (`build_into(work)` writes `entries` there and returns the manifest),
    then replace `out`'s entries with them; returns the manifest with their file table. The old manifest is removed
    before the entries move and the caller writes the new one last: its presence means the entries are complete.
    A build that fails leaves `out` as it was."""
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        manifest = build_into(work)
        (out / MANIFEST).unlink(missing_ok=True)
        for entry in entries:
            target = out / entry
            if target.exists():
                shutil.rmtree(target)
            shutil.move(str(work / entry), str(target))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    manifest["files"] = file_table(out, entries)
    return manifest


def _print_summary(out: Path, manifest: dict[str, Any], assets: TaskAssets) -> None:
    t, s = manifest["teacher"], manifest["student"]
    print(
        f"{assets.name} assets: teacher {t['params']:,} params, {t['steps']} steps, eval accuracy {t['eval_accuracy']:.1%}; "
        f"student {s['params']:,} params, {s['steps']} steps, eval accuracy {s['eval_accuracy']:.1%}; "
        f"{manifest['total_bytes'] / 2**20:.1f} MiB in {out}; built in {manifest['seconds']['total']:.0f} s"
    )


def asset_command(argv: list[str] | None, doc: str | None, default_out: Path, build: Callable[..., Any]) -> int:
    """The command line of a builder with one asset directory: `--out DIR` (default `default_out`), `--force`."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out, help="asset directory (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the manifest matches")
    args = parser.parse_args(argv)
    build(args.out, force=args.force)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="demo", help="which task (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="asset directory (default: assets/<task>)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the manifest matches")
    args = parser.parse_args(argv)
    assets = TASKS[args.task]
    build(args.out or assets.out, force=args.force, assets=assets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
