"""The HF student as the megatron actor splits and loads it: the tensor x pipeline x context x expert-parallel splits it allows, its weight files.

`check_split` checks a split against the student's `HFArch` (read by its family, recipe_gkd/models) and raises
`UnsupportedModelError` naming the actor.megatron key; `read_student_arch` reads the student's config.json for the
driver's checks. Pure Python, no torch or megatron import.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from recipe_gkd.models import HFArch, Shape, UnsupportedModelError, read_hf_arch
from recipe_gkd.parallel_layout import padded_vocab_size

SAFETENSORS_INDEX = "model.safetensors.index.json"
# Mistral's own checkpoint format, shipped beside the HF files by Mistral repos (other tensor names).
MISTRAL_WEIGHT_FILES = "consolidated*.safetensors"


def check_parallel_layout(arch: HFArch, tp_size: int, pp_size: int = 1) -> None:
    """Raise naming actor.megatron.tp / .pp when the model cannot be split over that many ranks."""
    # The MLP TP shards: a mixture of experts' experts (megatron's expert tensor parallel size is tp); a Qwen3-MoE
    # config's intermediate_size is a dense MLP no layer has.
    mlp = (
        ("moe_intermediate_size", arch.moe_intermediate_size)
        if arch.is_moe
        else ("intermediate_size", arch.intermediate_size)
    )
    for what, count in (("num_attention_heads", arch.num_heads), mlp):
        if count % tp_size:
            raise UnsupportedModelError(
                f"actor.megatron.tp={tp_size} must divide the student's {what}={count}; choose another actor.megatron.tp"
            )
    # Fewer KV heads than TP ranks is fine when each KV head spans whole ranks (megatron
    # all-gathers the fused QKV output and each rank picks its query heads).
    kv = arch.num_kv_heads
    if kv % tp_size and tp_size % kv:
        raise UnsupportedModelError(
            f"actor.megatron.tp={tp_size} and the student's num_key_value_heads={kv}: one must divide the other; "
            "choose another actor.megatron.tp"
        )
    shard = padded_vocab_size(arch.vocab_size, tp_size) // tp_size
    if shard * (tp_size - 1) >= arch.vocab_size:
        raise UnsupportedModelError(
            f"actor.megatron.tp={tp_size} leaves the last rank only vocabulary padding (vocab_size={arch.vocab_size})"
        )
    if arch.num_layers % pp_size:
        raise UnsupportedModelError(
            f"actor.megatron.pp={pp_size} must divide the student's num_hidden_layers={arch.num_layers} "
            "(every pipeline stage holds the same number of layers); choose another actor.megatron.pp"
        )


def check_split(arch: HFArch, tp_size: int, pp_size: int, cp_size: int, *, ep_size: int = 1) -> None:
    """Raise naming the actor.megatron key when the student cannot be split this way."""
    check_context_parallel(cp_size)
    check_expert_parallel(arch, ep_size)
    check_parallel_layout(arch, tp_size, pp_size)
    check_moe_split(arch, tp_size, cp_size)


def check_lora_student(arch: HFArch, lora_rank: int) -> None:
    """Raise naming actor.lora.rank for adapters on a mixture of experts: they cover dense linears only (an
    expert's are its own, per expert)."""
    if lora_rank > 0 and arch.is_moe:
        raise UnsupportedModelError(
            f"actor.lora.rank={lora_rank} with a mixture-of-experts student ({arch.num_experts} experts): adapters "
            "cover dense students only; set actor.lora.rank=0"
        )


def check_moe_split(arch: HFArch, tp_size: int, cp_size: int) -> None:
    """Raise naming actor.megatron.tp / .cp for a mixture of experts at TP > 1 or CP > 1: megatron-core 0.16.1's
    MoELayer.forward refuses to train at TP > 1 without sequence parallelism (transformer/moe/moe_layer.py), which
    the actor does not use, and context parallelism is not built for experts; they split over expert parallelism."""
    if not arch.is_moe:
        return
    if cp_size > 1:
        raise UnsupportedModelError(
            f"actor.megatron.cp={cp_size} with a mixture-of-experts student: context parallelism is not built for "
            "its experts (the router and the all-to-all dispatcher take a replica's whole sequences); set "
            "actor.megatron.cp=1 and split the experts with actor.megatron.ep"
        )
    if tp_size > 1:
        raise UnsupportedModelError(
            f"actor.megatron.tp={tp_size} with a mixture-of-experts student: the actor trains experts at TP=1 "
            "(megatron's MoE layer needs sequence parallelism at TP > 1); set actor.megatron.tp=1 and split the "
            "experts with actor.megatron.ep"
        )


def check_expert_parallel(shape: Shape, ep_size: int) -> None:
    """Raise naming actor.megatron.ep when the student's experts cannot be split over `ep_size` ranks: a dense
    student has none, and each rank holds num_experts / ep of every layer's."""
    if ep_size == 1:
        return
    if not shape.is_moe:
        raise UnsupportedModelError(
            f"actor.megatron.ep={ep_size} but the student is a dense model (no num_experts in its config.json): "
            "expert parallelism splits a mixture of experts' experts; set actor.megatron.ep=1"
        )
    if shape.num_experts % ep_size:
        raise UnsupportedModelError(
            f"actor.megatron.ep={ep_size} must divide the student's num_experts={shape.num_experts} (each rank "
            "holds num_experts / ep experts of every layer); choose another actor.megatron.ep"
        )


def read_student_arch(model_dir: str | Path) -> HFArch:
    """The HFArch of the HF model directory `model_dir`, from its config.json as written.

    For the driver's checks before anything starts: parsing the json takes milliseconds, where
    transformers' AutoConfig costs the driver ~4 s of imports (torch, transformers) on 2 cores.
    A field config.json leaves out takes read_hf_arch's default, not the model class's; the
    actor reads the same file through AutoConfig and applies every check again.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UnsupportedModelError(f"model.student_path={str(model_dir)!r} has no config.json")
    return read_hf_arch(SimpleNamespace(**json.loads(path.read_text())))


def check_context_parallel(cp_size: int) -> None:
    """Raise naming the key for a context-parallel size the zigzag split does not take (1, 2, 4, 8)."""
    if cp_size not in (1, 2, 4, 8):
        raise UnsupportedModelError(f"actor.megatron.cp={cp_size}: choose one of (1, 2, 4, 8)")


def hf_weight_files(model_dir: Path) -> list[Path]:
    """The HF-format safetensors files of a checkpoint: those its index names, else every *.safetensors but
    Mistral's own consolidated*.safetensors (which Mistral repos ship beside the HF files, other names)."""
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        files = sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        mistral = set(model_dir.glob(MISTRAL_WEIGHT_FILES))
        files = sorted(f for f in model_dir.glob("*.safetensors") if f not in mistral)
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_dir} (model.student_path); save the student with safe_serialization"
        )
    return files
