"""Which tensor-, data- and pipeline-parallel rank an actor process is (megatron's order, without megatron).

megatron-core orders ranks "tp-cp-ep-dp-pp": tensor-parallel ranks are adjacent, then data
parallel, and pipeline stages are outermost. With cp = 1 global rank r is TP rank r % tp of
data-parallel replica (r // tp) % dp, in pipeline stage r // (tp * dp). Every model-parallel
rank (TP x PP) of one replica must receive the same data; the driver hands each rank the shard
of its `data_parallel_rank`. `MegatronActor.setup()` checks this against megatron's parallel_state.
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
    pp_rank: int = 0
    pp_size: int = 1

    def global_rank(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """The global rank at the given coordinates (megatron's order)."""
        return tp_rank + self.tp_size * (dp_rank + self.dp_size * pp_rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def rank_layout(cfg: GKDConfig, rank: int) -> RankLayout:
    """The (tp, dp, pp) coordinates of global actor rank `rank` (cp = 1)."""
    tp, pp = cfg.actor.megatron.tp, cfg.actor.megatron.pp
    dp = actor_data_parallel_size(cfg)
    return RankLayout(
        rank=rank,
        tp_rank=rank % tp,
        dp_rank=(rank // tp) % dp,
        tp_size=tp,
        dp_size=dp,
        pp_rank=rank // (tp * dp),
        pp_size=pp,
    )


def data_parallel_rank(cfg: GKDConfig, rank: int) -> int:
    """The data-parallel replica whose shard actor rank `rank` trains on."""
    return rank_layout(cfg, rank).dp_rank
