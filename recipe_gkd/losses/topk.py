"""GKD divergences between the student and the teacher's top-k distribution (pure torch).

The teacher sends, per scored token, its top-k log-probabilities (full-vocabulary
log-probabilities, already divided by the teacher temperature on the server), their token
ids and the log of the mass outside them (the tail, computed by the server from its full
distribution). Both distributions are compared over K + 1 outcomes: the K teacher ids plus
one tail bucket "any other token" (teacher: the server's tail; student: its own mass outside
those ids). The loss is then an exact divergence between two distributions and autograd's
gradient is the true gradient of that divergence.

The teacher's tail is taken as sent (``teacher_tail_logmass``), never rebuilt from the
top-k: with a sharp teacher 1 - sum(float16 top-k probabilities) is rounding noise (off by
more than 1 nat, or clamped), which gives a non-zero loss and gradient at student ==
teacher. Without ``teacher_tail_logmass`` (callers holding only top-k values) the tail is
rebuilt as log(1 - sum p_topk), exact only for exact (float32/64) top-k values.

Teacher ids at or beyond the student's vocabulary (families pad their embedding rows
differently over one tokenizer: Qwen2.5-7B has 152064 rows, Qwen2.5-0.5B 151936) are not
tokens the student can produce: their teacher mass is folded into the tail bucket.

Union support (algorithm.support=union): the columns are the teacher's top-k followed by the
student's own top-k_s ids with the teacher's logprobs at them, and the tail is the teacher's
mass outside both (the server's). A student id already in the teacher's top-k is sent as
``EXCLUDED_ID`` with logprob -inf: a zero-mass outcome on both sides, like a folded id, so the
K + k_s + 1 outcomes partition the vocabulary and each divergence is exact over that partition.

- ``tail=True`` (default): K + 1 outcomes as above. When K == V the tail is empty and is
  dropped, which makes it identical to ``tail=False``.
- ``tail=False``: both distributions are restricted to the teacher's top-k ids and
  renormalised over them (teacher: ``log_softmax(t)`` over the K ids; student:
  ``log_softmax(s[ids] / temperature)`` over the K ids), then compared over K outcomes.
  With K == V this is exactly the full-vocabulary divergence.

Divergences (TRL ``GKDTrainer.generalized_jsd_loss`` convention, T = teacher, S = student):
``forward_kl`` = KL(T||S); ``reverse_kl`` = KL(S||T); ``jsd`` = generalized JSD(beta) =
beta * KL(T||M) + (1 - beta) * KL(S||M) with the mixture M = beta * T + (1 - beta) * S taken
in probability space (computed as a log-sum-exp of log-probabilities). As in TRL, jsd with
beta == 0 is forward KL and beta == 1 is reverse KL exactly; these are the limits of
JSD(beta) / beta and JSD(beta) / (1 - beta), the unnormalised JSD itself tends to 0 there.

The student side (its logits at the teacher ids and the log-sum-exp of the rest, chunked) is
:mod:`recipe_gkd.losses.student_logits`; the input checks are :mod:`recipe_gkd.losses.checks`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from recipe_gkd.losses.checks import (
    Divergence,
    check_data,
    check_divergence_args,
    check_shards_cover,
    check_static_args,
)
from recipe_gkd.losses.student_logits import TopKAndTailLogits, combine_shards, default_chunk_size

# bf16/fp16 teacher log-probs can sum to a top-k mass >= 1 after rounding; the teacher tail
# log-mass is floored here (e^-50 ~ 2e-22) so reverse KL / JSD stay finite.
TEACHER_TAIL_LOGPROB_FLOOR = -50.0
# log1mexp(x) = log(1 - e^x) switches formula at x = -ln 2 (Maechler 2012) for accuracy.
LOG1MEXP_SWITCH = -math.log(2.0)


def gkd_loss(
    student_logits: Tensor,
    teacher_topk_logprobs: Tensor,
    teacher_topk_ids: Tensor,
    loss_mask: Tensor,
    *,
    divergence: Divergence,
    beta: float = 0.5,
    temperature: float = 1.0,
    tail: bool = True,
    teacher_tail_logmass: Tensor | None = None,
    chunk_size: int | None = None,
) -> Tensor:
    """Token-mean GKD loss over ``loss_mask`` (0 if no token is selected, never NaN).

    student_logits [B,T,V] (any float dtype, any strides; math is fp32, or fp64 for fp64
    input), teacher_topk_logprobs [B,T,K], teacher_topk_ids [B,T,K], loss_mask [B,T],
    teacher_tail_logmass [B,T] (optional: the server's log of the mass outside the top-k;
    rebuilt from the top-k when absent). ``temperature`` divides the student logits and must
    be the temperature the teacher scored at (the server applies it to the teacher).
    For a global mean over micro-batches / data-parallel ranks use :func:`gkd_loss_sum`.
    """
    loss_sum, token_count = gkd_loss_sum(
        student_logits,
        teacher_topk_logprobs,
        teacher_topk_ids,
        loss_mask,
        divergence=divergence,
        beta=beta,
        temperature=temperature,
        tail=tail,
        teacher_tail_logmass=teacher_tail_logmass,
        chunk_size=chunk_size,
    )
    return loss_sum / token_count.clamp(min=1)


def gkd_loss_sum(
    student_logits: Tensor,
    teacher_topk_logprobs: Tensor,
    teacher_topk_ids: Tensor,
    loss_mask: Tensor,
    *,
    divergence: Divergence,
    beta: float = 0.5,
    temperature: float = 1.0,
    tail: bool = True,
    teacher_tail_logmass: Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Sum of per-token divergences over ``loss_mask`` and the number of those tokens.

    Divide the sum by the token count all-reduced over micro-batches and data-parallel
    ranks to get the global token mean. Arguments as in :func:`gkd_loss`.
    """
    return _gkd_loss_sum(
        student_logits,
        teacher_topk_logprobs,
        teacher_topk_ids,
        loss_mask,
        divergence=divergence,
        beta=beta,
        temperature=temperature,
        tail=tail,
        teacher_tail_logmass=teacher_tail_logmass,
        chunk_size=chunk_size,
        vocab_start=0,
        vocab_size=student_logits.shape[-1] if student_logits.dim() == 3 else 0,
        group=None,
    )


def vocab_parallel_gkd_loss_sum(
    student_logits_shard: Tensor,
    teacher_topk_logprobs: Tensor,
    teacher_topk_ids: Tensor,
    loss_mask: Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
    divergence: Divergence,
    beta: float = 0.5,
    temperature: float = 1.0,
    tail: bool = True,
    teacher_tail_logmass: Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`gkd_loss_sum` for logits sharded over the vocabulary (Megatron tensor parallel).

    This rank holds student_logits_shard [B,T,v] = logits[..., vocab_start:vocab_start+v];
    the shards of ``group`` tile [0, vocab_size) (Megatron's padded vocabulary). Teacher
    tensors and the mask are replicated. One all-reduce of [M, K + tp_size] numbers per call
    (M = loss tokens); the full logits are never gathered. Every rank returns the same sum,
    and backpropagating it on every rank gives each rank its shard of the true gradient.
    """
    if group is None and not (dist.is_available() and dist.is_initialized()):
        raise ValueError("vocab_parallel_gkd_loss_sum needs an initialised process group")
    check_shards_cover(student_logits_shard, vocab_size, group)
    return _gkd_loss_sum(
        student_logits_shard,
        teacher_topk_logprobs,
        teacher_topk_ids,
        loss_mask,
        divergence=divergence,
        beta=beta,
        temperature=temperature,
        tail=tail,
        teacher_tail_logmass=teacher_tail_logmass,
        chunk_size=chunk_size,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        group=group,
    )


def topk_divergence(
    teacher_logprobs_MJ: Tensor, student_logprobs_MJ: Tensor, *, divergence: Divergence, beta: float
) -> Tensor:
    """Per-row divergence [M] between two normalised distributions given as log-probs [M,J].

    Teacher entries equal to -inf (zero mass) are allowed; student entries must be finite
    where the teacher has mass (otherwise forward KL is +inf, as it should be).
    """
    check_divergence_args(divergence, beta)
    if divergence == "forward_kl" or (divergence == "jsd" and beta == 0.0):
        return _kl(teacher_logprobs_MJ, student_logprobs_MJ)
    if divergence == "reverse_kl" or (divergence == "jsd" and beta == 1.0):
        return _kl(student_logprobs_MJ, teacher_logprobs_MJ)
    mixture_logprobs_MJ = _mixture(teacher_logprobs_MJ, student_logprobs_MJ, beta)
    return beta * _kl(teacher_logprobs_MJ, mixture_logprobs_MJ) + (1.0 - beta) * _kl(
        student_logprobs_MJ, mixture_logprobs_MJ
    )


def _gkd_loss_sum(
    student_logits_BTv: Tensor,
    teacher_logprobs_BTK: Tensor,
    teacher_ids_BTK: Tensor,
    loss_mask_BT: Tensor,
    *,
    divergence: Divergence,
    beta: float,
    temperature: float,
    tail: bool,
    teacher_tail_logmass: Tensor | None,
    chunk_size: int | None,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None,
) -> tuple[Tensor, Tensor]:
    check_static_args(
        student_logits_BTv,
        teacher_logprobs_BTK,
        teacher_ids_BTK,
        loss_mask_BT,
        teacher_tail_logmass,
        divergence=divergence,
        beta=beta,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
    )
    batch, seq, shard_vocab = student_logits_BTv.shape
    top_k = teacher_ids_BTK.shape[-1]
    compute_dtype = torch.float64 if student_logits_BTv.dtype == torch.float64 else torch.float32
    device = student_logits_BTv.device

    # Only loss tokens are ever touched: masked rows get no compute and an exactly-zero grad.
    loss_mask_N = loss_mask_BT.reshape(batch * seq)  # [B,T] -> [N]
    selected_N = loss_mask_N if loss_mask_N.dtype == torch.bool else loss_mask_N != 0
    rows_M = selected_N.nonzero().squeeze(-1).to(device)
    teacher_ids_MK = teacher_ids_BTK.reshape(batch * seq, top_k)[rows_M.to(teacher_ids_BTK.device)]
    teacher_logprobs_MK = teacher_logprobs_BTK.reshape(batch * seq, top_k)[rows_M.to(teacher_logprobs_BTK.device)]
    teacher_tail_M = None
    if teacher_tail_logmass is not None:
        teacher_tail_M = teacher_tail_logmass.reshape(batch * seq)[rows_M.to(teacher_tail_logmass.device)]
    has_folded = check_data(loss_mask_N, teacher_ids_MK, teacher_logprobs_MK, teacher_tail_M, vocab_size)
    teacher_ids_MK = teacher_ids_MK.to(device=device, dtype=torch.int64)
    teacher_logprobs_MK = teacher_logprobs_MK.to(device=device, dtype=compute_dtype)
    if teacher_tail_M is not None:
        teacher_tail_M = teacher_tail_M.to(device=device, dtype=compute_dtype)

    # Ids the student has no row for are folded into the tail (below): they count as "other tokens".
    # Excluded columns (-1) are no outcome at all: zero mass on both sides.
    in_vocab_MK = (teacher_ids_MK >= 0) & (teacher_ids_MK < vocab_size)
    if has_folded and not tail:
        raise ValueError(
            "teacher_topk_ids hold ids beyond the student's vocabulary, which only the tail bucket can take: "
            "set algorithm.tail=true"
        )
    with_tail = tail and (top_k < vocab_size or has_folded)
    local_ids_MK = teacher_ids_MK - vocab_start
    owned_MK = (local_ids_MK >= 0) & (local_ids_MK < shard_vocab) & in_vocab_MK
    # Ids owned by another rank (or by none) point at column 0 and are neutralised by `owned_MK`.
    safe_ids_MK = torch.where(owned_MK, local_ids_MK, 0)
    if chunk_size is None:
        chunk_size = default_chunk_size(shard_vocab)

    student_top_MK, student_tail_M = TopKAndTailLogits.apply(
        student_logits_BTv,
        rows_M // seq,
        rows_M % seq,
        safe_ids_MK,
        owned_MK,
        temperature,
        with_tail,
        chunk_size,
    )
    if group is not None:
        student_top_MK, student_tail_M = combine_shards(student_top_MK, student_tail_M, with_tail, group)

    if with_tail:
        if has_folded:
            # A folded id is an outcome of zero mass on both sides of the top-k; its mass is in the tails.
            student_top_MK = torch.where(in_vocab_MK, student_top_MK, -math.inf)
        # [M,K] + [M,1] -> [M,K+1]; the tail logit is the log-sum-exp of all other logits.
        student_logprobs_MJ = torch.log_softmax(torch.cat([student_top_MK, student_tail_M[:, None]], dim=-1), dim=-1)
        # Rows whose outcomes cover the whole vocabulary have an empty tail (-inf on both sides).
        tail_nonempty_M = in_vocab_MK.sum(dim=-1) < vocab_size
        teacher_logprobs_MJ = _teacher_with_tail(teacher_logprobs_MK, in_vocab_MK, teacher_tail_M, tail_nonempty_M)
    else:
        # The same op renormalises both sides: equal inputs give bitwise-equal log-probs.
        student_logprobs_MJ = torch.log_softmax(student_top_MK, dim=-1)
        teacher_logprobs_MJ = torch.log_softmax(teacher_logprobs_MK, dim=-1)
    per_token_M = topk_divergence(teacher_logprobs_MJ, student_logprobs_MJ, divergence=divergence, beta=beta)
    token_count = torch.tensor(rows_M.numel(), dtype=torch.int64, device=device)
    return per_token_M.sum(), token_count


def _mixture(teacher_logprobs_MJ: Tensor, student_logprobs_MJ: Tensor, beta: float) -> Tensor:
    """log M = log(beta * T + (1 - beta) * S), in probability space.

    Outcomes where both are -inf (folded ids) stay -inf with a zero gradient (logaddexp's own
    gradient is NaN there).
    """
    both_zero_MJ = (teacher_logprobs_MJ == -math.inf) & (student_logprobs_MJ == -math.inf)
    teacher_MJ = torch.where(both_zero_MJ, 0.0, teacher_logprobs_MJ)
    student_MJ = torch.where(both_zero_MJ, 0.0, student_logprobs_MJ)
    mixture_MJ = torch.logaddexp(teacher_MJ + math.log(beta), student_MJ + math.log1p(-beta))
    return torch.where(both_zero_MJ, -math.inf, mixture_MJ)


def _kl(p_logprobs_MJ: Tensor, q_logprobs_MJ: Tensor) -> Tensor:
    """KL(P||Q) per row; outcomes with P == 0 contribute exactly 0 (and no NaN gradient)."""
    has_mass_MJ = p_logprobs_MJ > -math.inf
    p_safe_MJ = torch.where(has_mass_MJ, p_logprobs_MJ, 0.0)
    terms_MJ = p_safe_MJ.exp() * (p_safe_MJ - q_logprobs_MJ)
    return torch.where(has_mass_MJ, terms_MJ, 0.0).sum(dim=-1)


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, accurate on both sides of -ln 2."""
    near_zero = x > LOG1MEXP_SWITCH
    return torch.where(
        near_zero,
        torch.log(-torch.expm1(torch.clamp(x, min=LOG1MEXP_SWITCH))),
        torch.log1p(-torch.exp(torch.clamp(x, max=LOG1MEXP_SWITCH))),
    )


def _teacher_with_tail(
    teacher_logprobs_MK: Tensor, in_vocab_MK: Tensor, sent_tail_M: Tensor | None, tail_nonempty_M: Tensor
) -> Tensor:
    """Teacher log-probs over K + 1 outcomes [M,K+1]: the in-vocabulary top-k, then the tail.

    The tail is the server's (`sent_tail_M`) plus the mass of folded ids; without it,
    log(1 - sum of the in-vocabulary top-k). Rows are renormalised: 16-bit wire values sum to
    1 only within their rounding.
    """
    top_MK = torch.where(in_vocab_MK, teacher_logprobs_MK, -math.inf)
    if sent_tail_M is None:
        top_mass_log_M1 = torch.logsumexp(top_MK, dim=-1, keepdim=True)
        # Quantised top-k mass can exceed 1: rescale it to 1 (a no-op for valid input).
        excess_M1 = top_mass_log_M1.clamp(min=0.0)
        tail_M1 = _log1mexp(top_mass_log_M1 - excess_M1)
        top_MK = top_MK - excess_M1
    else:
        folded_MK = torch.where(in_vocab_MK, -math.inf, teacher_logprobs_MK)
        tail_M1 = torch.logaddexp(sent_tail_M[:, None], torch.logsumexp(folded_MK, dim=-1, keepdim=True))
    # The server's fp32 tail can underflow to -inf: a tiny floor keeps reverse KL / JSD finite.
    tail_M1 = torch.where(tail_nonempty_M[:, None], tail_M1.clamp(min=TEACHER_TAIL_LOGPROB_FLOOR), tail_M1)
    return torch.log_softmax(torch.cat([top_MK, tail_M1], dim=-1), dim=-1)  # [M,K+1]
