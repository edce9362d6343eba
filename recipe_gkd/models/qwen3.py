"""Qwen3: the dense base layer with an RMSNorm over each head's query and key (q_norm / k_norm), no biases."""

from __future__ import annotations

from typing import Any

from recipe_gkd.models.base import (
    ATTENTION_OUT,
    FC1,
    FC2,
    INPUT_NORM,
    K_NORM,
    MLP_NORM,
    Q_NORM,
    QKV,
    ModelFamily,
    UnsupportedModelError,
)
from recipe_gkd.models.qwen2 import refuse_sliding_window


class Qwen3(ModelFamily):
    """Qwen3: Llama's layer plus per-head q/k RMSNorm (megatron's qk_layernorm); a head_dim of its own."""

    model_types = ("qwen3",)
    layer = (INPUT_NORM, QKV, Q_NORM, K_NORM, ATTENTION_OUT, MLP_NORM, FC1, FC2)
    qk_layernorm = True

    def refuse(self, hf_config: Any) -> None:
        refuse_sliding_window(hf_config)
        if getattr(hf_config, "attention_bias", False):
            raise UnsupportedModelError("Qwen3 attention_bias=true is not supported")
