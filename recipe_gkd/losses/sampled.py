"""Sampled-token reverse KL (``sampled_reverse_kl_loss_sum``, the on-policy distillation of tinker,
verl, slime): only the teacher's logprob of each token the student sampled is needed. Per
response token x_t, the advantage A_t = log t(x_t) - log s_old(x_t) (s_old: the rollout
engine's logprob at sampling time; no gradient) and the loss is -ratio_t * A_t with the
importance ratio ratio_t = s_theta(x_t) / s_old(x_t), token mean over the global batch. Its
gradient at theta = old is E_s[(log s - log t) grad log s] = grad KL(s || t): a policy-gradient
step on the reverse KL, and the ratio corrects batches sampled with older weights (the
one_step_off / two_step_off schedules). ``ratio_clip`` = eps > 0 takes PPO's clipped surrogate
max(-ratio A, -clip(ratio, 1 - eps, 1 + eps) A).

The student's logprob of the sampled token comes from the chunked Function of
:mod:`recipe_gkd.losses.student_logits` (the token as a top-1 support).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from recipe_gkd.losses.checks import check_sampled_args, check_sampled_data, check_shards_cover
from recipe_gkd.losses.student_logits import TopKAndTailLogits, combine_shards, default_chunk_size
from recipe_gkd.losses.topk import TEACHER_TAIL_LOGPROB_FLOOR


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
    advantage: Tensor | None = None,
    advantage_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, SampledKLStats]:
    """Sum over ``loss_mask`` of the sampled-token reverse-KL surrogate, the token count, and statistics.

    student_logits [B,T,v] (a vocabulary shard [vocab_start, vocab_start + v) of ``group`` under
    tensor parallelism, else the whole vocabulary), target_ids [B,T] (the token sampled at t + 1),
    rollout_logprobs [B,T] (log s_old of it: the sampling engine's, at temperature 1), teacher_logprobs
    [B,T] (log t of it), loss_mask [B,T]. Per token: -ratio * A (PPO-clipped when ratio_clip > 0), see
    the module doc. The student's distribution is the unscaled one (temperature 1), the one the
    engines report their logprobs of. Divide the sum by the global token count for the token mean.
    advantage / advantage_mask [B,T]: where the mask holds, A is `advantage` instead of log t - log s_old
    (algorithm.cross_tokenizer: the token's span's, losses/cross_tokenizer.py `span_advantages`).
    """
    vocab_size = student_logits.shape[-1] if vocab_size is None else vocab_size
    check_sampled_args(student_logits, target_ids, rollout_logprobs, teacher_logprobs, loss_mask, ratio_clip)
    if group is not None:
        check_shards_cover(student_logits, vocab_size, group)
    batch, seq, shard_vocab = student_logits.shape
    compute_dtype = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    device = student_logits.device
    loss_mask_N = loss_mask.reshape(batch * seq)  # [B,T] -> [N]
    rows_M = (loss_mask_N if loss_mask_N.dtype == torch.bool else loss_mask_N != 0).nonzero().squeeze(-1).to(device)
    target_M1 = target_ids.reshape(batch * seq)[rows_M.to(target_ids.device)].to(device, torch.int64)[:, None]
    old_M = rollout_logprobs.reshape(batch * seq)[rows_M.to(rollout_logprobs.device)].to(device, compute_dtype)
    teacher_M = teacher_logprobs.reshape(batch * seq)[rows_M.to(teacher_logprobs.device)].to(device, compute_dtype)
    check_sampled_data(target_M1, old_M, teacher_M, vocab_size)
    # A teacher logprob of -inf (an fp16 underflow) would give an infinite advantage: floored like the tail.
    teacher_M = teacher_M.clamp(min=TEACHER_TAIL_LOGPROB_FLOOR)
    local_M1 = target_M1 - vocab_start
    owned_M1 = (local_M1 >= 0) & (local_M1 < shard_vocab)
    safe_M1 = torch.where(owned_M1, local_M1, 0)
    if chunk_size is None:
        chunk_size = default_chunk_size(shard_vocab)
    # The sampled token as a top-1 "support": its logit and the log-sum-exp of every other logit.
    top_M1, rest_M = TopKAndTailLogits.apply(
        student_logits, rows_M // seq, rows_M % seq, safe_M1, owned_M1, 1.0, True, chunk_size
    )
    if group is not None:
        top_M1, rest_M = combine_shards(top_M1, rest_M, True, group)
    logprob_M = top_M1[:, 0] - torch.logaddexp(top_M1[:, 0], rest_M)  # log s_theta(x_t)
    advantage_M = teacher_M - old_M
    if advantage is not None and advantage_mask is not None:
        given_M = advantage.reshape(batch * seq)[rows_M.to(advantage.device)].to(device, compute_dtype)
        use_M = advantage_mask.reshape(batch * seq)[rows_M.to(advantage_mask.device)].to(device)
        advantage_M = torch.where(use_M, given_M, advantage_M)
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
