"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention and, in every layer, routed experts in place of the MLP.

The router is Qwen3's: a linear gate over the hidden state (HF `mlp.gate`), softmax over every expert, the top
`num_experts_per_tok`, renormalised to sum to 1 when `norm_topk_prob` (HF Qwen3MoeSparseMoeBlock). megatron's
TopKRouter computes the same two ways: softmax then top-k (`moe_router_pre_softmax`), or top-k then softmax over the
chosen logits, which equals the renormalised top-k of the whole softmax. Each expert is a SwiGLU MLP of
`moe_intermediate_size`, saved per expert (`mlp.experts.{e}.gate_proj.weight`, ...: what HF checkpoints ship and what
transformers' save_pretrained writes) and held by megatron's SequentialMLP as `mlp.experts.local_experts.{l}.*`.
Refused: layers without experts (`decoder_sparse_step` != 1, `mlp_only_layers`) and Qwen2-MoE's shared expert
(model_type qwen2_moe, not covered), as Qwen3's sliding window and attention biases.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from recipe_gkd.models.base import (
    ATTENTION_OUT,
    COPY,
    GATED_FC1,
    INPUT_NORM,
    K_NORM,
    MLP_NORM,
    Q_NORM,
    QKV,
    HFArch,
    LayerTensor,
    Shape,
    StackedTensor,
    UnsupportedModelError,
    config_field,
)
from recipe_gkd.models.qwen3 import Qwen3

ROUTER = LayerTensor("mlp.router.weight", ("mlp.gate.weight",))
# An expert's megatron tensors under its number (local on an expert-parallel rank, global in the unsharded layout).
MCORE_EXPERT = "mlp.experts.local_experts.{e}."
HF_EXPERT = "mlp.experts.{e}."
ATTENTION = (INPUT_NORM, QKV, Q_NORM, K_NORM, ATTENTION_OUT, MLP_NORM)
# transformers 5 holds a layer's experts fused (modeling_qwen3_moe.py Qwen3MoeExperts: gate_up_proj [E, 2I, H] with each
# expert's gate rows first, as its forward's `chunk(2)` reads them; down_proj [E, H, I]), loaded from and saved to the
# per-expert names (conversion_mapping.py "qwen2_moe", which qwen3_moe maps to: MergeModulelist(dim=0) over the
# experts, then Concatenate(dim=1) of gate_proj and up_proj).
TRANSFORMERS_EXPERTS = (
    StackedTensor("mlp.experts.gate_up_proj", (f"{HF_EXPERT}gate_proj.weight", f"{HF_EXPERT}up_proj.weight")),
    StackedTensor("mlp.experts.down_proj", (f"{HF_EXPERT}down_proj.weight",)),
)


def num_experts(config: Mapping[str, Any] | Any) -> int:
    """The routed experts per layer: `num_experts` in Qwen's checkpoints, `num_local_experts` as transformers 5
    writes a Qwen3MoeConfig (its attribute map between the two)."""
    value = config_field(config, "num_experts", None)
    if value is None:
        value = config_field(config, "num_local_experts")
    return int(value)


def expert_tensors(e: int) -> tuple[LayerTensor, LayerTensor]:
    """Expert `e`'s two megatron tensors: fc1 = [gate; up] (hf_convert regroups it per TP rank), fc2 = down."""
    mcore, hf = MCORE_EXPERT.format(e=e), HF_EXPERT.format(e=e)
    fc1 = LayerTensor(f"{mcore}linear_fc1.weight", (f"{hf}gate_proj.weight", f"{hf}up_proj.weight"), GATED_FC1)
    return fc1, LayerTensor(f"{mcore}linear_fc2.weight", (f"{hf}down_proj.weight",), COPY)


def expert_number(name: str) -> int | None:
    """The expert number in a megatron name `...mlp.experts.local_experts.<e>....` (None: not an expert's tensor)."""
    marker = ".local_experts."
    if marker not in name:
        return None
    return int(name.split(marker, 1)[1].split(".", 1)[0])


def with_expert_number(name: str, e: int) -> str:
    """`name` (an expert's megatron tensor) renumbered to expert `e`."""
    head, tail = name.split(".local_experts.", 1)
    return f"{head}.local_experts.{e}.{tail.split('.', 1)[1]}"


class Qwen3Moe(Qwen3):
    """Qwen3's attention, then the router and `num_experts` SwiGLU experts (megatron: TopKRouter, SequentialMLP)."""

    model_types = ("qwen3_moe",)
    layer = (*ATTENTION, ROUTER)
    stacked = TRANSFORMERS_EXPERTS

    def layer_tensors(self, arch: Shape) -> tuple[LayerTensor, ...]:
        return (*ATTENTION, ROUTER, *(t for e in range(arch.num_experts) for t in expert_tensors(e)))

    def shape(self, config: Mapping[str, Any] | Any) -> Shape:
        return dataclasses.replace(
            super().shape(config),
            num_experts=num_experts(config),
            experts_per_token=int(config_field(config, "num_experts_per_tok")),
            moe_intermediate_size=int(config_field(config, "moe_intermediate_size")),
        )

    def refuse(self, hf_config: Any) -> None:
        super().refuse(hf_config)
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        dense = list(getattr(hf_config, "mlp_only_layers", None) or [])
        if step != 1 or dense:
            raise UnsupportedModelError(
                f"Qwen3-MoE with dense layers (decoder_sparse_step={step}, mlp_only_layers={dense}) is not supported: "
                "the megatron actor builds experts in every layer"
            )
        if num_experts(hf_config) < 2:
            raise UnsupportedModelError("Qwen3-MoE with fewer than 2 experts (num_experts)")

    def actor_fields(self, hf_config: Any, shape: Shape, rope: dict[str, Any]) -> dict[str, Any]:
        return {**super().actor_fields(hf_config, shape, rope), "norm_topk_prob": bool(hf_config.norm_topk_prob)}

    def transformer_config(self, arch: HFArch) -> dict[str, Any]:
        return {
            **super().transformer_config(arch),
            "num_moe_experts": arch.num_experts,
            "moe_router_topk": arch.experts_per_token,
            "moe_ffn_hidden_size": arch.moe_intermediate_size,
            "moe_router_score_function": "softmax",
            # norm_topk_prob: top-k, then softmax over the chosen logits (= the renormalised top-k of the softmax);
            # else softmax over every expert, then top-k.
            "moe_router_pre_softmax": not arch.norm_topk_prob,
            # The router's gate GEMM and softmax in fp32 (HF takes the softmax in fp32; with bf16 params the gate's
            # logits too: a routing decision is not left to bf16 rounding).
            "moe_router_dtype": "fp32",
            # Dropless: every token reaches its experts (HF drops none).
            "moe_expert_capacity_factor": None,
        }

    def layer_spec(self, arch: HFArch) -> dict[str, Any]:
        # SequentialMLP: one megatron MLP per local expert (the local spec without grouped GEMM).
        return {**super().layer_spec(arch), "num_experts": arch.num_experts, "moe_grouped_gemm": False}
