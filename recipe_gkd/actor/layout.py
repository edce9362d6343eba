"""Which tensor-/data-parallel rank an actor process is (megatron's order, without megatron).

megatron-core orders ranks "tp-cp-ep-dp-pp": tensor-parallel ranks are adjacent, so with
pp = cp = 1 global rank r is TP rank r % tp of data-parallel replica r // tp. All TP ranks of
one replica must receive the same data; the driver hands replica `data_parallel_rank` its shard.
`MegatronActor.setup()` checks this against megatron's parallel_state.
"""

from __future__ import annotations

from dataclasses import dataclass

from recipe_gkd.config import GKDConfig, actor_data_parallel_size


@dataclass(frozen=True)
class RankLayout:
    rank: int
    tp_rank: int
    dp_rank: int
    tp_size: int
    dp_size: int


def rank_layout(cfg: GKDConfig, rank: int) -> RankLayout:
    """The (tp, dp) coordinates of global actor rank `rank` for pp = cp = 1."""
    tp = cfg.actor.megatron.tp
    return RankLayout(
        rank=rank, tp_rank=rank % tp, dp_rank=rank // tp, tp_size=tp, dp_size=actor_data_parallel_size(cfg)
    )


def data_parallel_rank(cfg: GKDConfig, rank: int) -> int:
    """The data-parallel replica whose shard actor rank `rank` trains on."""
    return rank_layout(cfg, rank).dp_rank
