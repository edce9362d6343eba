"""Qwen2 / Qwen2.5: the dense base layer with q/k/v biases (no o_proj bias), no sliding window."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from recipe_gkd.models.base import (
    ATTENTION_OUT,
    FC1,
    FC2,
    INPUT_NORM,
    MLP_NORM,
    QKV,
    QKV_BIAS,
    ModelFamily,
    UnsupportedModelError,
)


def refuse_sliding_window(hf_config: Any) -> None:
    """Qwen's use_sliding_window=true (a window on some layers) is not reproduced."""
    if getattr(hf_config, "use_sliding_window", False):
        raise UnsupportedModelError(f"{hf_config.model_type} use_sliding_window=true is not supported")


class Qwen2(ModelFamily):
    """Qwen2: Llama's layer plus biases on the fused q/k/v projection, always."""

    model_types = ("qwen2",)
    layer = (INPUT_NORM, QKV, QKV_BIAS, ATTENTION_OUT, MLP_NORM, FC1, FC2)

    def qkv_bias(self, config: Mapping[str, Any] | Any) -> bool:
        return True

    def refuse(self, hf_config: Any) -> None:
        refuse_sliding_window(hf_config)
