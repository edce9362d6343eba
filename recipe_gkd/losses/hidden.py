"""Exact full-vocabulary divergences from the teacher's final hidden states and its output head.

The teacher sends, per scored token, its final hidden state h (after its final norm); the actor
holds the teacher's output head W (its rows for this rank's vocabulary shard, like the student's
logits) and computes the teacher's logits h @ W^T itself, chunk by chunk, so forward_kl,
reverse_kl and jsd are exact over the whole vocabulary and no [T, V] fp32 tensor is held whole.

A custom autograd Function walks the loss tokens in chunks of ``chunk_size`` rows. Forward, per
chunk: the tempered student and teacher logits [n, v] (one matmul), their log-sum-exps over the
whole vocabulary (under tensor parallelism one all-reduce of [n, 2 * tp_size] numbers), and the
divergence's per-row sum (one all-reduce of [n, 2]). Backward recomputes each chunk (a second
matmul) and writes the closed-form gradient straight into the one [B, T, v] gradient tensor:
with p = the student's softmax, q = the teacher's, l = their logs, all at temperature tau,

- forward_kl  KL(q||p):  d/dz_v = (p_v - q_v) / tau
- reverse_kl  KL(p||q):  d/dz_v = p_v ((l^p_v - l^q_v) - KL(p||q)) / tau
- jsd(beta)   beta KL(q||m) + (1 - beta) KL(p||m), m = beta q + (1 - beta) p:
              d/dz_v = (1 - beta) p_v ((l^p_v - l^m_v) - KL(p||m)) / tau

(d/dp_v of the jsd is (1 - beta)(l^p_v - l^m_v): the m terms cancel.) As in TRL, jsd with
beta == 0 is forward KL and beta == 1 is reverse KL. Every quantity in the gradient is global
(log-sum-exps and per-row sums all-reduced in forward), so each rank's shard of the gradient
needs no further communication: the upstream gradient of the per-row divergences is the same on
every rank, as with :func:`~recipe_gkd.losses.student_logits.combine_shards`.

Memory: about HIDDEN_CHUNK_BUFFERS fp32 [chunk, v] buffers at once (the default chunk keeps them
at DEFAULT_CHUNK_BYTES in all), plus the [B, T, v] gradient in the logits' dtype. The teacher's
matmul runs in the head's dtype (bf16 on GPU, as the teacher's own output layer does).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from recipe_gkd.losses.checks import Divergence, check_divergence_args
from recipe_gkd.losses.student_logits import DEFAULT_CHUNK_BYTES, FP32_BYTES

# fp32 [chunk, v] buffers live at once in a chunk (student, teacher, their probabilities, one term).
HIDDEN_CHUNK_BUFFERS = 5


def hidden_chunk_size(shard_vocab: int) -> int:
    """Rows per chunk so that HIDDEN_CHUNK_BUFFERS fp32 [chunk, shard_vocab] buffers take DEFAULT_CHUNK_BYTES."""
    return max(1, DEFAULT_CHUNK_BYTES // (HIDDEN_CHUNK_BUFFERS * FP32_BYTES * max(shard_vocab, 1)))


def hidden_gkd_loss_sum(
    student_logits_BTv: Tensor,
    teacher_hidden_BTH: Tensor,
    teacher_head_vH: Tensor,
    loss_mask_BT: Tensor,
    *,
    divergence: Divergence,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, Tensor]:
    """Sum over ``loss_mask`` of the full-vocabulary divergence per token, and the number of those tokens.

    student_logits_BTv [B,T,v]: this rank's vocabulary shard (the whole vocabulary without ``group``);
    teacher_hidden_BTH [B,T,H]: the teacher's final hidden states at the same positions;
    teacher_head_vH [v,H]: the teacher's output-head rows for the same vocabulary ids as the student's
    shard. ``temperature`` divides both sides' logits. Under tensor parallelism every rank of
    ``group`` returns the same sum; backpropagating it gives each rank its shard of the gradient.
    """
    check_divergence_args(divergence, beta)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    batch, seq, shard_vocab = student_logits_BTv.shape
    if teacher_hidden_BTH.shape[:2] != (batch, seq):
        raise ValueError(
            f"teacher hidden states {tuple(teacher_hidden_BTH.shape)} do not match logits [{batch}, {seq}]"
        )
    if teacher_head_vH.shape != (shard_vocab, teacher_hidden_BTH.shape[-1]):
        raise ValueError(
            f"teacher head {tuple(teacher_head_vH.shape)} does not match [vocabulary shard {shard_vocab}, "
            f"hidden {teacher_hidden_BTH.shape[-1]}]"
        )
    if divergence == "jsd" and beta in (0.0, 1.0):
        divergence, beta = ("forward_kl" if beta == 0.0 else "reverse_kl"), 0.5
    device = student_logits_BTv.device
    selected_N = loss_mask_BT.reshape(batch * seq).to(device) != 0  # [B,T] -> [N]
    rows_M = selected_N.nonzero().squeeze(-1)
    hidden_MH = teacher_hidden_BTH.reshape(batch * seq, -1).to(device)[rows_M]  # [B,T,H] -> [N,H] -> [M,H]
    per_token_M = HiddenStateDivergence.apply(
        student_logits_BTv,
        rows_M // seq,
        rows_M % seq,
        hidden_MH,
        teacher_head_vH,
        (divergence, beta, temperature, chunk_size or hidden_chunk_size(shard_vocab), group),
    )
    return per_token_M.sum(), torch.tensor(rows_M.numel(), dtype=torch.int64, device=device)


class HiddenStateDivergence(torch.autograd.Function):
    """Per-token full-vocabulary divergence [M] between the student's logits and the teacher's h @ W^T (module doc)."""

    @staticmethod
    def forward(
        ctx,
        logits_BTv: Tensor,
        batch_idx_M: Tensor,
        seq_idx_M: Tensor,
        hidden_MH: Tensor,
        head_vH: Tensor,
        options: tuple[str, float, float, int, dist.ProcessGroup | None],
    ) -> Tensor:
        divergence, beta, temperature, chunk_size, group = options
        compute_dtype = torch.float64 if logits_BTv.dtype == torch.float64 else torch.float32
        num_tokens = batch_idx_M.numel()
        per_token_M = torch.zeros(num_tokens, dtype=compute_dtype, device=logits_BTv.device)
        # Per row: the student's and teacher's global log-sum-exps and the student-side KL the gradient needs.
        saved_M3 = torch.zeros(num_tokens, 3, dtype=compute_dtype, device=logits_BTv.device)
        for start in range(0, num_tokens, chunk_size):
            chunk = slice(start, start + chunk_size)
            student_nv, teacher_nv = _chunk_logits(
                logits_BTv, batch_idx_M[chunk], seq_idx_M[chunk], hidden_MH[chunk], head_vH, temperature, compute_dtype
            )
            lse_n2 = _global_logsumexp(torch.stack([student_nv.logsumexp(-1), teacher_nv.logsumexp(-1)], -1), group)
            log_p_nv = student_nv.sub_(lse_n2[:, :1])
            log_q_nv = teacher_nv.sub_(lse_n2[:, 1:])
            sums_n2 = _sum_over_vocab(_divergence_terms(log_p_nv, log_q_nv, divergence, beta), group)
            per_token_M[chunk] = sums_n2[:, 0]
            saved_M3[chunk, :2] = lse_n2
            saved_M3[chunk, 2] = sums_n2[:, 1]
            del student_nv, teacher_nv, log_p_nv, log_q_nv  # free this chunk's buffers before the next
        ctx.save_for_backward(logits_BTv, batch_idx_M, seq_idx_M, hidden_MH, head_vH, saved_M3)
        ctx.options = options
        return per_token_M

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_M: Tensor) -> tuple[Tensor | None, ...]:
        logits_BTv, batch_idx_M, seq_idx_M, hidden_MH, head_vH, saved_M3 = ctx.saved_tensors
        divergence, beta, temperature, chunk_size, _ = ctx.options
        compute_dtype = saved_M3.dtype
        grad_logits_BTv = torch.zeros_like(logits_BTv)
        grad_M = grad_M.to(compute_dtype) / temperature
        for start in range(0, batch_idx_M.numel(), chunk_size):
            chunk = slice(start, start + chunk_size)
            student_nv, teacher_nv = _chunk_logits(
                logits_BTv, batch_idx_M[chunk], seq_idx_M[chunk], hidden_MH[chunk], head_vH, temperature, compute_dtype
            )
            log_p_nv = student_nv.sub_(saved_M3[chunk, :1])
            log_q_nv = teacher_nv.sub_(saved_M3[chunk, 1:2])
            grad_nv = _logit_grad(log_p_nv, log_q_nv, saved_M3[chunk, 2], divergence, beta)
            grad_nv.mul_(grad_M[chunk, None])
            grad_logits_BTv.index_put_((batch_idx_M[chunk], seq_idx_M[chunk]), grad_nv.to(logits_BTv.dtype))
            del student_nv, teacher_nv, log_p_nv, log_q_nv, grad_nv
        return grad_logits_BTv, None, None, None, None, None


def _chunk_logits(
    logits_BTv: Tensor,
    batch_idx_n: Tensor,
    seq_idx_n: Tensor,
    hidden_nH: Tensor,
    head_vH: Tensor,
    temperature: float,
    compute_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """The tempered student and teacher logits of n tokens [n, v] in compute dtype."""
    student_nv = logits_BTv[batch_idx_n, seq_idx_n].to(compute_dtype).div_(temperature)
    # The head's dtype: a bf16 head is multiplied in bf16 (fp32 accumulation), as in the teacher's own forward.
    teacher_nv = (hidden_nH.to(head_vH.dtype) @ head_vH.T).to(compute_dtype).div_(temperature)
    return student_nv, teacher_nv


def _global_logsumexp(local_n2: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Per row and side, the log-sum-exp over the whole vocabulary from each rank's [n, 2]."""
    if group is None:
        return local_n2
    tp_rank, tp_size = dist.get_rank(group), dist.get_world_size(group)
    # Each rank writes its log-sum-exps into its own columns: one SUM all-reduce gathers them exactly.
    packed_n2P = local_n2.new_zeros(*local_n2.shape, tp_size)
    packed_n2P[..., tp_rank] = local_n2
    dist.all_reduce(packed_n2P, op=dist.ReduceOp.SUM, group=group)
    return packed_n2P.logsumexp(-1)


def _sum_over_vocab(terms_nv2: tuple[Tensor, Tensor], group: dist.ProcessGroup | None) -> Tensor:
    """The per-row sums [n, 2] of two [n, v] term tensors, over the whole vocabulary."""
    sums_n2 = torch.stack([terms_nv2[0].sum(-1), terms_nv2[1].sum(-1)], -1)
    if group is not None:
        dist.all_reduce(sums_n2, op=dist.ReduceOp.SUM, group=group)
    return sums_n2


def _divergence_terms(log_p_nv: Tensor, log_q_nv: Tensor, divergence: str, beta: float) -> tuple[Tensor, Tensor]:
    """Per-id terms of (the divergence, the student-side KL its gradient needs) [n, v] each."""
    if divergence == "forward_kl":
        terms_nv = log_q_nv.exp() * (log_q_nv - log_p_nv)
        return terms_nv, torch.zeros_like(terms_nv[:, :1]).expand_as(terms_nv)
    if divergence == "reverse_kl":
        terms_nv = log_p_nv.exp() * (log_p_nv - log_q_nv)
        return terms_nv, terms_nv
    log_m_nv = _log_mixture(log_p_nv, log_q_nv, beta)
    student_side_nv = log_p_nv.exp() * (log_p_nv - log_m_nv)
    teacher_side_nv = log_q_nv.exp() * (log_q_nv - log_m_nv)
    return teacher_side_nv.mul_(beta).add_(student_side_nv, alpha=1.0 - beta), student_side_nv


def _logit_grad(log_p_nv: Tensor, log_q_nv: Tensor, student_kl_n: Tensor, divergence: str, beta: float) -> Tensor:
    """d divergence / d tempered student logit [n, v] (the module doc's formulas without the 1 / tau)."""
    if divergence == "forward_kl":
        return log_p_nv.exp().sub_(log_q_nv.exp())
    if divergence == "reverse_kl":
        return (log_p_nv - log_q_nv).sub_(student_kl_n[:, None]).mul_(log_p_nv.exp())
    log_m_nv = _log_mixture(log_p_nv, log_q_nv, beta)
    return (log_p_nv - log_m_nv).sub_(student_kl_n[:, None]).mul_(log_p_nv.exp()).mul_(1.0 - beta)


def _log_mixture(log_p_nv: Tensor, log_q_nv: Tensor, beta: float) -> Tensor:
    """log(beta q + (1 - beta) p), in probability space."""
    return torch.logaddexp(log_q_nv + math.log(beta), log_p_nv + math.log1p(-beta))
