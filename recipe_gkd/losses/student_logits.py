"""The student's logits at a set of ids and the log-sum-exp of all its other logits, chunked.

Memory: the student's [B, T, V] logits are never copied or upcast as a whole. A custom
autograd Function walks the loss tokens in chunks (``chunk_size`` tokens, default sized so a
[chunk, V] fp32 buffer is DEFAULT_CHUNK_BYTES) in forward, and again in backward, where it
writes straight into the one [B, T, V] gradient tensor (input dtype). Peak extra memory is
that gradient plus about 1.5 [chunk, V] fp32 buffers for bf16 input (the fp32 buffer and a
bf16 copy of the chunk's rows); nothing [B, T, V]-sized is saved for backward.

Under tensor parallelism each rank computes these over its vocabulary shard and
:func:`combine_shards` adds them up with one all-reduce.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

# Default chunk: tokens per chunk so that one fp32 [chunk, V] buffer takes about this much.
DEFAULT_CHUNK_BYTES = 256 * 2**20
FP32_BYTES = 4


def default_chunk_size(shard_vocab: int) -> int:
    """Tokens per chunk so that one fp32 [chunk, shard_vocab] buffer takes about DEFAULT_CHUNK_BYTES."""
    return max(1, DEFAULT_CHUNK_BYTES // (FP32_BYTES * max(shard_vocab, 1)))


def combine_shards(
    local_top_MK: Tensor, local_tail_M: Tensor, with_tail: bool, group: dist.ProcessGroup
) -> tuple[Tensor, Tensor]:
    """Sum the top-k logits over TP ranks and combine their tail log-sum-exps.

    Each top-k id is owned by exactly one rank (others contribute 0) and each rank writes
    its tail lse into its own column, so one SUM all-reduce is exact and identical on all
    ranks; the tail is then logsumexp over the tp_size columns.
    """
    top_k = local_top_MK.shape[-1]
    if not with_tail:
        return _AllReduceSumIdentityBackward.apply(local_top_MK, group), local_tail_M
    tp_rank = dist.get_rank(group)
    tp_size = dist.get_world_size(group)
    columns_P = torch.arange(tp_size, device=local_tail_M.device)
    tail_columns_MP = torch.where(columns_P == tp_rank, local_tail_M[:, None], 0.0)
    packed_MJ = torch.cat([local_top_MK, tail_columns_MP], dim=-1)  # [M, K + tp_size]
    packed_MJ = _AllReduceSumIdentityBackward.apply(packed_MJ, group)
    top_MK, tail_columns_MP = packed_MJ.split([top_k, tp_size], dim=-1)
    return top_MK, torch.logsumexp(tail_columns_MP, dim=-1)


class _AllReduceSumIdentityBackward(torch.autograd.Function):
    """All-reduce SUM forward, identity backward (Megatron's reduce-from-TP-region).

    Right when everything downstream is computed identically on every rank: the upstream
    gradient is then already the full d loss / d sum on each rank.
    """

    @staticmethod
    def forward(ctx, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
        reduced = tensor.clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
        return reduced

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, None]:
        return grad_output, None


class TopKAndTailLogits(torch.autograd.Function):
    """Student's tempered top-k logits [M,K] and log-sum-exp of all its other logits [M].

    logit_v = student_logits[b, t, v] / temperature. Top-k entries not owned by this vocab
    shard are 0. The tail is logsumexp over this shard's ids minus the owned top-k ids
    (-inf placeholder when ``with_tail`` is False). log_softmax over [top_k, tail] is the
    student's exact K+1 distribution. Backward: d/d logit_v is grad_top_k at the owned
    top-k ids and grad_tail * softmax_over_tail(v) elsewhere; no [B,T,V] fp32 buffer is
    kept, the logits are re-read chunk by chunk.
    """

    @staticmethod
    def forward(
        ctx,
        logits_BTV: Tensor,
        batch_idx_M: Tensor,
        seq_idx_M: Tensor,
        safe_ids_MK: Tensor,
        owned_MK: Tensor,
        temperature: float,
        with_tail: bool,
        chunk_size: int,
    ) -> tuple[Tensor, Tensor]:
        compute_dtype = torch.float64 if logits_BTV.dtype == torch.float64 else torch.float32
        num_tokens = batch_idx_M.numel()
        top_MK = logits_BTV[batch_idx_M[:, None], seq_idx_M[:, None], safe_ids_MK]
        top_MK = top_MK.to(compute_dtype).div_(temperature).masked_fill_(~owned_MK, 0.0)
        tail_M = top_MK.new_full((num_tokens,), -math.inf)
        if with_tail:
            for start in range(0, num_tokens, chunk_size):
                chunk = slice(start, start + chunk_size)
                logits_nV = _tail_logits(
                    logits_BTV,
                    batch_idx_M[chunk],
                    seq_idx_M[chunk],
                    safe_ids_MK[chunk],
                    owned_MK[chunk],
                    temperature,
                    compute_dtype,
                )
                max_n = logits_nV.amax(dim=-1)
                max_n = torch.where(torch.isfinite(max_n), max_n, 0.0)
                # In place: the only [chunk, V] fp32 buffer becomes exp(logit - max).
                sum_exp_n = logits_nV.sub_(max_n[:, None]).exp_().sum(dim=-1)
                tail_M[chunk] = max_n + sum_exp_n.log()
                del logits_nV  # free this chunk's buffer before the next one is allocated
        ctx.save_for_backward(logits_BTV, batch_idx_M, seq_idx_M, safe_ids_MK, owned_MK, tail_M)
        ctx.temperature = temperature
        ctx.with_tail = with_tail
        ctx.chunk_size = chunk_size
        if not with_tail:
            ctx.mark_non_differentiable(tail_M)
        return top_MK, tail_M

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_top_MK: Tensor, grad_tail_M: Tensor) -> tuple[Tensor | None, ...]:
        logits_BTV, batch_idx_M, seq_idx_M, safe_ids_MK, owned_MK, tail_M = ctx.saved_tensors
        temperature: float = ctx.temperature
        compute_dtype = grad_top_MK.dtype
        grad_logits_BTV = torch.zeros_like(logits_BTV)
        grad_top_MK = torch.where(owned_MK, grad_top_MK / temperature, 0.0)
        if not ctx.with_tail:
            # Non-owned ids point at column 0 with a zero grad: accumulate keeps that harmless.
            grad_logits_BTV.index_put_(
                (batch_idx_M[:, None], seq_idx_M[:, None], safe_ids_MK),
                grad_top_MK.to(logits_BTV.dtype),
                accumulate=True,
            )
            return grad_logits_BTV, None, None, None, None, None, None, None
        tail_safe_M = torch.where(torch.isfinite(tail_M), tail_M, 0.0)
        grad_tail_M = grad_tail_M / temperature
        for start in range(0, batch_idx_M.numel(), ctx.chunk_size):
            chunk = slice(start, start + ctx.chunk_size)
            logits_nV = _tail_logits(
                logits_BTV,
                batch_idx_M[chunk],
                seq_idx_M[chunk],
                safe_ids_MK[chunk],
                owned_MK[chunk],
                temperature,
                compute_dtype,
            )
            # d tail / d logit_v = softmax over the tail ids (0 at the -inf top-k ids).
            grad_nV = logits_nV.sub_(tail_safe_M[chunk, None]).exp_()
            grad_nV.mul_(grad_tail_M[chunk, None])
            grad_nV.scatter_add_(-1, safe_ids_MK[chunk], grad_top_MK[chunk])
            grad_logits_BTV.index_put_((batch_idx_M[chunk], seq_idx_M[chunk]), grad_nV.to(logits_BTV.dtype))
            del logits_nV, grad_nV  # free this chunk's buffer before the next one is allocated
        return grad_logits_BTV, None, None, None, None, None, None, None


def _tail_logits(
    logits_BTV: Tensor,
    batch_idx_n: Tensor,
    seq_idx_n: Tensor,
    safe_ids_nK: Tensor,
    owned_nK: Tensor,
    temperature: float,
    compute_dtype: torch.dtype,
) -> Tensor:
    """Tempered logits of n tokens [n,V] in compute dtype, owned top-k ids set to -inf."""
    logits_nV = logits_BTV[batch_idx_n, seq_idx_n].to(compute_dtype).div_(temperature)
    # amin with +inf leaves the column alone, so non-owned ids (pointing at 0) are no-ops.
    fill_nK = torch.where(owned_nK, -math.inf, math.inf).to(compute_dtype)
    return logits_nV.scatter_reduce_(-1, safe_ids_nK, fill_nK, reduce="amin")
