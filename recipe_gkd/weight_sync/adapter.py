"""A LoRA adapter as it travels and is stored: HF PEFT names, its adapter_config.json, a PEFT directory.

The actor's adapters sit on megatron's fused linears (actor.lora.targets: qkv, proj, fc1, fc2); in HF form each
becomes one (lora_A, lora_B) pair per HF projection, named as PEFT saves them
(`base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight` [rank, in], `...lora_B.weight` [out, rank]).
A fused qkv / gate-up adapter splits exactly: B's rows split as the fused weight's do and A repeats
(B_qkv A x = [B_q; B_k; B_v] A x).

Two forms of one adapter:
- the sync form (what the engines load every step): B already multiplied by the scale alpha / rank and
  `lora_alpha` = rank, so an engine applies B A x with scale 1 and holds B bit for bit as the actor sent it (the
  sync check compares checksums);
- the PEFT form (`final_adapter/`): B as trained and `lora_alpha` = actor.lora.alpha, what `peft` loads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recipe_gkd.models import Shape

# PEFT's prefix of an adapter tensor over a causal LM (PeftModel -> LoraModel -> the HF model).
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# actor.lora.targets -> the HF projections each covers (Llama, Mistral, Qwen2, Qwen3 decoder layers).
HF_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "proj": ("self_attn.o_proj",),
    "fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "fc2": ("mlp.down_proj",),
}


def hf_target_modules(targets: Sequence[str]) -> list[str]:
    """PEFT's target_modules of `targets` (actor.lora.targets): the projections' short names."""
    return [proj.split(".")[-1] for target in targets for proj in HF_PROJECTIONS[target]]


def lora_names(module: str) -> tuple[str, str]:
    """(lora_A, lora_B) names of HF module `module` (e.g. `model.layers.0.self_attn.q_proj`)."""
    return f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight"


def adapter_names(num_layers: int, targets: Sequence[str]) -> list[str]:
    """Every adapter tensor name of a student with `num_layers` decoder layers, in export order."""
    return [name for module in adapter_modules(num_layers, targets) for name in lora_names(module)]


def adapter_modules(num_layers: int, targets: Sequence[str]) -> list[str]:
    """The HF modules (e.g. `model.layers.0.self_attn.q_proj`) that carry an adapter, in export order."""
    return [
        f"model.layers.{i}.{proj}" for i in range(num_layers) for target in targets for proj in HF_PROJECTIONS[target]
    ]


def projection_shapes(shape: Shape) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of HF_PROJECTIONS in one decoder layer of a dense student of `shape` (its
    config.json as recipe_gkd.models reads it)."""
    hidden, inter = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return {
        "self_attn.q_proj": (q, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, q),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


def adapter_shapes(modules: Mapping[str, tuple[int, int]], rank: int) -> dict[str, tuple[int, int]]:
    """Every adapter tensor's name -> shape, of HF modules `modules` (name -> the projection's (out, in)):
    lora_A [rank, in], lora_B [out, rank]."""
    shapes: dict[str, tuple[int, int]] = {}
    for module, (out_features, in_features) in modules.items():
        a, b = lora_names(module)
        shapes[a], shapes[b] = (rank, in_features), (out_features, rank)
    return shapes


def as_torch(value: Any) -> Any:
    """A torch tensor of `value` (a torch tensor as is; a numpy array copied: the object store's are read-only)."""
    import numpy as np
    import torch

    return torch.from_numpy(np.array(value, copy=True)) if isinstance(value, np.ndarray) else value


def collect_version(named: Iterable[tuple[str, Any]], shapes: Mapping[str, tuple[int, int]]) -> dict[str, Any]:
    """One whole adapter version as name -> torch tensor, checked against `shapes` (`adapter_shapes`): every tensor
    there and none else (`check_complete`), each of its shape; raises before anything is loaded."""
    version: dict[str, Any] = {}
    for name, value in named:
        if name in version:
            raise KeyError(f"adapter version sent {name!r} twice")
        version[name] = as_torch(value)
    check_complete(version, shapes)
    wrong = [f"{n} {tuple(t.shape)}, expected {shapes[n]}" for n, t in version.items() if tuple(t.shape) != shapes[n]]
    if wrong:
        raise ValueError(
            f"adapter version: {len(wrong)} tensors of the wrong shape, e.g. {wrong[:2]} (lora_A is "
            "[actor.lora.rank, in], lora_B [out, actor.lora.rank])"
        )
    return version


def adapter_config(
    rank: int, alpha: float, targets: Sequence[str], base_model: str, dropout: float = 0.0
) -> dict[str, Any]:
    """adapter_config.json of a PEFT LoRA adapter (PEFT's LoraConfig fields that vLLM and peft read; `dropout`: the
    training's, a record for whoever trains it further: inference applies none)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": hf_target_modules(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_peft_dir(out: Path, tensors: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """A PEFT adapter directory: adapter_config.json and adapter_model.safetensors (torch tensors or numpy)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    # A copy each: a fused linear's projections share one A, which safetensors refuses to write twice.
    state = {name: torch.as_tensor(t).detach().to("cpu").clone() for name, t in tensors.items()}
    save_file(state, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(dict(config), indent=2) + "\n")


def check_complete(loaded: Iterable[str], expected: Iterable[str]) -> None:
    """Raise when an adapter version misses a tensor the engine expects, or brings one it does not know."""
    got, want = set(loaded), set(expected)
    if got != want:
        missing, extra = sorted(want - got), sorted(got - want)
        raise KeyError(f"adapter version incomplete: missing {missing[:3]} ({len(missing)}), unknown {extra[:3]}")
