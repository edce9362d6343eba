"""Rows in and out of the actor's probes (`token_logprobs`, `forward_logits`): padded rows packed to start at
position 0 and scattered back, and the forward-only micro-batch that carries them (no teacher fields)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from recipe_gkd.actor.collate import MicroBatch


def pack_rows(ids_BL: np.ndarray, mask_BL: np.ndarray, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's valid tokens (one contiguous run of `mask_BL`) moved to position 0, `pad_id` after.

    Returns the packed ids [B, L] and each row's start and length in the input.
    """
    starts_B, lengths_B = _contiguous_runs(mask_BL)
    batch, length = ids_BL.shape
    packed_BL = np.full((batch, length), pad_id, dtype=np.int64)
    for row in range(batch):
        packed_BL[row, : lengths_B[row]] = ids_BL[row, starts_B[row] : starts_B[row] + lengths_B[row]]
    return packed_BL, starts_B, lengths_B


def unpack_token_logprobs(packed_logprobs_BL: np.ndarray, starts_B: np.ndarray, lengths_B: np.ndarray) -> np.ndarray:
    """Per-token logprobs [B, L-1] of packed rows back at their input positions (0 where t or t+1 is padding)."""
    out_BL = np.zeros(packed_logprobs_BL.shape, dtype=np.float32)
    for row in range(packed_logprobs_BL.shape[0]):
        scored = max(lengths_B[row] - 1, 0)
        out_BL[row, starts_B[row] : starts_B[row] + scored] = packed_logprobs_BL[row, :scored]
    return out_BL


def forward_only_micro_batch(ids_BL: Tensor, device: torch.device) -> MicroBatch:
    """A MicroBatch of unpadded rows from position 0, run forward only for its logits."""
    batch, length = ids_BL.shape
    positions_BL = torch.arange(length, device=device).expand(batch, length)
    return MicroBatch(ids_BL, positions_BL, *_no_teacher(batch, length, device))


def _no_teacher(batch: int, length: int, device: torch.device) -> tuple[Any, ...]:
    """Empty teacher fields of a MicroBatch that is only run forward for its logits (in field order)."""
    return (
        torch.zeros(batch, length, 0, dtype=torch.float32, device=device),
        torch.zeros(batch, length, 0, dtype=torch.int64, device=device),
        torch.zeros(batch, length, dtype=torch.float32, device=device),
        torch.zeros(batch, length, dtype=torch.bool, device=device),
        0,
        torch.zeros(batch, length, dtype=torch.int64, device=device),
        torch.zeros(batch, length, dtype=torch.float32, device=device),
        torch.zeros(batch, length, dtype=torch.float32, device=device),
        torch.ones(batch, length, dtype=torch.bool, device=device),
    )


def _contiguous_runs(mask_BL: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: start and length of its run of True values (which must be contiguous)."""
    lengths_B = mask_BL.sum(axis=1)
    starts_B = np.where(lengths_B > 0, mask_BL.argmax(axis=1), 0)
    for row, (start, count) in enumerate(zip(starts_B, lengths_B, strict=True)):
        if not mask_BL[row, start : start + count].all():
            raise ValueError(f"attention_mask row {row} is not one contiguous run of 1s")
    return starts_B, lengths_B
