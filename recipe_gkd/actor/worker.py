"""The actor rank as a pool worker: MegatronActor plus the step statistics and the weight-sync sender.

MegatronActor stays a plain class (tests build it directly). The pools build their workers from
`actor_worker_class()`: the Ray pool (recipe_gkd/runtime/ray_pools.py) adds the methods that take and give
object refs, the local pool (recipe_gkd/runtime/local_pools.py) calls it directly.
"""

from __future__ import annotations

import time
from typing import Any


def actor_worker_class() -> type:
    """MegatronActor plus the pool-facing methods (imported lazily: megatron stays out of the driver)."""
    from recipe_gkd.actor.megatron_actor import MegatronActor

    class ActorWorker(MegatronActor):  # type: ignore[misc, valid-type]
        def train(self, shards: list[Any]) -> dict[str, float]:
            """One optimizer step on `shards` (one TrainShard per rollout worker); with debug.log_memory, MiB."""
            from recipe_gkd.process_memory import worker_memory_mb

            stats = self.train_step(shards)
            if self.cfg.debug.log_memory:
                stats.update(worker_memory_mb(f"actor{self.rank}"))
            return stats

        def init_weight_group(self, backend: str, host: str, port: int, world_size: int, timeout_s: float) -> None:
            """Rank 0 only: open the weight-sync group as its rank 0 (the rollout workers join)."""
            from recipe_gkd.weight_sync import CollectiveChannel

            self.weight_channel = CollectiveChannel(backend, host, port, 0, world_size, timeout_s)

        def weight_checksums(self, dtype: str) -> dict[str, int]:
            """Per HF name, the fingerprint in `dtype` of what the actor exports (weight_sync.tensor_checksum), computed
            where each gathered tensor is (rank 0; {} elsewhere; every rank calls)."""
            import torch

            from recipe_gkd.weight_sync import tensor_checksum

            as_dtype = getattr(torch, dtype)
            return {name: tensor_checksum(t, as_dtype) for name, t in self.iter_hf_tensors(on_device=True)}

        def broadcast_weights(self, bucket_mb: int) -> dict[str, float]:
            """Every rank gathers over TP; rank 0 broadcasts the buckets to the rollout workers as they fill."""
            import torch

            from recipe_gkd.config import Precision
            from recipe_gkd.weight_sync import MIB, TimedIterator

            # On GPUs the buckets are built from the gathered shards where they are, in the training dtype:
            # nothing goes through host memory (GPU-only, reasoned; on CPU the same code runs over gloo).
            weights = TimedIterator(self.iter_hf_tensors(on_device=True))
            if self.rank != 0:
                for _ in weights:  # yields nothing here: this rank's part is the TP gathers
                    pass
                return {}
            start = time.perf_counter()
            # Buckets travel in the training dtype (bf16 halves the bytes of fp32 exports).
            wire_dtype = torch.bfloat16 if self.cfg.actor.precision == Precision.bf16 else None
            sent = self.weight_channel.send(weights, bucket_mb * MIB, dtype=wire_dtype)
            return {
                "export_s": weights.seconds,
                "send_s": time.perf_counter() - start - weights.seconds,
                "bytes": float(sent),
            }

    return ActorWorker
