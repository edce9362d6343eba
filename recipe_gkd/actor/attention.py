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

Context parallelism (actor.megatron.cp > 1; recipe_gkd/actor/context_parallel.py): this rank's queries are two
chunks of the sequence (the zigzag split), the keys and values of the whole sequence are all-gathered over the CP
group, and each chunk attends to the keys up to its own last position, causal from the lower right
(torch.nn.attention.bias.causal_lower_right: chunk j's c queries against the (j + 1) c keys before and in it).
megatron-core 0.16.1's local DotProductAttention refuses CP ("only supported by TEDotProductAttention"), and its
TE attention needs Transformer Engine; this one runs on CPU and GPU alike.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from recipe_gkd.actor.context_parallel import gather_sequence, natural_order


class SDPAttention(DotProductAttention):
    """Causal self-attention over [s, b, heads, head_dim] inputs -> [s, b, heads * head_dim] (this TP rank's heads).

    Grouped-query attention is passed to torch as is (`enable_gqa`): keys and values are not
    repeated per query head. The init (head counts per TP rank, softmax scale) is megatron's.
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        # megatron's init asserts context_parallel_size == 1 (its local attention has no CP): it sees a copy at 1.
        at_one = copy.copy(config)
        at_one.context_parallel_size = 1
        super().__init__(at_one, *args, **kwargs)
        self.config = config

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
        if self.config.context_parallel_size > 1:
            return self._context_parallel(query, key, value)
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

    def _context_parallel(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Causal attention of this CP rank's two chunks [s, b, n, d] over the whole sequence's keys and values."""
        group = parallel_state.get_context_parallel_group()
        size, rank = group.size(), group.rank()
        seq, batch = query.shape[0], query.shape[1]
        chunk = seq // 2
        total = seq * size
        order = natural_order(total, size).to(key.device)
        # [size x s, b, g, d] in rank order -> the sequence's order (autograd sends each rank its gradient back).
        key_all, value_all = (gather_sequence(t, group, rank, size).index_select(0, order) for t in (key, value))
        outputs = []
        for part, index in ((query[:chunk], rank), (query[chunk:], 2 * size - 1 - rank)):
            visible = (index + 1) * chunk  # the keys before and in chunk `index`
            q, k, v = (t.permute(1, 2, 0, 3) for t in (part, key_all[:visible], value_all[:visible]))
            grouped = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
            if grouped and q.is_cuda:
                # GPU-only, reasoned: torch's lower-right causal bias reaches the flash and memory-efficient kernels
                # without `enable_gqa` (torch/nn/attention/bias.py CausalBias._dispatch): keys and values per head.
                repeats = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
                k, v = (t.repeat_interleave(repeats, dim=1) for t in (k, v))
                grouped = False
            context = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=lower_right_causal(chunk, visible, q.device), scale=self.softmax_scale,
                enable_gqa=grouped,
            )  # fmt: skip
            outputs.append(context.permute(2, 0, 1, 3))  # [b, n, c, d] -> [c, b, n, d]
        return torch.cat(outputs, dim=0).reshape(seq, batch, self.hidden_size_per_partition)


def lower_right_causal(queries: int, keys: int, device: torch.device) -> Any:
    """The mask of `queries` queries that are the last of `keys` positions: query i sees keys j <= i + keys - queries.

    On CUDA torch's lower-right causal bias (torch.nn.attention.bias.causal_lower_right), which reaches the flash
    and memory-efficient kernels without materialising a [queries, keys] mask (GPU-only, reasoned from
    CausalBias._dispatch); on CPU, where that bias materialises the mask anyway, the boolean mask itself (a plain
    tensor: the bias, a tensor subclass, does not pass through torch dispatch modes).
    """
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(queries, keys)
    rows = torch.arange(queries, device=device)[:, None] + (keys - queries)
    return torch.arange(keys, device=device)[None, :] <= rows


def repeat_kv_for_kernel(query: Tensor) -> bool:
    """Whether grouped keys and values must be repeated per query head to reach a fused CUDA kernel.

    GPU-only, reasoned from torch's sdp dispatch (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp):
    `enable_gqa` is taken by the flash kernel (fp16/bf16 only) and the math kernel; fp32 with
    `enable_gqa` therefore falls back to math, which holds the [b, heads, s, s] scores. Repeated
    keys and values (2 x heads x head_dim per token instead of 2 x groups) let fp32 use the
    memory-efficient kernel. On CPU torch's fused kernel takes GQA in every dtype.
    """
    return query.is_cuda and query.dtype == torch.float32
