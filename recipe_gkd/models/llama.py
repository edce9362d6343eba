"""Llama (1-3.x) and Mistral: the dense base layer as it is, no biases; Mistral without a sliding window."""

from __future__ import annotations

from typing import Any

from recipe_gkd.models.base import ModelFamily, UnsupportedModelError


class Llama(ModelFamily):
    """Llama: RMSNorm, SwiGLU, RoPE (default or llama3 scaling), GQA; no linear biases."""

    model_types = ("llama",)

    def refuse(self, hf_config: Any) -> None:
        if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
            raise UnsupportedModelError("Llama attention_bias / mlp_bias = true is not supported")


class Mistral(Llama):
    """Mistral: Llama's layer; only a config without a sliding window (Mistral 7B v0.2+, Ministral)."""

    model_types = ("mistral",)

    def refuse(self, hf_config: Any) -> None:
        if getattr(hf_config, "sliding_window", None) is not None:
            # v0.1's 4096-token window is not reproduced.
            raise UnsupportedModelError(
                f"mistral sliding_window={hf_config.sliding_window} is not supported (only null)"
            )
        super().refuse(hf_config)
