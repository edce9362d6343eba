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
from typing import Any

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


def module_of(name: str) -> tuple[str, str]:
    """(HF module, "A" or "B") of adapter tensor `name`; raises on a name that is not one."""
    for kind in ("A", "B"):
        suffix = f".lora_{kind}.weight"
        if name.startswith(PEFT_PREFIX) and name.endswith(suffix):
            return name[len(PEFT_PREFIX) : -len(suffix)], kind
    raise KeyError(f"{name!r} is not a LoRA adapter tensor ({PEFT_PREFIX}<module>.lora_A|lora_B.weight)")


def adapter_names(num_layers: int, targets: Sequence[str]) -> list[str]:
    """Every adapter tensor name of a student with `num_layers` decoder layers, in export order."""
    names = []
    for i in range(num_layers):
        for target in targets:
            for proj in HF_PROJECTIONS[target]:
                names.extend(lora_names(f"model.layers.{i}.{proj}"))
    return names


def adapter_config(rank: int, alpha: float, targets: Sequence[str], base_model: str) -> dict[str, Any]:
    """adapter_config.json of a PEFT LoRA adapter (PEFT's LoraConfig fields that vLLM and peft read)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
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
