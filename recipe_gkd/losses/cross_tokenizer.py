"""Losses against a teacher of another tokenizer, on the spans recipe_gkd/cross_tokenizer aligned.

Inputs per student position t (collated like every teacher array: the logits at t predict token t + 1):
``span_len_BT`` > 0 where a span starts (its student token count), 0 inside it, -1 unaligned or padding;
the teacher's top-k columns, tail and ``teacher_span_BT`` (its log-probability of the span's text) at the
span's first position. Per span, one of:

- **shared** (one student token, one teacher token, some teacher top-k piece is a student piece): the
  configured divergence over the shared pieces + one bucket for the rest (GOLD's per-token term over the
  shared vocabulary, trl/experimental/gold/gold_trainer.py `ULDLoss._compute_hybrid_uld_loss`, here as an
  exact divergence over a partition with the server's exact tail: losses/topk.py with folded ids);
- otherwise, objective ``span``: the divergence between the two models' distributions over the partition
  {this span's text, anything else}, both conditioned on the same text before it: log p(span) is the sum
  of the span's token logprobs on each side (the path probability of the tokenization each side used).
  It is exact for those two numbers and, by the data-processing inequality, a lower bound of the
  divergence between the two next-text distributions; its gradient flows through every student token of
  the span;
- otherwise, objective ``uld``: ULD's distance (Boizard et al., arXiv 2402.12030, eq. 3): the L1 distance
  between the two sorted probability vectors, here the teacher's top-k against the student's top-k, each
  the first token's distribution times the probability of the span's later tokens (GOLD's "observed"
  merge, `_merge_probabilities_with_alignment_groups`).

The sampled-token reverse KL takes each token's advantage from its span (`span_advantages`).

The sum is over spans; divide by the response token count like every loss here (tokens inside a span or
unaligned add nothing). With identical tokenizers every span is shared and one token long: the loss is the
same-tokenizer top-k loss (tests/recipe_gkd/losses/test_cross_tokenizer_loss.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from recipe_gkd.batch import FOLDED_BASE
from recipe_gkd.losses.checks import Divergence
from recipe_gkd.losses.topk import TEACHER_TAIL_LOGPROB_FLOOR, gkd_loss_sum, topk_divergence

OBJECTIVES = ("span", "uld")


def span_sums(values_BT: Tensor, span_len_BT: Tensor) -> Tensor:
    """At each span's first position the sum of `values` over the span's positions; 0 elsewhere."""
    batch, seq = values_BT.shape
    prefix_BT1 = torch.cat([values_BT.new_zeros(batch, 1), values_BT.cumsum(dim=1)], dim=1)  # [B, T+1]
    start_BT = torch.arange(seq, device=values_BT.device).expand(batch, seq)
    end_BT = (start_BT + span_len_BT.clamp(min=0)).clamp(max=seq)
    sums_BT = prefix_BT1.gather(1, end_BT) - prefix_BT1[:, :seq]
    return torch.where(span_len_BT > 0, sums_BT, torch.zeros_like(sums_BT))


def shared_positions(teacher_ids_BTK: Tensor, span_len_BT: Tensor, loss_mask_BT: Tensor) -> Tensor:
    """Where a one-token span has at least one teacher piece the student also has."""
    has_shared_BT = ((teacher_ids_BTK >= 0) & (teacher_ids_BTK < FOLDED_BASE)).any(dim=-1)
    return loss_mask_BT.bool() & (span_len_BT == 1) & has_shared_BT


def cross_tokenizer_loss_sum(
    student_logits_BTV: Tensor,
    target_ids_BT: Tensor,
    teacher_logprobs_BTK: Tensor,
    teacher_ids_BTK: Tensor,
    teacher_tail_BT: Tensor,
    teacher_span_BT: Tensor,
    span_len_BT: Tensor,
    loss_mask_BT: Tensor,
    *,
    objective: str,
    divergence: Divergence,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """The sum over spans of the module doc's per-span terms, and the response token count."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    mask_BT = loss_mask_BT.bool()
    shared_BT = shared_positions(teacher_ids_BTK, span_len_BT, mask_BT)
    first_BT = mask_BT & (span_len_BT > 0) & ~shared_BT
    loss = student_logits_BTV.sum() * 0.0  # keeps the graph (and a zero grad) when no span applies
    if bool(shared_BT.any()):
        loss = (
            loss
            + gkd_loss_sum(
                student_logits_BTV,
                teacher_logprobs_BTK,
                teacher_ids_BTK,
                shared_BT,
                divergence=divergence,
                beta=beta,
                temperature=temperature,
                tail=True,
                teacher_tail_logmass=teacher_tail_BT,
            )[0]
        )
    if bool(first_BT.any()):
        compute = torch.float64 if student_logits_BTV.dtype == torch.float64 else torch.float32
        logprobs_BTV = torch.log_softmax(student_logits_BTV.to(compute) / temperature, dim=-1)
        token_BT = logprobs_BTV.gather(-1, target_ids_BT[..., None]).squeeze(-1)
        in_span_BT = mask_BT & (span_len_BT >= 0)
        span_lp_BT = span_sums(torch.where(in_span_BT, token_BT, torch.zeros_like(token_BT)), span_len_BT)
        if objective == "span":
            teacher_M = teacher_span_BT[first_BT].to(compute)
            loss = (
                loss
                + topk_divergence(
                    _two_outcomes(teacher_M), _two_outcomes(span_lp_BT[first_BT]), divergence=divergence, beta=beta
                ).sum()
            )
        else:
            later_M = (span_lp_BT - token_BT)[first_BT]  # log-probability of the span's later tokens
            merged_MV = logprobs_BTV[first_BT] + later_M[:, None]
            loss = loss + uld_distance(merged_MV, teacher_logprobs_BTK[first_BT].to(compute)).sum()
    return loss, mask_BT.sum()


def _two_outcomes(span_logprob_M: Tensor) -> Tensor:
    """[M, 2] log-probabilities of {the span's text, anything else} (16-bit wire values can exceed 0: clamped)."""
    span_M = span_logprob_M.clamp(max=0.0)
    rest_M = torch.log(-torch.expm1(span_M.clamp(max=-1e-12))).clamp(min=TEACHER_TAIL_LOGPROB_FLOOR)
    return torch.log_softmax(torch.stack([span_M, rest_M], dim=-1), dim=-1)


def uld_distance(student_logprobs_MV: Tensor, teacher_topk_logprobs_MK: Tensor) -> Tensor:
    """Per row, sum |sorted student probs - sorted teacher probs| over the teacher's K columns.

    ULD sorts both full distributions and pads the shorter vocabulary with zeros; the teacher's reply holds
    its top-k only, so both sides are cut to their K largest (a teacher column at -inf is a zero).
    """
    k = teacher_topk_logprobs_MK.shape[-1]
    student_MK = student_logprobs_MV.topk(min(k, student_logprobs_MV.shape[-1]), dim=-1).values.exp()
    if student_MK.shape[-1] < k:
        student_MK = torch.nn.functional.pad(student_MK, (0, k - student_MK.shape[-1]))
    teacher_MK = torch.where(
        teacher_topk_logprobs_MK > -math.inf, teacher_topk_logprobs_MK.exp(), torch.zeros_like(teacher_topk_logprobs_MK)
    )
    teacher_MK = teacher_MK.sort(dim=-1, descending=True).values
    return (student_MK - teacher_MK).abs().sum(dim=-1)


def span_advantages(
    teacher_span_BT: Tensor, rollout_logprobs_BT: Tensor, span_len_BT: Tensor, loss_mask_BT: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The sampled-token reverse KL across tokenizers: each student token's advantage is its span's,
    log t(span) - log s_old(span). Returns (advantage, where to use it, loss mask) for
    sampled_reverse_kl_loss_sum's `advantage` / `advantage_mask`: tokens of multi-token spans take the span's;
    one-token spans keep the loss's own log t - log s_old (bit for bit the same-tokenizer step); unaligned
    tokens leave the mask. A dataset response's NaN rollout logprobs stay NaN (that loss refuses them)."""
    batch, seq = span_len_BT.shape
    positions_BT = torch.arange(seq, device=span_len_BT.device).expand(batch, seq)
    first_BT = torch.cummax(torch.where(span_len_BT > 0, positions_BT, -1), dim=1).values
    inside_BT = (span_len_BT >= 0) & (first_BT >= 0) & loss_mask_BT.bool()
    rollout_sum_BT = span_sums(torch.where(inside_BT, rollout_logprobs_BT, 0.0), span_len_BT)
    advantage_BT = (teacher_span_BT - rollout_sum_BT).gather(1, first_BT.clamp(min=0))
    length_BT = span_len_BT.gather(1, first_BT.clamp(min=0))
    return advantage_BT, inside_BT & (length_BT > 1), inside_BT
