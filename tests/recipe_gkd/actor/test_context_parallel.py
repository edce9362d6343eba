"""The zigzag split of context parallelism against a direct listing (pure torch: no process group)."""

from __future__ import annotations

import pytest
import torch
from megatron_scenarios import make_masked_sequences

from recipe_gkd.actor.collate import collate
from recipe_gkd.actor.context_parallel import ContextSplit, natural_order, padded_length, zigzag_positions


@pytest.mark.parametrize(("length", "cp"), [(8, 2), (16, 4), (48, 8), (12, 2)])
def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r(length: int, cp: int) -> None:
    """Written out: the sequence in 2 x cp chunks; rank r holds chunk r then chunk 2 x cp - 1 - r."""
    chunk = length // (2 * cp)
    chunks = [list(range(i * chunk, (i + 1) * chunk)) for i in range(2 * cp)]
    for rank in range(cp):
        assert zigzag_positions(length, cp, rank).tolist() == chunks[rank] + chunks[2 * cp - 1 - rank]
    shares = torch.cat([zigzag_positions(length, cp, r) for r in range(cp)])
    assert sorted(shares.tolist()) == list(range(length))  # every position once
    assert shares[natural_order(length, cp)].tolist() == list(range(length))  # the inverse


@pytest.mark.parametrize("cp", [2, 4])
def test_the_split_of_a_micro_batch_is_the_zigzag_split_of_every_per_token_field(cp: int) -> None:
    """Multi-turn sequences (a tool's tokens masked out): every per-token field of the ranks' shares, put back in
    order, is the padded micro-batch; the padding is no loss token; the loss tokens add up to the whole's."""
    micro = collate(make_masked_sequences(3, 5, 50), pad_id=7)
    length = micro.input_ids_BT.shape[1]
    padded = padded_length(length, cp)
    assert padded % (2 * cp) == 0 and length <= padded < length + 2 * cp
    shares = [ContextSplit(cp, r, None, pad_id=7).split(micro) for r in range(cp)]
    assert sum(s.num_tokens for s in shares) == micro.num_tokens
    order = natural_order(padded, cp)
    for name in ("input_ids_BT", "loss_mask_BT", "teacher_logprobs_BTK", "teacher_ids_BTK", "sampled_mask_BT",
                 "rollout_logprobs_BT", "teacher_sampled_BT", "target_ids_BT", "teacher_tail_BT"):  # fmt: skip
        whole = torch.cat([getattr(s, name) for s in shares], dim=1).index_select(1, order)
        assert torch.equal(whole[:, :length], getattr(micro, name)), name
    ids = torch.cat([s.input_ids_BT for s in shares], dim=1).index_select(1, order)
    assert (ids[:, length:] == 7).all()
    mask = torch.cat([s.loss_mask_BT for s in shares], dim=1).index_select(1, order)
    assert not mask[:, length:].any()
    positions = torch.cat([s.position_ids_BT for s in shares], dim=1).index_select(1, order)
    assert torch.equal(positions, torch.arange(padded).expand_as(positions))
