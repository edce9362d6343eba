"""ParallelLayout: megatron's "tp-cp-ep-dp-pp" rank order, written out by nested loops and read from megatron-core's own
RankGenerators (the dense layers' and the experts'), and each rank's slice of the padded vocabulary."""

from __future__ import annotations

import itertools

import pytest

from recipe_gkd.config import GKDConfig
from recipe_gkd.parallel_layout import RANK_ORDER, ParallelLayout, data_parallel_rank, padded_vocab_size

# (tp, cp, ep, dp, pp): ep divides dp (expert parallelism splits data parallelism); megatron takes cp > 1 or ep > 1,
# not both (its RankGenerator asserts it).
SHAPES = [
    (1, 1, 1, 1, 1),
    (2, 1, 1, 1, 1),
    (1, 1, 1, 4, 1),
    (1, 1, 2, 4, 1),
    (2, 1, 1, 2, 2),
    (2, 2, 1, 2, 1),
    (3, 1, 2, 2, 1),
    (1, 2, 1, 3, 2),
    (2, 1, 2, 4, 3),
    (4, 1, 1, 2, 2),
    (1, 1, 4, 4, 2),
]


def layout_of(shape: tuple[int, int, int, int, int], rank: int = 0) -> ParallelLayout:
    tp, cp, ep, dp, pp = shape
    return ParallelLayout(tp_size=tp, cp_size=cp, ep_size=ep, dp_size=dp, pp_size=pp, rank=rank)


def megatron_order(shape: tuple[int, int, int, int, int]) -> list[tuple[int, int, int, int, int]]:
    """Every rank's (tp, cp, ep, dp, pp) in global-rank order: tp varies fastest, the pipeline stage slowest, the
    expert-parallel rank the innermost part of the data-parallel one."""
    tp, cp, ep, dp, pp = shape
    order = []
    for pp_rank in range(pp):
        for dp_rank in range(dp):
            for cp_rank in range(cp):
                for tp_rank in range(tp):
                    order.append((tp_rank, cp_rank, dp_rank % ep, dp_rank, pp_rank))
    return order


@pytest.mark.parametrize("shape", SHAPES)
def test_rank_and_coordinates_follow_megatrons_order(shape: tuple[int, int, int, int, int]) -> None:
    layout = layout_of(shape)
    expected = megatron_order(shape)
    assert layout.world_size == len(expected)
    for rank, (tp, cp, ep, dp, pp) in enumerate(expected):
        at = layout.at(rank)
        assert (at.tp_rank, at.cp_rank, at.ep_rank, at.dp_rank, at.pp_rank) == (tp, cp, ep, dp, pp)
        assert tuple(layout.coordinates(rank).values()) == (tp, cp, dp, pp)
        assert layout.global_rank(tp, cp, dp, pp) == rank
        assert at.is_first_stage == (pp == 0) and at.is_last_stage == (pp == shape[4] - 1)


def _groups_along(layout: ParallelLayout, name: str) -> list[list[int]]:
    """The ranks that differ only in dimension `name`, each group ordered by that coordinate."""
    groups = {
        tuple(layout.at(r).rank_with(**{name: i}) for i in range(layout.sizes()[name]))
        for r in range(layout.world_size)
    }
    return sorted(list(g) for g in groups)


def _expert_groups(layout: ParallelLayout, key) -> list[list[int]]:
    """The ranks grouped by `key(layout at rank)`, each group in rank order."""
    groups: dict[object, list[int]] = {}
    for r in range(layout.world_size):
        groups.setdefault(key(layout.at(r)), []).append(r)
    return sorted(groups.values())


@pytest.mark.parametrize("shape", SHAPES)
def test_groups_equal_megatron_cores_rank_generators(shape: tuple[int, int, int, int, int]) -> None:
    """megatron-core 0.16.1 parallel_state.initialize_model_parallel's two RankGenerators: the dense layers' (ep=1)
    and the experts' (cp=1, expert tensor parallel = tp, expert data parallel = dp / ep)."""
    from megatron.core.parallel_state import RankGenerator

    tp, cp, ep, dp, pp = shape
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    layout = layout_of(shape)
    for name in RANK_ORDER:
        assert sorted(dense.get_ranks(name)) == _groups_along(layout, name), name
    # Model parallel (TP x PP) ranks hold the same data: each is one data-parallel replica's.
    for group in dense.get_ranks("tp-pp"):
        assert len({layout.at(r).dp_rank for r in group}) == 1
    # megatron builds the experts' generator at cp = 1: data x context parallel is its data parallelism.
    experts = RankGenerator(tp=tp, ep=ep, dp=dp * cp // ep, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    # An expert-parallel group: the same tp, pp and expert-data-parallel rank, every ep rank.
    assert sorted(experts.get_ranks("ep")) == _expert_groups(layout, lambda a: (a.tp_rank, a.pp_rank, a.expert_dp_rank))
    # An expert-data-parallel group (the experts' gradient reduction): the same tp, pp and ep rank.
    assert sorted(experts.get_ranks("dp")) == _expert_groups(layout, lambda a: (a.tp_rank, a.pp_rank, a.ep_rank))
    assert {layout.at(r).expert_dp_size for r in range(layout.world_size)} == {dp * cp // ep}


def test_each_expert_lives_on_one_expert_parallel_rank() -> None:
    """megatron's global expert number: ep_rank x E/EP + local (moe/experts.py SequentialMLP's sharded names)."""
    layout = ParallelLayout(ep_size=4, dp_size=8)
    owned = [list(layout.at(r).local_experts(16)) for r in range(4)]
    assert owned == [list(range(4 * r, 4 * r + 4)) for r in range(4)]
    assert [layout.expert_owner(e, 16) for e in range(16)] == [e // 4 for e in range(16)]
    assert list(layout.at(5).local_experts(16)) == list(range(4, 8))  # dp rank 5: ep rank 1, expert dp rank 1


def test_rank_with_changes_only_the_named_coordinates() -> None:
    layout = ParallelLayout(tp_size=2, dp_size=2, pp_size=3, rank=7)  # tp 1, dp 1, pp 1
    assert layout.coordinates() == {"tp": 1, "cp": 0, "dp": 1, "pp": 1}
    assert layout.rank_with(pp=2) == 11 and layout.rank_with(tp=0, dp=0) == 4
    assert layout.global_rank(pp=2) == 8


def test_the_layout_refuses_impossible_coordinates() -> None:
    with pytest.raises(ValueError, match="outside a world of 4"):
        ParallelLayout(tp_size=2, dp_size=2, rank=4)
    with pytest.raises(ValueError, match="one of them"):
        ParallelLayout(cp_size=2, ep_size=2, dp_size=2)
    with pytest.raises(ValueError, match="ep=2 must divide the data-parallel size 3"):
        ParallelLayout(ep_size=2, dp_size=3)
    with pytest.raises(ValueError, match="dp rank 2 outside dp size 2"):
        ParallelLayout(tp_size=2, dp_size=2).global_rank(dp=2)


def test_from_config_puts_pipeline_stages_outermost() -> None:
    """8 actor ranks at TP=2, PP=2 -> DP=2; the driver hands each rank its data-parallel shard."""
    cfg = GKDConfig()
    cfg.actor.gpus_per_node = 8
    cfg.actor.megatron.tp = 2
    cfg.actor.megatron.pp = 2
    layout = ParallelLayout.from_config(cfg)
    assert (layout.tp_size, layout.cp_size, layout.ep_size, layout.dp_size, layout.pp_size) == (2, 1, 1, 2, 2)
    assert [data_parallel_rank(cfg, r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert ParallelLayout.from_config(cfg, 5) == layout.at(5)


@pytest.mark.parametrize(("vocab", "tp"), [(101, 1), (101, 2), (102, 2), (90, 4), (151_665, 2)])
def test_each_rank_slices_its_padded_vocabulary_shard(vocab: int, tp: int) -> None:
    """The ranks' real columns, concatenated in rank order, are the whole vocabulary once (and `used` cuts it)."""
    padded = padded_vocab_size(vocab, tp)
    assert padded % tp == 0 and vocab <= padded < vocab + tp
    for used in (None, vocab - 7, vocab + 5):
        ids = []
        for rank in range(tp):
            layout = ParallelLayout(tp_size=tp, dp_size=1, rank=rank)
            start, columns = layout.local_vocab_slice(vocab, used)
            assert start == rank * layout.vocab_shard_size(vocab) and columns.start == 0
            ids += range(start + columns.start, start + columns.stop)
        assert ids == list(range(min(vocab, used or vocab)))


def test_the_vocabulary_slice_on_a_data_parallel_rank_is_its_tp_ranks() -> None:
    """dp and pp do not move a rank's vocabulary columns: only its TP coordinate does."""
    layout = ParallelLayout(tp_size=2, dp_size=2, pp_size=2)
    slices = {layout.at(r).local_vocab_slice(101)[0] for r in range(layout.world_size) if layout.at(r).tp_rank == 1}
    assert slices == {51}


def test_every_coordinate_is_a_field() -> None:
    """One object for each axis: every dimension of the rank order is a size field with a rank property."""
    layout = ParallelLayout()
    for name in (*RANK_ORDER, "ep", "expert_dp"):
        assert getattr(layout, f"{name}_size") == 1 and getattr(layout, f"{name}_rank") == 0
    assert list(itertools.chain(layout.sizes())) == list(RANK_ORDER)


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
@pytest.mark.parametrize("tokens", [1, 7, 16, 1000, 32763, 32768])
def test_each_context_parallel_rank_holds_its_two_zigzag_chunks_of_the_padded_sequence(cp: int, tokens: int) -> None:
    """The zigzag split written out: the sequence padded to 2 x cp equal chunks (not cut at cp = 1), rank r holding
    chunks r and 2cp-1-r; every padded position on exactly one rank, each rank as many as the layout says."""
    layout = ParallelLayout(cp_size=cp, dp_size=1)
    chunks = 2 * cp if cp > 1 else 1
    chunk = -(-tokens // chunks)  # ceil
    padded = chunk * chunks
    positions: dict[int, list[int]] = {r: [] for r in range(cp)}
    for r in range(cp):
        for c in sorted({r, chunks - 1 - r}):
            positions[r] += range(c * chunk, (c + 1) * chunk)
    assert sorted(p for held in positions.values() for p in held) == list(range(padded))
    assert layout.cp_padded_length(tokens) == padded and padded - tokens < chunks
    assert all(len(held) == layout.cp_local_length(tokens) for held in positions.values())
