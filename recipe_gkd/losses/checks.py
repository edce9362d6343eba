"""Input checks of the losses: argument shapes and dtypes (no sync), values at the loss tokens (one host sync)."""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch import Tensor

from recipe_gkd.batch import EXCLUDED_ID

Divergence = Literal["forward_kl", "reverse_kl", "jsd"]
DIVERGENCES: tuple[str, ...] = get_args(Divergence)
# A logprob above 0 by more than this is not rounding: the sampled-token inputs are refused.
LOGPROB_SLACK = 1e-3


def check_shards_cover(student_logits_shard: Tensor, vocab_size: int, group: dist.ProcessGroup | None) -> None:
    """The vocabulary shards of `group` add up to `vocab_size` columns (one all-reduce)."""
    covered = torch.tensor([student_logits_shard.shape[-1]], dtype=torch.int64, device=student_logits_shard.device)
    dist.all_reduce(covered, group=group)
    if int(covered.item()) != vocab_size:
        raise ValueError(
            f"vocab shards cover {int(covered.item())} ids over the group, expected vocab_size="
            f"{vocab_size}; pass the padded vocabulary size and this rank's shard of the logits"
        )


def check_sampled_args(
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


def check_sampled_data(target_M1: Tensor, old_M: Tensor, teacher_M: Tensor, vocab_size: int) -> None:
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


def check_divergence_args(divergence: str, beta: float) -> None:
    if divergence not in DIVERGENCES:
        raise ValueError(f"unknown divergence {divergence!r}; expected one of {DIVERGENCES}")
    if not (0.0 <= beta <= 1.0):
        raise ValueError(f"beta must be in [0, 1], got {beta}")


def check_static_args(
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
    check_divergence_args(divergence, beta)
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
    # Union support may send up to K + k_s > V columns (the repeated ones excluded).
    if top_k < 1:
        raise ValueError(f"top-k K={top_k} must be >= 1")
    if not (0 <= vocab_start and vocab_start + shard_vocab <= vocab_size):
        raise ValueError(
            f"vocab shard [{vocab_start}, {vocab_start + shard_vocab}) is outside [0, vocab_size={vocab_size})"
        )


def check_data(
    loss_mask_N: Tensor,
    teacher_ids_MK: Tensor,
    teacher_logprobs_MK: Tensor,
    teacher_tail_M: Tensor | None,
    vocab_size: int,
) -> bool:
    """Value checks on the loss tokens only (masked rows may hold padding), one host sync.

    Returns whether any column is not a student outcome: an id beyond the student's vocabulary
    (to be folded into the tail) or an EXCLUDED_ID column.
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
    excluded_MK = ids_MK == EXCLUDED_ID
    # An excluded column carries no teacher mass (its id is counted in another column).
    bad_excluded = (excluded_MK & (teacher_logprobs_MK.detach().to(ids_MK.device) > -math.inf)).any()
    bad_tail = torch.zeros((), dtype=torch.bool, device=ids_MK.device)
    if teacher_tail_M is not None:
        bad_tail = (torch.isnan(teacher_tail_M) | (teacher_tail_M == math.inf)).any().to(ids_MK.device)
    flags = torch.stack(
        [
            bad_mask.to(ids_MK.device, torch.int64),
            torch.where(excluded_MK, 0, ids_MK).min(),
            ids_MK.max(),
            ((sorted_MK[:, 1:] == sorted_MK[:, :-1]) & (sorted_MK[:, 1:] != EXCLUDED_ID)).any().to(torch.int64),
            (torch.isnan(teacher_logprobs_MK) | (teacher_logprobs_MK == math.inf)).any().to(ids_MK.device, torch.int64),
            bad_tail.to(torch.int64),
            bad_excluded.to(torch.int64),
            excluded_MK.any().to(torch.int64),
        ]
    ).tolist()
    bad_mask_flag, id_min, id_max, has_duplicates, has_nan, has_bad_tail, bad_excl, has_excluded = flags
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
    if bad_excl:
        raise ValueError(f"a teacher column with id {EXCLUDED_ID} (excluded) must have logprob -inf")
    return bool(id_max >= vocab_size or has_excluded)
