"""The HF student as the megatron actor sees it: its architecture (`HFArch`, read and checked), the splits it allows, its weight files.

`read_hf_arch(hf_config)` keeps the few numbers that define the model and accepts only what the
megatron local layer spec reproduces exactly (`UnsupportedModelError` otherwise);
`check_split` checks a tensor x pipeline x context-parallel split against it. Pure Python, no
torch or megatron import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from recipe_gkd.parallel_layout import padded_vocab_size
from recipe_gkd.plan.model_shape import shape_from_config

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Mistral's own checkpoint format, shipped beside the HF files by Mistral repos (other tensor names).
MISTRAL_WEIGHT_FILES = "consolidated*.safetensors"


class UnsupportedModelError(ValueError):
    """The HF checkpoint uses a feature the megatron actor does not reproduce exactly."""


@dataclass(frozen=True)
class HFArch:
    """The architecture of a Llama/Qwen2-family causal LM, as read from its HF config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    initializer_range: float = 0.02
    # Qwen3: an RMSNorm over each head's query and key (HF q_norm / k_norm, megatron q/k_layernorm).
    qk_layernorm: bool = False
    # Llama 3.x rope_type "llama3": (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
    llama3_rope: tuple[float, float, float, int] | None = None

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


def read_hf_arch(hf_config: Any) -> HFArch:
    """HFArch from a transformers `LlamaConfig` / `Qwen2Config` / `Qwen3Config` (or any object with those fields)."""
    model_type = getattr(hf_config, "model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model.student_path holds a {model_type!r} model; the megatron actor supports {SUPPORTED_MODEL_TYPES}"
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act={hf_config.hidden_act!r}: only SwiGLU (silu) is supported")
    rope = _rope_parameters(hf_config)
    if rope.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type={rope.get('rope_type')!r} (rope scaling) is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    if model_type in ("qwen2", "qwen3") and getattr(hf_config, "use_sliding_window", False):
        raise UnsupportedModelError(f"{model_type} use_sliding_window=true is not supported")
    if model_type == "mistral" and getattr(hf_config, "sliding_window", None) is not None:
        # Mistral-style Llama (Mistral 7B v0.2+, Ministral) has none; v0.1's 4096-token window is not reproduced.
        raise UnsupportedModelError(f"mistral sliding_window={hf_config.sliding_window} is not supported (only null)")
    # Qwen2 always has q/k/v biases and no o_proj bias; the others none.
    if model_type == "qwen3" and getattr(hf_config, "attention_bias", False):
        raise UnsupportedModelError("Qwen3 attention_bias=true is not supported")
    if model_type in ("llama", "mistral") and (
        getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False)
    ):
        raise UnsupportedModelError("Llama attention_bias / mlp_bias = true is not supported")
    # The dense-transformer numbers through the memory plan's reader (one reading of a config); the actor's own below.
    shape = shape_from_config(hf_config)
    if shape.max_position_embeddings <= 0:
        raise UnsupportedModelError("model.student_path holds a config without max_position_embeddings")
    return HFArch(
        model_type=model_type,
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_layers=shape.num_layers,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))),
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings,
        # Shape's rule (qwen2, or attention_bias) is the actor's after the checks above refused any other bias.
        qkv_bias=shape.qkv_bias,
        initializer_range=float(getattr(hf_config, "initializer_range", 0.02)),
        qk_layernorm=shape.qk_layernorm,
        llama3_rope=_llama3_rope(rope),
    )


def _llama3_rope(rope: dict[str, Any]) -> tuple[float, float, float, int] | None:
    """Llama 3.x's frequency-dependent RoPE scaling parameters (rope_type "llama3"), else None."""
    if rope.get("rope_type", "default") != "llama3":
        return None
    try:
        return (
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]),
        )
    except KeyError as err:
        raise UnsupportedModelError(
            f"rope_type='llama3' without {err.args[0]} in the model's rope parameters"
        ) from None


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    # transformers 5 keeps RoPE settings in `rope_parameters`; 4.x used rope_theta/rope_scaling.
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    return dict(params)


def check_parallel_layout(arch: HFArch, tp_size: int, pp_size: int = 1) -> None:
    """Raise naming actor.megatron.tp / .pp when the model cannot be split over that many ranks."""
    for what, count in (("num_attention_heads", arch.num_heads), ("intermediate_size", arch.intermediate_size)):
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


def check_split(arch: HFArch, tp_size: int, pp_size: int, cp_size: int) -> None:
    """Raise naming the actor.megatron key when the student cannot be split this way."""
    check_context_parallel(cp_size)
    check_parallel_layout(arch, tp_size, pp_size)


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
    """Raise naming the key: the actor implements tensor, pipeline and data parallelism."""
    if cp_size != 1:
        raise UnsupportedModelError(
            f"actor.megatron.cp={cp_size}: context parallelism is not implemented in the megatron actor; "
            "set actor.megatron.cp=1"
        )


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
