"""The actor rank as a pool worker: MegatronActor plus the step statistics and the weight sync's sending side.

MegatronActor stays a plain class (tests build it directly). The pools build their workers from
`actor_worker_class()`: the Ray pool (recipe_gkd/runtime/ray_pools.py) adds the methods that take and give
object refs, the local pool (recipe_gkd/runtime/local_pools.py) calls it directly.
"""

from __future__ import annotations

from typing import Any


def actor_worker_class() -> type:
    """MegatronActor plus the pool-facing methods (imported lazily: megatron stays out of the driver)."""
    from recipe_gkd.actor.megatron_actor import MegatronActor
    from recipe_gkd.weight_sync import WeightSender

    # WeightSender: the weight sync's sending side (the run's transport handed down once, then one send per version).
    class ActorWorker(MegatronActor, WeightSender):  # type: ignore[misc, valid-type]
        def train(self, shards: list[Any]) -> dict[str, float]:
            """One optimizer step on `shards` (one TrainShard per rollout worker); with debug.log_memory, MiB."""
            from recipe_gkd.process_memory import worker_memory_mb

            stats = self.train_step(shards)
            if self.cfg.debug.log_memory:
                stats.update(worker_memory_mb(f"actor{self.rank}"))
            return stats

    return ActorWorker
