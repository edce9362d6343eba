"""Model families: one spec per family (config.json reading, HF <-> megatron tensor table, megatron layer fields).

`read_hf_arch(hf_config)` is the actor's one reading of the student's config (refusing a model_type no family
covers); `shape_from_config(config)` the memory plan's, of any model (the student's family's facts when it has
one: a Qwen3-MoE's experts). The torch conversion over a family's table is recipe_gkd/actor/hf_convert.py, the megatron model
recipe_gkd/actor/mcore_model.py; neither tests a family. Adding a family: its module here (a `ModelFamily` subclass,
docs/layout.md "Adding a model family") and one line in FAMILIES. Pure Python, no torch or megatron import.

| family | module | model_type | beyond the dense Llama layer |
|---|---|---|---|
| Llama, Mistral | llama.py | llama, mistral | nothing (Mistral: no sliding window) |
| Qwen2 / Qwen2.5 | qwen2.py | qwen2 | q/k/v biases |
| Qwen3 | qwen3.py | qwen3 | per-head q/k RMSNorm |
| Qwen3-MoE | qwen3_moe.py | qwen3_moe | Qwen3's attention; a router and routed SwiGLU experts in every layer |
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from recipe_gkd.models.base import HFArch, ModelFamily, Shape, StackedTensor, UnsupportedModelError, config_field
from recipe_gkd.models.llama import Llama, Mistral
from recipe_gkd.models.qwen2 import Qwen2
from recipe_gkd.models.qwen3 import Qwen3
from recipe_gkd.models.qwen3_moe import Qwen3Moe

# The families the megatron actor reproduces exactly, one instance each.
FAMILIES: tuple[ModelFamily, ...] = (Llama(), Mistral(), Qwen2(), Qwen3(), Qwen3Moe())
SUPPORTED_MODEL_TYPES = tuple(model_type for family in FAMILIES for model_type in family.model_types)
_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}
# The plan's reading of a dense model of no listed family (a teacher the actor never builds).
DENSE = ModelFamily()

__all__ = [
    "DENSE",
    "FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "HFArch",
    "ModelFamily",
    "Shape",
    "StackedTensor",
    "UnsupportedModelError",
    "family_of",
    "read_hf_arch",
    "shape_from_config",
]


def family_of(model_type: str) -> ModelFamily | None:
    """The family covering HF `model_type`, or None."""
    return _BY_MODEL_TYPE.get(model_type)


def read_hf_arch(hf_config: Any) -> HFArch:
    """HFArch from a transformers `LlamaConfig` / `Qwen2Config` / `Qwen3Config` (or any object with those fields)."""
    model_type = getattr(hf_config, "model_type", "")
    family = family_of(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"model.student_path holds a {model_type!r} model; the megatron actor supports {SUPPORTED_MODEL_TYPES}"
        )
    return family.read_arch(hf_config)


def shape_from_config(config: Mapping[str, Any] | Any) -> Shape:
    """A Shape from a config.json dict or a transformers config: its family's reading, else the dense base's."""
    return (family_of(config_field(config, "model_type", "")) or DENSE).shape(config)
