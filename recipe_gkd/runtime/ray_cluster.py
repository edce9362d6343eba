"""Ray as infrastructure: start (or join) the cluster a run needs, its placement groups, and what a probe sees.

One of the two modules that import Ray (the other, recipe_gkd/runtime/ray_pools.py, runs the workers).

Three cases, chosen by the config:
- `cluster.ray_address` set: join a running cluster (started by launch/ray_start.sh).
- `cluster.fake_gpus=true`: start a local cluster whose nodes advertise exactly the GPUs the
  plan gives Ray (one Ray node per plan node), on a machine with no GPU. Placement, bundles
  and CUDA_VISIBLE_DEVICES are real; the devices are not.
- otherwise: start a single local node with `num_gpus` = actor + rollout GPUs, so Ray hands
  out ids 0..n-1 and never the teacher's.
In every case the GPUs Ray sees are checked against the plan before anything is placed.
`ResourcePoolManager` makes the placement groups; `observe` places one probe per bundle and
reports what each sees from inside (python -m recipe_gkd.runtime.check_placement).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recipe_gkd.config import REPO_ROOT, GKDConfig
from recipe_gkd.observe import console
from recipe_gkd.plan.placement import (
    NODE_RESOURCE_DEMAND,
    NODE_RESOURCE_PREFIX,
    ROLES,
    PlacementPlan,
    Slot,
    check_ray_gpus,
    node_resource,
)
from recipe_gkd.runtime.stop_signal import current_sigterm_handler, restore_sigterm, stop_on_sigterm

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

MIB = 1024 * 1024
# Loopback only: nothing a run starts on its own listens on other interfaces.
LOCAL_IP = "127.0.0.1"
# The head of a fake multi-node cluster only hosts the driver and Ray's own services.
HEAD_CPUS = 1
# Colocated roles: the actor rank and the rollout engine on one GPU each book half of its bundle.
COLOCATED_GPU_REQUEST = 0.5


def ray_env(cfg: GKDConfig) -> dict[str, str]:
    """Environment for the Ray processes a run starts (read by Ray at import time)."""
    # The raylet's own "Spilled N MiB" lines off the console: the run states spilling once itself (SpillWatch).
    env = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_verbose_spill_logs": "0"}
    if cfg.cluster.fake_gpus and not cfg.cluster.ray_address:
        # Keep a fake cluster on loopback: otherwise ray.init rewrites 127.0.0.1 to the
        # machine's address, which the loopback-bound GCS does not listen on (a silent hang).
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    return env


def worker_runtime_env(cfg: GKDConfig) -> dict[str, Any]:
    """Every worker of the run: the driver's recipe_gkd first on its path, its known-harmless warnings into
    the run's log, no library progress bars."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, console.RUN_DIR_VAR: str(Path(cfg.trainer.run_dir).resolve()), **console.WORKER_ENV}
    return {"worker_process_setup_hook": "recipe_gkd.observe.console.worker_setup", "env_vars": env}


@contextmanager
def ray_cluster(cfg: GKDConfig, plan: PlacementPlan) -> Iterator[None]:
    """Ray connected and checked against the plan for the duration of the block."""
    os.environ.update(ray_env(cfg))
    import ray

    console.route_ray_logging(cfg.trainer.run_dir)
    fake_cluster: Any = None
    from recipe_gkd.plan.memory_plan import object_store_mib

    store = object_store_mib(cfg) * MIB
    job = {"runtime_env": worker_runtime_env(cfg)}
    before_ray = current_sigterm_handler()
    if cfg.cluster.ray_address:
        ray.init(address=cfg.cluster.ray_address, log_to_driver=True, **job)
    elif cfg.cluster.fake_gpus and plan.nnodes > 1:
        fake_cluster = _fake_multi_node(cfg, plan, store)
        ray.init(address=fake_cluster.address, _node_ip_address=LOCAL_IP, **job)
    else:
        ray.init(
            # A new cluster of this run's own, never another one found on the machine (a second run's,
            # or one `ray start` left; ray.init without an address would join it).
            address="local",
            num_gpus=plan.ray_gpus(0),
            num_cpus=cfg.cluster.ray_num_cpus,
            object_store_memory=store,
            include_dashboard=False,
            _node_ip_address=LOCAL_IP,
            **job,
        )
    stop_on_sigterm()  # ray.init took SIGTERM (its C++ handler exits 15 past this block's finally)
    try:
        check_ray_gpus(plan, ray.nodes())
        yield
    finally:
        ray.shutdown()
        if fake_cluster is not None:
            fake_cluster.shutdown()
        restore_sigterm(before_ray)  # an in-process caller gets back the handler it had


class SpillWatch:
    """Says once, in the run's words, when Ray's object store has started spilling objects to disk.

    Ray's raylet would print a `Spilled N MiB` line every time (turned off: RAY_verbose_spill_logs=0);
    spilling is legal but slow (each weight version written to disk and read back), and the fix is a
    config key. The counters are the raylets' own (what `ray memory --stats-only` shows).
    """

    def __init__(self, store_mb: int) -> None:
        self.store_mb = store_mb
        self.warned = False
        # The raylet is asked at calls 1, 2, 4, 8, ...: an RPC per step (~5-10 ms) would slow the CPU demo's
        # ~130 ms steps; spilling that starts with the first weight version is still seen at once.
        self.calls, self.next_query = 0, 1

    def check(self) -> str | None:
        """The warning line the first time spilled bytes are seen, else None."""
        self.calls += 1
        if self.warned or self.calls < self.next_query:
            return None
        self.next_query *= 2
        spilled = spilled_bytes()
        if not spilled:
            return None
        self.warned = True
        return (
            f"warning: Ray's object store is full and has spilled {spilled / MIB:.0f} MiB to disk so far "
            f"(cluster.ray_object_store_mb={self.store_mb}); every weight version that does not fit is written "
            "to disk and read back. Raise cluster.ray_object_store_mb or use weight_sync.transport=gloo"
        )


def spilled_bytes() -> int:
    """Bytes the cluster's object stores have spilled to disk since Ray started (all nodes)."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return int(reply.store_stats.spilled_bytes_total)


def _fake_multi_node(cfg: GKDConfig, plan: PlacementPlan, store: int) -> Any:
    """One Ray node per plan node, each labelled with its plan index, all on this machine."""
    from ray.cluster_utils import Cluster

    head = {"num_cpus": HEAD_CPUS, "num_gpus": 0, "object_store_memory": store, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={**head, "node_ip_address": LOCAL_IP})
    cpus = cfg.cluster.ray_num_cpus or 1
    for node in range(plan.nnodes):
        cluster.add_node(
            num_cpus=cpus,
            num_gpus=plan.ray_gpus(node),
            resources={node_resource(node): 1},
            object_store_memory=store,
            node_ip_address=LOCAL_IP,
        )
    return cluster


# ----------------------------------------------------------------------------- placement groups


class ResourcePoolManager:
    """Disjoint actor and rollout pools: one STRICT_PACK placement group per (role, node).

    Groups are created and awaited one at a time in plan order (actor, then rollout, node by
    node) so that Ray assigns GPU ids in plan order; each wait is bounded by
    cluster.placement_timeout_s.
    """

    def __init__(self, plan: PlacementPlan, timeout_s: float) -> None:
        self.plan = plan
        self.timeout_s = timeout_s
        self._groups: dict[tuple[str, int], PlacementGroup] = {}

    def create(self) -> None:
        from ray.util.placement_group import placement_group

        if self.plan.colocated:
            self._create_colocated()
            return
        for role in ROLES:
            for node in range(self.plan.nnodes):
                slots = [s for s in self.plan.role(role) if s.node == node]
                if not slots:
                    continue
                bundles = [self._bundle(s) for s in slots]
                group = placement_group(bundles, strategy="STRICT_PACK", name=f"gkd_{role}_node{node}")
                self._groups[(role, node)] = group
                self._wait(group, role, node, bundles)

    def _create_colocated(self) -> None:
        """One group for the node, one {"GPU": 1} bundle per GPU: actor rank i and rollout engine i share bundle i."""
        from ray.util.placement_group import placement_group

        bundles = [{"GPU": 1.0} for _ in self.plan.ray_gpu_ids(0)]
        group = placement_group(bundles, strategy="STRICT_PACK", name="gkd_colocated_node0")
        for role in ROLES:
            self._groups[(role, 0)] = group
        self._wait(group, "colocated", 0, bundles)

    def gpu_request(self, slot: Slot) -> float:
        """The `num_gpus` a worker asks Ray for: its GPUs, or half of its one GPU when actor and rollout share it.

        Ray only books the bundle with it; the memory each process may use is its configured share."""
        return COLOCATED_GPU_REQUEST if self.plan.colocated else float(len(slot.gpu_ids))

    def _bundle(self, slot: Slot) -> dict[str, float]:
        bundle = {"GPU": float(len(slot.gpu_ids))}
        if self.plan.nnodes > 1:
            bundle[node_resource(slot.node)] = NODE_RESOURCE_DEMAND
        return bundle

    def _wait(self, group: PlacementGroup, role: str, node: int, bundles: list[dict[str, float]]) -> None:
        import ray

        start = time.monotonic()
        ready, _ = ray.wait([group.ready()], timeout=self.timeout_s)
        if not ready:
            raise TimeoutError(
                f"the {role} placement group on node {node} ({bundles}) was not placed within "
                f"cluster.placement_timeout_s={self.timeout_s}s: Ray has {ray.available_resources()} free. "
                "Check the GPU split or raise cluster.placement_timeout_s"
            )
        self.wait_s = time.monotonic() - start

    def scheduling_strategy(self, slot: Slot) -> Any:
        """The Ray scheduling strategy that puts a worker into its slot's bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = self._groups[(slot.role, slot.node)]
        index = self.plan.bundle_index(slot)
        return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in {id(g): g for g in self._groups.values()}.values():
            remove_placement_group(group)
        self._groups.clear()


# ----------------------------------------------------------------------------- probes


@dataclass(frozen=True)
class Observed:
    role: str
    rank: int
    node: int
    cuda_visible_devices: str
    # As Ray reports them: the devices of a preset CUDA_VISIBLE_DEVICES (indices or UUIDs).
    ray_gpu_ids: tuple[str, ...]


class PlacementProbe:
    """A placeholder worker: reports where Ray put it."""

    def where(self) -> tuple[str, tuple[str, ...], str]:
        import ray

        ids = tuple(str(g) for g in ray.get_gpu_ids())
        return os.environ.get("CUDA_VISIBLE_DEVICES", ""), ids, ray.get_runtime_context().get_node_id()


def observe(cfg: GKDConfig, plan: PlacementPlan) -> list[Observed]:
    """Start one probe per actor/rollout slot and collect what each sees (Ray must be up)."""
    import ray

    pools = ResourcePoolManager(plan, cfg.cluster.placement_timeout_s)
    pools.create()
    try:
        probe_cls = ray.remote(num_cpus=0)(PlacementProbe)
        probes = [
            probe_cls.options(num_gpus=pools.gpu_request(s), scheduling_strategy=pools.scheduling_strategy(s)).remote()
            for s in plan.workers
        ]
        reports = ray.get([p.where.remote() for p in probes], timeout=cfg.cluster.placement_timeout_s)
        node_index = _node_index_by_id(plan)
        observed = [
            Observed(s.role, s.rank, node_index[node_id], cvd, ids)
            for s, (cvd, ids, node_id) in zip(plan.workers, reports, strict=True)
        ]
        for p in probes:
            ray.kill(p)
        return observed
    finally:
        pools.remove()


def _node_index_by_id(plan: PlacementPlan) -> dict[str, int]:
    import ray

    index: dict[str, int] = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        labels = [k for k in node["Resources"] if k.startswith(NODE_RESOURCE_PREFIX)]
        if plan.nnodes == 1:
            index[node["NodeID"]] = 0
        elif labels:
            index[node["NodeID"]] = int(labels[0].removeprefix(NODE_RESOURCE_PREFIX))
    return index
