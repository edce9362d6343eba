"""Ragged sequences -> aligned micro-batches (recipe_gkd.actor.collate)."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

from recipe_gkd.actor.collate import LazyMicroBatches, collate, split_by_token_budget, split_micro_batches
from recipe_gkd.batch import ScoredSequence
from recipe_gkd.targets.hidden import HiddenStates

PAD = 0


def sequence(sample_id: int, length: int, response_start: int, top_k: int = 3) -> ScoredSequence:
    rng = np.random.default_rng(sample_id)
    responses = length - response_start
    return ScoredSequence(
        sample_id=sample_id,
        input_ids=rng.integers(1, 50, length).astype(np.int32),
        response_start=response_start,
        on_policy=True,
        teacher_topk_logprobs=-rng.random((responses, top_k)).astype(np.float32),
        teacher_topk_ids=rng.integers(0, 50, (responses, top_k)).astype(np.int32),
        teacher_tail_logmass=-1.0 - rng.random(responses).astype(np.float32),
        teacher_sampled_logprob=-rng.random(responses).astype(np.float32),
    )


def test_teacher_row_j_lands_where_the_student_predicts_token_response_start_plus_j() -> None:
    seqs = [sequence(0, length=7, response_start=3), sequence(1, length=4, response_start=1)]
    batch = collate(seqs, PAD)
    assert batch.input_ids_BT.shape == (2, 6)  # longest L - 1: the last token predicts nothing
    assert batch.num_tokens == 4 + 3
    for row, seq in enumerate(seqs):
        length, start = len(seq.input_ids), seq.response_start
        assert batch.input_ids_BT[row, : length - 1].tolist() == seq.input_ids[:-1].tolist()
        assert (batch.input_ids_BT[row, length - 1 :] == PAD).all()
        mask = batch.loss_mask_BT[row]
        assert mask.nonzero().squeeze(-1).tolist() == list(range(start - 1, length - 1))
        for j in range(length - start):
            t = start + j - 1  # position t predicts token t + 1 = response_start + j
            assert torch.equal(batch.teacher_ids_BTK[row, t], torch.from_numpy(seq.teacher_topk_ids[j]).long())
            assert torch.equal(batch.teacher_logprobs_BTK[row, t], torch.from_numpy(seq.teacher_topk_logprobs[j]))
            assert batch.teacher_tail_BT[row, t].item() == float(seq.teacher_tail_logmass[j])
    assert (batch.teacher_tail_BT[~batch.loss_mask_BT] == 0).all()
    assert batch.position_ids_BT[1].tolist() == list(range(6))


def test_prompt_and_padding_never_carry_loss() -> None:
    batch = collate([sequence(2, length=9, response_start=6), sequence(3, length=3, response_start=2)], PAD)
    assert batch.loss_mask_BT.tolist() == [
        [False] * 5 + [True] * 3,
        [False, True] + [False] * 6,
    ]


def test_inconsistent_teacher_rows_and_top_k_are_refused() -> None:
    bad = sequence(4, length=6, response_start=2)
    bad.teacher_topk_ids = bad.teacher_topk_ids[:-1]
    with pytest.raises(ValueError, match="response tokens"):
        collate([bad], PAD)
    no_tail = sequence(4, length=6, response_start=2)
    no_tail.teacher_tail_logmass = no_tail.teacher_tail_logmass[:-1]
    with pytest.raises(ValueError, match="teacher_tail_logmass has 3 rows"):
        collate([no_tail], PAD)
    with pytest.raises(ValueError, match=r"teacher\.top_k"):
        collate([sequence(5, 6, 2, top_k=3), sequence(6, 6, 2, top_k=4)], PAD)


def test_micro_batches_keep_order_and_the_remainder() -> None:
    seqs = [sequence(i, 5, 2) for i in range(7)]
    groups = split_micro_batches(seqs, 3)
    assert [[s.sample_id for s in g] for g in groups] == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError, match=r"actor\.micro_batch_size"):
        split_micro_batches(seqs, 0)


def test_token_budget_groups_every_sequence_once_within_the_budget() -> None:
    lengths = [30, 5, 12, 9, 30, 7, 21, 6, 6, 16]
    seqs = [sequence(i, length=n, response_start=2) for i, n in enumerate(lengths)]
    groups = split_by_token_budget(seqs, max_tokens=40)
    assert sorted(s.sample_id for g in groups for s in g) == list(range(len(seqs)))
    padded = [collate(g, PAD).input_ids_BT.numel() for g in groups]
    assert all(p <= 40 for p in padded), padded
    # Longest first (rows of 29, 29, 20, 15, 11, 8, 6, 5, 5, 4): the two 29s cannot share (2 x 29 > 40),
    # 20 + 15 pad to 2 x 20, then 11 + 8 + 6 to 3 x 11 and 5 + 5 + 4 to 3 x 5.
    assert [len(g) for g in groups] == [1, 1, 2, 3, 3]
    # Less padding than fixed groups of 3 in arrival order.
    fixed = [collate(g, PAD).input_ids_BT.numel() for g in split_micro_batches(seqs, 3)]
    assert sum(padded) < sum(fixed)


def test_a_sequence_longer_than_the_budget_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"actor\.max_tokens_per_micro_batch=8"):
        split_by_token_budget([sequence(0, length=12, response_start=2)], max_tokens=8)


HIDDEN = 24


def hidden_sequence(sample_id: int, length: int, response_start: int, dtype: str) -> ScoredSequence:
    """A sequence with the teacher's hidden states as the client decodes the wire (float32 of 16-bit values)."""
    from teacher_server.wire import hidden_codec

    seq = sequence(sample_id, length, response_start)
    raw_NH = np.random.default_rng([sample_id, 7]).standard_normal((length - response_start, HIDDEN)) * 30
    decoded_NH = hidden_codec.round_to(raw_NH.astype(np.float32), dtype)
    seq.payload = HiddenStates.from_float32(decoded_NH, dtype)
    return seq


@pytest.mark.parametrize(("dtype", "torch_dtype"), [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_hidden_states_stay_in_the_wires_16_bits_until_the_head(dtype: str, torch_dtype: torch.dtype) -> None:
    """Two bytes a value from the client to the micro-batch (half of float32), the values exactly the wire's."""
    seqs = [hidden_sequence(i, 9 + 3 * i, 4 + i, dtype) for i in range(3)]
    for seq in seqs:
        assert seq.payload is not None and seq.payload.bits.nbytes == seq.num_response_tokens * HIDDEN * 2
    micro = collate(seqs, PAD)
    assert micro.payload is not None and micro.payload.dtype == torch_dtype
    for row, seq in enumerate(seqs):
        assert seq.payload is not None
        predicted = slice(seq.response_start - 1, len(seq.input_ids) - 1)
        want_NH = torch.from_numpy(seq.payload.to_float32())
        assert torch.equal(micro.payload[row, predicted].float(), want_NH)
        assert not micro.payload[row, ~micro.loss_mask_BT[row]].any()
    with pytest.raises(ValueError, match="disagree on the teacher's hidden states"):
        collate([seqs[0], hidden_sequence(5, 9, 4, "float16" if dtype == "bfloat16" else "bfloat16")], PAD)


def test_micro_batches_are_collated_one_at_a_time_as_the_schedule_takes_them() -> None:
    """LazyMicroBatches holds no collated micro-batch: each exists from when it is taken until it is dropped."""
    seqs = [hidden_sequence(i, 8 + i, 3, "bfloat16") for i in range(7)]
    lazy = LazyMicroBatches(split_micro_batches(seqs, 3), PAD, (), torch.device("cpu"))
    assert lazy.shapes == [(3, 9), (3, 12), (1, 13)] and len(lazy) == 3
    alive: set[int] = set()
    peak = 0
    for micro in lazy:
        assert micro.payload is not None
        key = id(micro.payload)
        alive.add(key)
        weakref.finalize(micro.payload, alive.discard, key)
        peak = max(peak, len(alive))
        del micro
    assert peak == 1 and not alive
