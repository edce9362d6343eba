"""Core attention through torch's `scaled_dot_product_attention` for megatron's local layer spec.

megatron-core 0.16.1's local `DotProductAttention` (transformer/dot_product_attention.py)
materialises the [b, heads/tp, s, s] scores and keeps the fp32 softmax output and its bf16 copy
for the backward pass: ~6 * heads/tp * s bytes per token and layer, 29 GiB for a 7B student at
2.5k tokens. `SDPAttention` computes the same causal attention with
`torch.nn.functional.scaled_dot_product_attention`, which on CUDA dispatches to the flash or
memory-efficient kernels (no [s, s] buffer; the backward keeps q, k, v, the output and one
log-sum-exp per row) and on CPU to a fused or math kernel. No parameters: the model's state
dict, the HF conversion and checkpoints are unchanged.

Only what the actor uses is accepted (causal self-attention, no mask tensor, no dropout, no
packed sequences); anything else raises instead of silently computing something different.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor


class SDPAttention(DotProductAttention):
    """Causal self-attention over [s, b, heads, head_dim] inputs -> [s, b, heads * head_dim] (this TP rank's heads).

    Grouped-query attention is passed to torch as is (`enable_gqa`): keys and values are not
    repeated per query head. The init (head counts per TP rank, softmax scale) is megatron's.
    """

    def forward(  # type: ignore[override]
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if attention_mask is not None or mask_type != AttnMaskType.causal:
            raise NotImplementedError(
                f"SDPAttention computes causal attention without a mask tensor (got {mask_type}, "
                f"mask {'given' if attention_mask is not None else 'None'}); set actor.megatron.attention=unfused"
            )
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("SDPAttention takes no attention bias and no packed sequences")
        if self.training and self.attention_dropout.p > 0:
            raise NotImplementedError("SDPAttention runs without attention dropout (the actor sets it to 0)")
        seq, batch = query.shape[0], query.shape[1]
        # [s, b, n, d] -> [b, n, s, d], the layout torch's kernels take.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        grouped = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        if grouped and repeat_kv_for_kernel(q):
            repeats = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            k, v = (t.repeat_interleave(repeats, dim=1) for t in (k, v))  # [b, groups, s, d] -> [b, n, s, d]
            grouped = False
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=grouped
        )
        # [b, n, s, d] -> [s, b, n * d]
        return context.permute(2, 0, 1, 3).reshape(seq, batch, self.hidden_size_per_partition)


def repeat_kv_for_kernel(query: Tensor) -> bool:
    """Whether grouped keys and values must be repeated per query head to reach a fused CUDA kernel.

    GPU-only, reasoned from torch's sdp dispatch (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp):
    `enable_gqa` is taken by the flash kernel (fp16/bf16 only) and the math kernel; fp32 with
    `enable_gqa` therefore falls back to math, which holds the [b, heads, s, s] scores. Repeated
    keys and values (2 x heads x head_dim per token instead of 2 x groups) let fp32 use the
    memory-efficient kernel. On CPU torch's fused kernel takes GQA in every dtype.
    """
    return query.is_cuda and query.dtype == torch.float32
