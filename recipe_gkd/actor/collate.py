"""Ragged `ScoredSequence`s -> padded, aligned tensors for one micro-batch (no megatron import).

Alignment (see recipe_gkd/batch.py): a sequence is `input_ids[:L]` = prompt + response, and
teacher row j describes token `response_start + j`. The model reads `input_ids[:L-1]`; its
logits at position t predict token t+1, so teacher row j lands at position
`response_start + j - 1`. `loss_mask` marks the positions the loss trains: response tokens the student
sampled, never the prompt, the right padding, or (multi-turn rollouts) a tool's output and the template's turn
markers between turns, which stay in `input_ids` and are attended like any token. Right padding keeps every real
token's logits exact under a plain causal mask (padding only ever comes after the tokens that could see it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from recipe_gkd.batch import ScoredSequence, trained_rows


@dataclass
class MicroBatch:
    input_ids_BT: Tensor  # int64, right-padded with pad_id
    position_ids_BT: Tensor  # int64, 0..T-1 on every row
    teacher_logprobs_BTK: Tensor  # float32, 0 where loss_mask is False
    teacher_ids_BTK: Tensor  # int64, 0 where loss_mask is False
    teacher_tail_BT: Tensor  # float32: the server's log tail mass, 0 where loss_mask is False
    loss_mask_BT: Tensor  # bool: position t predicts a response token the loss trains on (trained_rows)
    num_tokens: int  # loss_mask.sum()
    # The sampled-token objective (algorithm.divergence=sampled_reverse_kl), at the loss positions:
    target_ids_BT: Tensor  # int64: the token at t + 1 (0 elsewhere)
    rollout_logprobs_BT: Tensor  # float32: the engine's logprob of it at sampling; NaN for dataset responses
    teacher_sampled_BT: Tensor  # float32: the teacher's logprob of it (0 elsewhere)
    # bool: False exactly where position t predicts a response token the student did not sample (a tool's output,
    # a turn marker), True elsewhere: all True for single-turn sequences (ScoredSequence.sampled_mask None).
    sampled_mask_BT: Tensor
    # Several teachers: each row's teacher, an index into the names collate was given (per-teacher metrics).
    teacher_index_B: Tensor | None = None  # int64
    # The target kind's payload at the loss positions (recipe_gkd/targets): teacher.output=hidden the teacher's
    # hidden states ([B, T, H] in the wire's bfloat16 / float16, 0 elsewhere); algorithm.cross_tokenizer the spans
    # (int64 [B, T], -1 elsewhere).
    payload: Tensor | None = None

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(
            input_ids_BT=self.input_ids_BT.to(device),
            position_ids_BT=self.position_ids_BT.to(device),
            teacher_logprobs_BTK=self.teacher_logprobs_BTK.to(device),
            teacher_ids_BTK=self.teacher_ids_BTK.to(device),
            teacher_tail_BT=self.teacher_tail_BT.to(device),
            loss_mask_BT=self.loss_mask_BT.to(device),
            num_tokens=self.num_tokens,
            target_ids_BT=self.target_ids_BT.to(device),
            rollout_logprobs_BT=self.rollout_logprobs_BT.to(device),
            teacher_sampled_BT=self.teacher_sampled_BT.to(device),
            sampled_mask_BT=self.sampled_mask_BT.to(device),
            teacher_index_B=None if self.teacher_index_B is None else self.teacher_index_B.to(device),
            payload=None if self.payload is None else self.payload.to(device),
        )


def collate(
    sequences: Sequence[ScoredSequence], pad_id: int, teacher_names: Sequence[str] = (), mask_tool_tokens: bool = True
) -> MicroBatch:
    """Pad `sequences` to one [B, T] batch (T = longest L - 1) with the teacher arrays aligned.

    teacher_names (several teachers): each row's teacher becomes its index in them (teacher_index_B).
    mask_tool_tokens (algorithm.mask_tool_tokens): the loss mask holds the sampled response tokens only; False
    (the ablation) every response token.
    """
    if not sequences:
        raise ValueError("collate needs at least one sequence")
    top_k = _common_top_k(sequences)
    seq_len = max(len(s.input_ids) for s in sequences) - 1
    if seq_len < 1:
        raise ValueError("every sequence has a single token: nothing to predict")
    batch = len(sequences)
    input_ids_BT = np.full((batch, seq_len), pad_id, dtype=np.int64)
    teacher_logprobs_BTK = np.zeros((batch, seq_len, top_k), dtype=np.float32)
    teacher_ids_BTK = np.zeros((batch, seq_len, top_k), dtype=np.int64)
    teacher_tail_BT = np.zeros((batch, seq_len), dtype=np.float32)
    loss_mask_BT = np.zeros((batch, seq_len), dtype=bool)
    target_ids_BT = np.zeros((batch, seq_len), dtype=np.int64)
    rollout_logprobs_BT = np.zeros((batch, seq_len), dtype=np.float32)
    teacher_sampled_BT = np.zeros((batch, seq_len), dtype=np.float32)
    sampled_mask_BT = np.ones((batch, seq_len), dtype=bool)
    rows: list[slice] = []
    for row, seq in enumerate(sequences):
        _check_sequence(seq)
        length = len(seq.input_ids)
        input_ids_BT[row, : length - 1] = seq.input_ids[: length - 1]
        # Position t predicts token t + 1: response tokens rs..L-1 are predicted at rs-1..L-2.
        predicted = slice(seq.response_start - 1, length - 1)
        rows.append(predicted)
        teacher_logprobs_BTK[row, predicted] = seq.teacher_topk_logprobs
        teacher_ids_BTK[row, predicted] = seq.teacher_topk_ids
        teacher_tail_BT[row, predicted] = seq.teacher_tail_logmass
        loss_mask_BT[row, predicted] = trained_rows(seq, mask_tool_tokens)
        sampled_mask_BT[row, predicted] = seq.sampled_rows()
        target_ids_BT[row, predicted] = seq.input_ids[seq.response_start :]
        teacher_sampled_BT[row, predicted] = seq.teacher_sampled_logprob
        # A dataset response has no sampling logprob: NaN, which the sampled-token loss refuses loudly.
        rollout_logprobs_BT[row, predicted] = np.nan if seq.rollout_logprobs is None else seq.rollout_logprobs
    # A fresh writable array (a broadcast view is read-only, which torch.from_numpy warns about).
    position_ids_BT = np.tile(np.arange(seq_len, dtype=np.int64), (batch, 1))
    return MicroBatch(
        input_ids_BT=torch.from_numpy(input_ids_BT),
        position_ids_BT=torch.from_numpy(position_ids_BT),
        teacher_logprobs_BTK=torch.from_numpy(teacher_logprobs_BTK),
        teacher_ids_BTK=torch.from_numpy(teacher_ids_BTK),
        teacher_tail_BT=torch.from_numpy(teacher_tail_BT),
        loss_mask_BT=torch.from_numpy(loss_mask_BT),
        num_tokens=int(loss_mask_BT.sum()),
        target_ids_BT=torch.from_numpy(target_ids_BT),
        rollout_logprobs_BT=torch.from_numpy(rollout_logprobs_BT),
        teacher_sampled_BT=torch.from_numpy(teacher_sampled_BT),
        sampled_mask_BT=torch.from_numpy(sampled_mask_BT),
        teacher_index_B=_teacher_index(sequences, teacher_names),
        payload=_collate_payloads(sequences, rows, seq_len),
    )


@dataclass(frozen=True)
class LazyMicroBatches:
    """A step's micro-batches, each collated and moved to `device` only when the schedule takes it.

    Collating them all first would hold every micro-batch on the device at once (with teacher.output=hidden a
    [B, T, H] tensor each) where the memory plan counts the ones in flight. `shapes` are known without collating.
    """

    groups: list[list[ScoredSequence]]
    pad_id: int
    teacher_names: tuple[str, ...]
    device: torch.device
    mask_tool_tokens: bool = True  # algorithm.mask_tool_tokens (collate)

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """[B, T] of each micro-batch as `collate` pads it."""
        return [(len(g), max(len(s.input_ids) for s in g) - 1) for g in self.groups]

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self) -> Iterator[MicroBatch]:
        for group in self.groups:
            yield collate(group, self.pad_id, self.teacher_names, self.mask_tool_tokens).to(self.device)


def _teacher_index(sequences: Sequence[ScoredSequence], teacher_names: Sequence[str]) -> Tensor | None:
    """Each sequence's teacher as an index into teacher_names (None without names)."""
    if not teacher_names:
        return None
    unknown = sorted({s.teacher for s in sequences} - set(teacher_names))
    if unknown:
        raise ValueError(f"sequences scored by teachers {unknown} outside the run's teachers {list(teacher_names)}")
    index = {name: i for i, name in enumerate(teacher_names)}
    return torch.tensor([index[s.teacher] for s in sequences], dtype=torch.int64)


def split_micro_batches(sequences: Sequence[ScoredSequence], micro_batch_size: int) -> list[list[ScoredSequence]]:
    """Consecutive groups of `micro_batch_size` sequences (the last one may be smaller)."""
    if micro_batch_size < 1:
        raise ValueError(f"actor.micro_batch_size must be >= 1, got {micro_batch_size}")
    return [list(sequences[i : i + micro_batch_size]) for i in range(0, len(sequences), micro_batch_size)]


def split_by_token_budget(sequences: Sequence[ScoredSequence], max_tokens: int) -> list[list[ScoredSequence]]:
    """Groups whose padded size (rows x longest row, as `collate` pads them) stays <= `max_tokens`.

    Sequences are taken longest first, so each group pads to a length close to its own rows'
    and long and short responses cost what they are. A sequence longer than the budget on its
    own is an error (the config check `actor.max_tokens_per_micro_batch` prevents it). The
    loss is a sum over tokens divided by the global token count, so the grouping changes
    neither the loss nor the gradients (up to float summation order).
    """
    if max_tokens < 1:
        raise ValueError(f"actor.max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    by_length = sorted(sequences, key=lambda s: len(s.input_ids), reverse=True)
    groups: list[list[ScoredSequence]] = []
    for seq in by_length:
        padded = len(seq.input_ids) - 1  # collate's row length
        if padded > max_tokens:
            raise ValueError(
                f"sample {seq.sample_id} has {padded} tokens, more than actor.max_tokens_per_micro_batch={max_tokens}"
            )
        # Longest first: the group's first row sets its padded length.
        if groups and (len(groups[-1]) + 1) * (len(groups[-1][0].input_ids) - 1) <= max_tokens:
            groups[-1].append(seq)
        else:
            groups.append([seq])
    return groups


def _common_top_k(sequences: Sequence[ScoredSequence]) -> int:
    top_ks = {s.teacher_topk_ids.shape[-1] for s in sequences if s.teacher_topk_ids.ndim == 2}
    if len(top_ks) != 1:
        raise ValueError(f"sequences disagree on the teacher's top-k width: {sorted(top_ks)} (teacher.top_k)")
    return top_ks.pop()


def _collate_payloads(sequences: Sequence[ScoredSequence], rows: Sequence[slice], seq_len: int) -> Tensor | None:
    """The sequences' target payloads as one tensor, collated by their own kind (None: no sequence has one)."""
    kinds = {type(s.payload) for s in sequences}
    if len(kinds) != 1:
        names = sorted(k.__name__ for k in kinds)
        raise ValueError(f"sequences of one micro-batch carry different target payloads: {names}")
    kind = kinds.pop()
    if kind is type(None):
        return None
    return kind.collate([s.payload for s in sequences], rows, seq_len)


def _check_sequence(seq: ScoredSequence) -> None:
    length = len(seq.input_ids)
    responses = length - seq.response_start
    if not 1 <= seq.response_start <= length:
        raise ValueError(f"sample {seq.sample_id}: response_start={seq.response_start} outside [1, {length}]")
    for name in ("teacher_topk_logprobs", "teacher_topk_ids", "teacher_tail_logmass", "teacher_sampled_logprob"):
        rows = getattr(seq, name).shape[0]
        if rows != responses:
            raise ValueError(
                f"sample {seq.sample_id}: {name} has {rows} rows but the sequence has {responses} response tokens"
            )
    if seq.payload is not None and seq.payload.rows() != responses:
        raise ValueError(
            f"sample {seq.sample_id}: its {type(seq.payload).__name__} payload has {seq.payload.rows()} rows but the "
            f"sequence has {responses} response tokens"
        )
    mask = seq.sampled_mask
    if mask is not None and (mask.ndim != 1 or mask.shape[0] != responses or mask.dtype != np.bool_):
        raise ValueError(
            f"sample {seq.sample_id}: sampled_mask must be bool [{responses}] (one per response token), got "
            f"{mask.dtype} {tuple(mask.shape)}"
        )
    if seq.rollout_logprobs is not None and seq.rollout_logprobs.shape[0] != responses:
        raise ValueError(
            f"sample {seq.sample_id}: rollout_logprobs has {seq.rollout_logprobs.shape[0]} rows but the sequence "
            f"has {responses} response tokens"
        )
