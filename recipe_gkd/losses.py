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

Sampled-token reverse KL (``sampled_reverse_kl_loss_sum``, the on-policy distillation of tinker,
verl, slime): only the teacher's logprob of each token the student sampled is needed. Per
response token x_t, the advantage A_t = log t(x_t) - log s_old(x_t) (s_old: the rollout
engine's logprob at sampling time; no gradient) and the loss is -ratio_t * A_t with the
importance ratio ratio_t = s_theta(x_t) / s_old(x_t), token mean over the global batch. Its
gradient at theta = old is E_s[(log s - log t) grad log s] = grad KL(s || t): a policy-gradient
step on the reverse KL, and the ratio corrects batches sampled with older weights (the
one_step_off / two_step_off schedules). ``ratio_clip`` = eps > 0 takes PPO's clipped surrogate
max(-ratio A, -clip(ratio, 1 - eps, 1 + eps) A).

Memory: the student's [B, T, V] logits are never copied or upcast as a whole. A custom
autograd Function walks the loss tokens in chunks (``chunk_size`` tokens, default sized so a
[chunk, V] fp32 buffer is DEFAULT_CHUNK_BYTES) in forward, and again in backward, where it
writes straight into the one [B, T, V] gradient tensor (input dtype). Peak extra memory is
that gradient plus about 1.5 [chunk, V] fp32 buffers for bf16 input (the fp32 buffer and a
bf16 copy of the chunk's rows); nothing [B, T, V]-sized is saved for backward.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, get_args

import torch
import torch.distributed as dist
from torch import Tensor

Divergence = Literal["forward_kl", "reverse_kl", "jsd"]
DIVERGENCES: tuple[str, ...] = get_args(Divergence)

# Default chunk: tokens per chunk so that one fp32 [chunk, V] buffer takes about this much.
DEFAULT_CHUNK_BYTES = 256 * 2**20
FP32_BYTES = 4
# bf16/fp16 teacher log-probs can sum to a top-k mass >= 1 after rounding; the teacher tail
# log-mass is floored here (e^-50 ~ 2e-22) so reverse KL / JSD stay finite.
TEACHER_TAIL_LOGPROB_FLOOR = -50.0
# log1mexp(x) = log(1 - e^x) switches formula at x = -ln 2 (Maechler 2012) for accuracy.
LOG1MEXP_SWITCH = -math.log(2.0)
# A logprob above 0 by more than this is not rounding: the sampled-token inputs are refused.
LOGPROB_SLACK = 1e-3


# ----------------------------------------------------------------------------- public API


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
    _check_shards_cover(student_logits_shard, vocab_size, group)
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
    _check_divergence_args(divergence, beta)
    if divergence == "forward_kl" or (divergence == "jsd" and beta == 0.0):
        return _kl(teacher_logprobs_MJ, student_logprobs_MJ)
    if divergence == "reverse_kl" or (divergence == "jsd" and beta == 1.0):
        return _kl(student_logprobs_MJ, teacher_logprobs_MJ)
    mixture_logprobs_MJ = _mixture(teacher_logprobs_MJ, student_logprobs_MJ, beta)
    return beta * _kl(teacher_logprobs_MJ, mixture_logprobs_MJ) + (1.0 - beta) * _kl(
        student_logprobs_MJ, mixture_logprobs_MJ
    )


class SampledKLStats(NamedTuple):
    """Detached sums and extremes over the loss tokens of a sampled-token reverse-KL call (float64)."""

    advantage_sum: Tensor  # sum of A_t = log t(x_t) - log s_old(x_t)
    ratio_sum: Tensor  # sum of s_theta(x_t) / s_old(x_t)
    clipped: Tensor  # tokens whose clipped branch is active (zero gradient)
    ratio_max: Tensor  # -inf without tokens
    ratio_min: Tensor  # +inf without tokens


def sampled_reverse_kl_loss_sum(
    student_logits: Tensor,
    target_ids: Tensor,
    rollout_logprobs: Tensor,
    teacher_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    ratio_clip: float = 0.0,
    chunk_size: int | None = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, Tensor, SampledKLStats]:
    """Sum over ``loss_mask`` of the sampled-token reverse-KL surrogate, the token count, and statistics.

    student_logits [B,T,v] (a vocabulary shard [vocab_start, vocab_start + v) of ``group`` under
    tensor parallelism, else the whole vocabulary), target_ids [B,T] (the token sampled at t + 1),
    rollout_logprobs [B,T] (log s_old of it: the sampling engine's, at temperature 1), teacher_logprobs
    [B,T] (log t of it), loss_mask [B,T]. Per token: -ratio * A (PPO-clipped when ratio_clip > 0), see
    the module doc. The student's distribution is the unscaled one (temperature 1), the one the
    engines report their logprobs of. Divide the sum by the global token count for the token mean.
    """
    vocab_size = student_logits.shape[-1] if vocab_size is None else vocab_size
    _check_sampled_args(student_logits, target_ids, rollout_logprobs, teacher_logprobs, loss_mask, ratio_clip)
    if group is not None:
        _check_shards_cover(student_logits, vocab_size, group)
    batch, seq, shard_vocab = student_logits.shape
    compute_dtype = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    device = student_logits.device
    loss_mask_N = loss_mask.reshape(batch * seq)  # [B,T] -> [N]
    rows_M = (loss_mask_N if loss_mask_N.dtype == torch.bool else loss_mask_N != 0).nonzero().squeeze(-1).to(device)
    target_M1 = target_ids.reshape(batch * seq)[rows_M.to(target_ids.device)].to(device, torch.int64)[:, None]
    old_M = rollout_logprobs.reshape(batch * seq)[rows_M.to(rollout_logprobs.device)].to(device, compute_dtype)
    teacher_M = teacher_logprobs.reshape(batch * seq)[rows_M.to(teacher_logprobs.device)].to(device, compute_dtype)
    _check_sampled_data(target_M1, old_M, teacher_M, vocab_size)
    # A teacher logprob of -inf (an fp16 underflow) would give an infinite advantage: floored like the tail.
    teacher_M = teacher_M.clamp(min=TEACHER_TAIL_LOGPROB_FLOOR)
    local_M1 = target_M1 - vocab_start
    owned_M1 = (local_M1 >= 0) & (local_M1 < shard_vocab)
    safe_M1 = torch.where(owned_M1, local_M1, 0)
    if chunk_size is None:
        chunk_size = max(1, DEFAULT_CHUNK_BYTES // (FP32_BYTES * max(shard_vocab, 1)))
    # The sampled token as a top-1 "support": its logit and the log-sum-exp of every other logit.
    top_M1, rest_M = _TopKAndTailLogits.apply(
        student_logits, rows_M // seq, rows_M % seq, safe_M1, owned_M1, 1.0, True, chunk_size
    )
    if group is not None:
        top_M1, rest_M = _combine_shards(top_M1, rest_M, True, group)
    logprob_M = top_M1[:, 0] - torch.logaddexp(top_M1[:, 0], rest_M)  # log s_theta(x_t)
    advantage_M = teacher_M - old_M
    ratio_M = torch.exp(logprob_M - old_M)
    per_token_M = -ratio_M * advantage_M
    clipped_M = torch.zeros_like(per_token_M, dtype=torch.bool)
    if ratio_clip > 0.0:
        clipped_term_M = -torch.clamp(ratio_M, 1.0 - ratio_clip, 1.0 + ratio_clip) * advantage_M
        clipped_M = clipped_term_M > per_token_M
        per_token_M = torch.maximum(per_token_M, clipped_term_M)
    ratio_d = ratio_M.detach().double()
    stats = SampledKLStats(
        advantage_sum=advantage_M.double().sum(),
        ratio_sum=ratio_d.sum(),
        clipped=clipped_M.double().sum(),
        ratio_max=ratio_d.max() if ratio_d.numel() else ratio_d.new_tensor(-math.inf),
        ratio_min=ratio_d.min() if ratio_d.numel() else ratio_d.new_tensor(math.inf),
    )
    token_count = torch.tensor(rows_M.numel(), dtype=torch.int64, device=device)
    return per_token_M.sum(), token_count, stats


# ----------------------------------------------------------------------------- internals


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
    _check_static_args(
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
    has_folded = _check_data(loss_mask_N, teacher_ids_MK, teacher_logprobs_MK, teacher_tail_M, vocab_size)
    teacher_ids_MK = teacher_ids_MK.to(device=device, dtype=torch.int64)
    teacher_logprobs_MK = teacher_logprobs_MK.to(device=device, dtype=compute_dtype)
    if teacher_tail_M is not None:
        teacher_tail_M = teacher_tail_M.to(device=device, dtype=compute_dtype)

    # Ids the student has no row for are folded into the tail (below): they count as "other tokens".
    in_vocab_MK = teacher_ids_MK < vocab_size
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
        chunk_size = max(1, DEFAULT_CHUNK_BYTES // (FP32_BYTES * max(shard_vocab, 1)))

    student_top_MK, student_tail_M = _TopKAndTailLogits.apply(
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
        student_top_MK, student_tail_M = _combine_shards(student_top_MK, student_tail_M, with_tail, group)

    if with_tail:
        if has_folded:
            # A folded id is an outcome of zero mass on both sides of the top-k; its mass is in the tails.
            student_top_MK = torch.where(in_vocab_MK, student_top_MK, -math.inf)
        # [M,K] + [M,1] -> [M,K+1]; the tail logit is the log-sum-exp of all other logits.
        student_logprobs_MJ = torch.log_softmax(torch.cat([student_top_MK, student_tail_M[:, None]], dim=-1), dim=-1)
        teacher_logprobs_MJ = _teacher_with_tail(teacher_logprobs_MK, in_vocab_MK, teacher_tail_M, top_k < vocab_size)
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
    teacher_logprobs_MK: Tensor, in_vocab_MK: Tensor, sent_tail_M: Tensor | None, tail_nonempty: bool
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
    if tail_nonempty:
        # The server's fp32 tail can underflow to -inf: a tiny floor keeps reverse KL / JSD finite.
        tail_M1 = tail_M1.clamp(min=TEACHER_TAIL_LOGPROB_FLOOR)
    return torch.log_softmax(torch.cat([top_MK, tail_M1], dim=-1), dim=-1)  # [M,K+1]


def _combine_shards(
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


class _TopKAndTailLogits(torch.autograd.Function):
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


# ----------------------------------------------------------------------------- validation


def _check_shards_cover(student_logits_shard: Tensor, vocab_size: int, group: dist.ProcessGroup | None) -> None:
    """The vocabulary shards of `group` add up to `vocab_size` columns (one all-reduce)."""
    covered = torch.tensor([student_logits_shard.shape[-1]], dtype=torch.int64, device=student_logits_shard.device)
    dist.all_reduce(covered, group=group)
    if int(covered.item()) != vocab_size:
        raise ValueError(
            f"vocab shards cover {int(covered.item())} ids over the group, expected vocab_size="
            f"{vocab_size}; pass the padded vocabulary size and this rank's shard of the logits"
        )


def _check_sampled_args(
    student_logits_BTv: Tensor,
    target_ids_BT: Tensor,
    rollout_logprobs_BT: Tensor,
    teacher_logprobs_BT: Tensor,
    loss_mask_BT: Tensor,
    ratio_clip: float,
) -> None:
    if student_logits_BTv.dim() != 3 or not student_logits_BTv.is_floating_point():
        raise ValueError(
            f"student_logits must be a float tensor [B,T,V], got {student_logits_BTv.dtype} {tuple(student_logits_BTv.shape)}"
        )
    shape = tuple(student_logits_BTv.shape[:2])
    for name, tensor in (
        ("target_ids", target_ids_BT),
        ("rollout_logprobs", rollout_logprobs_BT),
        ("teacher_logprobs", teacher_logprobs_BT),
        ("loss_mask", loss_mask_BT),
    ):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must be [B,T] = {list(shape)} like the student logits, got {tuple(tensor.shape)}")
    if target_ids_BT.is_floating_point() or target_ids_BT.dtype == torch.bool:
        raise ValueError(f"target_ids must be an integer tensor, got {target_ids_BT.dtype}")
    if not (rollout_logprobs_BT.is_floating_point() and teacher_logprobs_BT.is_floating_point()):
        raise ValueError("rollout_logprobs and teacher_logprobs must be float tensors")
    if not (math.isfinite(ratio_clip) and 0.0 <= ratio_clip < 1.0):
        raise ValueError(f"ratio_clip must be in [0, 1) (0: no clipping), got {ratio_clip}")


def _check_sampled_data(target_M1: Tensor, old_M: Tensor, teacher_M: Tensor, vocab_size: int) -> None:
    """Value checks on the loss tokens only, one host sync."""
    if target_M1.numel() == 0:
        return
    flags = torch.stack(
        [
            target_M1.min().double(),
            target_M1.max().double(),
            (~torch.isfinite(old_M) | (old_M > LOGPROB_SLACK)).any().double(),
            (torch.isnan(teacher_M) | (teacher_M > LOGPROB_SLACK)).any().double(),
        ]
    ).tolist()
    id_min, id_max, bad_old, bad_teacher = flags
    if id_min < 0 or id_max >= vocab_size:
        raise ValueError(
            f"target_ids hold ids outside [0, {vocab_size}) at loss positions: [{id_min:.0f}, {id_max:.0f}]"
        )
    if bad_old:
        raise ValueError("rollout_logprobs hold a non-finite or positive value at a loss position")
    if bad_teacher:
        raise ValueError("teacher_logprobs hold NaN or a positive value at a loss position")


def _check_divergence_args(divergence: str, beta: float) -> None:
    if divergence not in DIVERGENCES:
        raise ValueError(f"unknown divergence {divergence!r}; expected one of {DIVERGENCES}")
    if not (0.0 <= beta <= 1.0):
        raise ValueError(f"beta must be in [0, 1], got {beta}")


def _check_static_args(
    student_logits_BTv: Tensor,
    teacher_logprobs_BTK: Tensor,
    teacher_ids_BTK: Tensor,
    loss_mask_BT: Tensor,
    teacher_tail_BT: Tensor | None,
    *,
    divergence: str,
    beta: float,
    temperature: float,
    chunk_size: int | None,
    vocab_start: int,
    vocab_size: int,
) -> None:
    _check_divergence_args(divergence, beta)
    if not (math.isfinite(temperature) and temperature > 0.0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (tokens per chunk) or None, got {chunk_size}")
    if student_logits_BTv.dim() != 3 or not student_logits_BTv.is_floating_point():
        raise ValueError(
            "student_logits must be a float tensor [B,T,V], got "
            f"{student_logits_BTv.dtype} {tuple(student_logits_BTv.shape)}"
        )
    batch, seq, shard_vocab = student_logits_BTv.shape
    if teacher_logprobs_BTK.dim() != 3 or teacher_logprobs_BTK.shape[:2] != (batch, seq):
        raise ValueError(
            f"teacher_topk_logprobs must be [B,T,K] with B,T = {batch},{seq} as the student "
            f"logits, got {tuple(teacher_logprobs_BTK.shape)}"
        )
    if teacher_ids_BTK.shape != teacher_logprobs_BTK.shape:
        raise ValueError(
            f"teacher_topk_ids {tuple(teacher_ids_BTK.shape)} must have the shape of "
            f"teacher_topk_logprobs {tuple(teacher_logprobs_BTK.shape)}"
        )
    if not teacher_logprobs_BTK.is_floating_point():
        raise ValueError(f"teacher_topk_logprobs must be float, got {teacher_logprobs_BTK.dtype}")
    if teacher_ids_BTK.is_floating_point() or teacher_ids_BTK.dtype == torch.bool:
        raise ValueError(f"teacher_topk_ids must be an integer tensor, got {teacher_ids_BTK.dtype}")
    if loss_mask_BT.shape != (batch, seq):
        raise ValueError(f"loss_mask must be [B,T] = [{batch},{seq}], got {tuple(loss_mask_BT.shape)}")
    if teacher_tail_BT is not None and (
        teacher_tail_BT.shape != (batch, seq) or not teacher_tail_BT.is_floating_point()
    ):
        raise ValueError(
            f"teacher_tail_logmass must be a float tensor [B,T] = [{batch},{seq}], got "
            f"{teacher_tail_BT.dtype} {tuple(teacher_tail_BT.shape)}"
        )
    top_k = teacher_ids_BTK.shape[-1]
    if not (1 <= top_k <= vocab_size):
        raise ValueError(f"top-k K={top_k} must be in [1, V={vocab_size}]")
    if not (0 <= vocab_start and vocab_start + shard_vocab <= vocab_size):
        raise ValueError(
            f"vocab shard [{vocab_start}, {vocab_start + shard_vocab}) is outside [0, vocab_size={vocab_size})"
        )


def _check_data(
    loss_mask_N: Tensor,
    teacher_ids_MK: Tensor,
    teacher_logprobs_MK: Tensor,
    teacher_tail_M: Tensor | None,
    vocab_size: int,
) -> bool:
    """Value checks on the loss tokens only (masked rows may hold padding), one host sync.

    Returns whether any teacher id lies beyond the student's vocabulary (to be folded).
    """
    if loss_mask_N.dtype == torch.bool:
        bad_mask = torch.zeros((), dtype=torch.bool, device=loss_mask_N.device)
    else:
        bad_mask = ((loss_mask_N != 0) & (loss_mask_N != 1)).any()
    if teacher_ids_MK.numel() == 0:
        if bool(bad_mask):
            raise ValueError("loss_mask must be bool or hold only 0 and 1")
        return False
    ids_MK = teacher_ids_MK.detach().to(torch.int64)
    sorted_MK = ids_MK.sort(dim=-1).values
    bad_tail = torch.zeros((), dtype=torch.bool, device=ids_MK.device)
    if teacher_tail_M is not None:
        bad_tail = (torch.isnan(teacher_tail_M) | (teacher_tail_M == math.inf)).any().to(ids_MK.device)
    flags = torch.stack(
        [
            bad_mask.to(ids_MK.device, torch.int64),
            ids_MK.min(),
            ids_MK.max(),
            (sorted_MK[:, 1:] == sorted_MK[:, :-1]).any().to(torch.int64),
            (torch.isnan(teacher_logprobs_MK) | (teacher_logprobs_MK == math.inf)).any().to(ids_MK.device, torch.int64),
            bad_tail.to(torch.int64),
        ]
    ).tolist()
    bad_mask_flag, id_min, id_max, has_duplicates, has_nan, has_bad_tail = flags
    if bad_mask_flag:
        raise ValueError("loss_mask must be bool or hold only 0 and 1")
    if id_min < 0:
        raise ValueError(f"teacher_topk_ids hold a negative id ({id_min}) at a loss position")
    if has_duplicates:
        raise ValueError("teacher_topk_ids repeat an id within one position's top-k")
    if has_nan:
        raise ValueError("teacher_topk_logprobs hold NaN or +inf at loss positions")
    if has_bad_tail:
        raise ValueError("teacher_tail_logmass holds NaN or +inf at loss positions")
    return bool(id_max >= vocab_size)
