"""Launching the actor and rollout workers into their placement-group bundles, and stopping them.

The worker classes stay plain (tests build them directly); `ray.remote` is applied here.
Every wait is bounded: worker start-up by debug.hang_timeout_s, naming the phase. A wait that
times out first has every worker dump its Python stack into <run_dir>/hang_<phase>_<time>/
(recipe_gkd.watchdog) and names the workers stuck in project code.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from recipe_gkd.config import GKDConfig, actor_data_parallel_size, weight_group_ranks_per_engine
from recipe_gkd.placement import PlacementPlan, ResourcePoolManager, Slot
from recipe_gkd.ports import reserve_ports
from recipe_gkd.watchdog import Watchdog

# The running launch's watchdog (driver process only): phase timeouts dump the workers' stacks.
_watchdog: Watchdog | None = None


class PhaseTimeoutError(TimeoutError):
    """A phase of the step did not finish within debug.hang_timeout_s."""


def wait(refs: list[Any], timeout_s: float, phase: str) -> list[Any]:
    """ray.get with a timeout whose error names the phase and the key to change."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        raise phase_timeout(phase, timeout_s) from None


def wait_done(refs: list[Any], timeout_s: float, phase: str) -> None:
    """Block until every task behind `refs` has finished, without fetching (nor raising) its result."""
    import ray

    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)
    if pending:
        raise phase_timeout(phase, timeout_s)


def phase_timeout(phase: str, timeout_s: float) -> PhaseTimeoutError:
    """The error for a phase over its time; first every worker's stack is dumped (one line message)."""
    return PhaseTimeoutError(
        f"phase '{phase}' did not finish within debug.hang_timeout_s={timeout_s}s{dump_stacks(phase)}; raise "
        "debug.hang_timeout_s if the step is legitimately this slow"
    )


def dump_stacks(phase: str) -> str:
    """Every worker's stack into the run directory (when workers are running); the message suffix saying where."""
    if _watchdog is None:
        return ""
    out, stuck = _watchdog.dump(phase)
    where = ", ".join(f"{name} at {frame}" for name, frame in stuck.items()) or "no worker in project code"
    return f"; stuck: {where}; every worker's stack is in {out}"


def actor_worker_class() -> type:
    """MegatronActor plus the Ray-facing methods (imported lazily: megatron stays out of the driver)."""
    from recipe_gkd.actor.megatron_actor import MegatronActor

    class ActorWorker(MegatronActor):  # type: ignore[misc, valid-type]
        def train_refs(self, shard_refs: list[Any]) -> dict[str, float]:
            """Train on the TrainShards behind `shard_refs` (one per rollout worker)."""
            import ray

            from recipe_gkd.metrics import worker_memory_mb

            stats = self.train_step(ray.get(shard_refs))
            if self.cfg.debug.log_memory:
                stats.update(worker_memory_mb(f"actor{self.rank}"))
            return stats

        def eval_refs(self, shard_refs: list[Any]) -> dict[str, float]:
            import ray

            return self.eval_loss(ray.get(shard_refs))

        def export_weight_buckets(self, bucket_mb: int) -> list[Any] | None:
            """Every rank gathers over TP; rank 0 puts the buckets as they fill and returns their refs."""
            from recipe_gkd.weight_sync import put_buckets

            refs = put_buckets(self.iter_hf_weights(), bucket_mb)
            return refs if self.rank == 0 else None

        def init_weight_group(self, backend: str, host: str, port: int, world_size: int, timeout_s: float) -> None:
            """Rank 0 only: open the weight-sync group as its rank 0 (the rollout workers join)."""
            from recipe_gkd.weight_sync import CollectiveChannel

            self.weight_channel = CollectiveChannel(backend, host, port, 0, world_size, timeout_s)

        def broadcast_weights(self, bucket_mb: int) -> dict[str, float]:
            """Every rank gathers over TP; rank 0 broadcasts the buckets to the rollout workers as they fill."""
            import torch

            from recipe_gkd.config import Precision
            from recipe_gkd.weight_sync import MIB, TimedIterator

            weights = TimedIterator(self.iter_hf_weights())
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


def _rank0_endpoint(pools: ResourcePoolManager, slot: Slot, timeout_s: float) -> tuple[str, list[int]]:
    """Address and two free ports on actor rank 0's node: megatron's rendezvous, the weight-sync group's."""
    import ray

    if pools.plan.nnodes == 1:
        return "127.0.0.1", reserve_ports(2)

    @ray.remote(num_cpus=0)
    def endpoint() -> tuple[str, list[int]]:
        from recipe_gkd.ports import reserve_ports

        return ray.util.get_node_ip_address(), reserve_ports(2, host="0.0.0.0")

    return wait(
        [endpoint.options(scheduling_strategy=pools.scheduling_strategy(slot)).remote()], timeout_s, "rendezvous"
    )[0]


@dataclass
class Workers:
    actors: list[Any]
    rollouts: list[Any]
    dp_size: int
    setup_s: float
    # Actor rank 0's one-line account of how it computes (attention, recompute, optimizer, micro-batches).
    actor_summary: str = ""


@contextmanager
def launch_workers(cfg: GKDConfig, plan: PlacementPlan, teacher_address: str | None) -> Iterator[Workers]:
    """Placement groups, then every actor rank and rollout worker set up; all stopped on exit."""
    import ray

    from recipe_gkd import watchdog
    from recipe_gkd.rollout.base import RolloutWorker

    global _watchdog
    start = time.perf_counter()
    timeout = cfg.debug.hang_timeout_s
    pools = ResourcePoolManager(plan, cfg.cluster.placement_timeout_s)
    handles: list[Any] = []
    try:
        pools.create()
        actor_slots, rollout_slots = plan.role("actor"), plan.role("rollout")
        host, (megatron_port, sync_port) = _rank0_endpoint(pools, actor_slots[0], cfg.cluster.placement_timeout_s)
        actor_cls = ray.remote(num_cpus=0)(actor_worker_class())
        actors = [
            actor_cls.options(num_gpus=len(s.gpu_ids), scheduling_strategy=pools.scheduling_strategy(s)).remote(
                cfg, s.rank, len(actor_slots), host, megatron_port
            )
            for s in actor_slots
        ]
        # Two threads: two_step_off scores batch t+1 while generating t+2 (the worker locks its engine).
        rollout_cls = ray.remote(num_cpus=0, max_concurrency=2)(RolloutWorker)
        rollouts = [
            rollout_cls.options(num_gpus=len(s.gpu_ids), scheduling_strategy=pools.scheduling_strategy(s)).remote(
                cfg, s.rank, len(rollout_slots)
            )
            for s in rollout_slots
        ]
        handles = actors + rollouts
        names = {f"actor{i}": a for i, a in enumerate(actors)} | {f"rollout{i}": r for i, r in enumerate(rollouts)}
        _watchdog = watchdog.install(names, cfg.trainer.run_dir, cfg.cluster.placement_timeout_s)
        ready = wait(
            [a.setup.remote() for a in actors] + [r.setup.remote(None, teacher_address) for r in rollouts],
            timeout,
            "worker setup",
        )
        if cfg.weight_sync.transport != "object_store":
            _open_weight_group(cfg, actors[0], rollouts, host, sync_port)
        summary = str(ready[0].get("summary", ""))
        yield Workers(actors, rollouts, actor_data_parallel_size(cfg), time.perf_counter() - start, summary)
    finally:
        _watchdog = None
        _stop(handles, timeout)
        pools.remove()


def _open_weight_group(cfg: GKDConfig, actor0: Any, rollouts: list[Any], host: str, port: int) -> None:
    """Actor rank 0 and every rollout worker join the weight-sync process group (all at once)."""
    backend, timeout = str(cfg.weight_sync.transport), cfg.weight_sync.timeout_s
    # Rank 0 sends; rollout engine i's workers take ranks 1 + i * per_engine onwards.
    per_engine = weight_group_ranks_per_engine(cfg)
    world = 1 + per_engine * len(rollouts)
    joins = [actor0.init_weight_group.remote(backend, host, port, world, timeout)] + [
        r.init_weight_group.remote(backend, host, port, 1 + i * per_engine, world, timeout)
        for i, r in enumerate(rollouts)
    ]
    wait(joins, cfg.debug.hang_timeout_s, f"weight-sync group setup ({backend} on {host}:{port})")


def _stop(handles: list[Any], timeout_s: float) -> None:
    """Ask actors to release their process groups, then kill every worker this run started."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    shutdowns = [h.shutdown.remote() for h in handles if hasattr(h, "shutdown")]
    try:
        ray.get(shutdowns, timeout=min(timeout_s, 30.0))
    except (GetTimeoutError, RayError) as err:
        print(f"warning: a worker did not shut down cleanly ({type(err).__name__}); killing it", flush=True)
    for h in handles:
        ray.kill(h)
