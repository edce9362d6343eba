"""Launching the actor and rollout workers into their placement-group bundles, and stopping them.

The worker classes stay plain (tests build them directly); `ray.remote` is applied here.
Every wait is bounded (`recipe_gkd.watchdog.wait`): worker start-up by debug.hang_timeout_s,
naming the phase; a wait that times out first has every worker dump its Python stack.
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
from recipe_gkd.watchdog import wait


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
    from recipe_gkd.rollout.worker import RolloutWorker

    start = time.perf_counter()
    timeout = cfg.debug.hang_timeout_s
    pools = ResourcePoolManager(plan, cfg.cluster.placement_timeout_s)
    handles: list[Any] = []
    try:
        pools.create()
        actor_slots, rollout_slots = plan.role("actor"), plan.role("rollout")
        host, (megatron_port, sync_port) = _rank0_endpoint(pools, actor_slots[0], cfg.cluster.placement_timeout_s)
        from recipe_gkd.actor.worker import actor_worker_class

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
        watchdog.install(names, cfg.trainer.run_dir, cfg.cluster.placement_timeout_s)
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
        watchdog.uninstall()
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
