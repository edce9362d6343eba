"""Start (or join) the Ray cluster a run needs, and stop exactly what was started.

Three cases, chosen by the config:
- `cluster.ray_address` set: join a running cluster (started by launch/ray_start.sh).
- `cluster.fake_gpus=true`: start a local cluster whose nodes advertise exactly the GPUs the
  plan gives Ray (one Ray node per plan node), on a machine with no GPU. Placement, bundles
  and CUDA_VISIBLE_DEVICES are real; the devices are not.
- otherwise: start a single local node with `num_gpus` = actor + rollout GPUs, so Ray hands
  out ids 0..n-1 and never the teacher's.
In every case the GPUs Ray sees are checked against the plan before anything is placed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from recipe_gkd.config import GKDConfig
from recipe_gkd.placement import PlacementPlan, check_ray_gpus, node_resource

MIB = 1024 * 1024
# Loopback only: nothing a run starts on its own listens on other interfaces.
LOCAL_IP = "127.0.0.1"
# The head of a fake multi-node cluster only hosts the driver and Ray's own services.
HEAD_CPUS = 1


def ray_env(cfg: GKDConfig) -> dict[str, str]:
    """Environment for the Ray processes a run starts (read by Ray at import time)."""
    env = {"RAY_USAGE_STATS_ENABLED": "0"}
    if cfg.cluster.fake_gpus and not cfg.cluster.ray_address:
        # Keep a fake cluster on loopback: otherwise ray.init rewrites 127.0.0.1 to the
        # machine's address, which the loopback-bound GCS does not listen on (a silent hang).
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    return env


@contextmanager
def ray_cluster(cfg: GKDConfig, plan: PlacementPlan) -> Iterator[None]:
    """Ray connected and checked against the plan for the duration of the block."""
    os.environ.update(ray_env(cfg))
    import ray

    fake_cluster: Any = None
    store = cfg.cluster.ray_object_store_mb * MIB
    if cfg.cluster.ray_address:
        ray.init(address=cfg.cluster.ray_address, log_to_driver=True)
    elif cfg.cluster.fake_gpus and plan.nnodes > 1:
        fake_cluster = _fake_multi_node(cfg, plan, store)
        ray.init(address=fake_cluster.address, _node_ip_address=LOCAL_IP)
    else:
        ray.init(
            num_gpus=plan.ray_gpus(0),
            num_cpus=cfg.cluster.ray_num_cpus,
            object_store_memory=store,
            include_dashboard=False,
            _node_ip_address=LOCAL_IP,
        )
    try:
        check_ray_gpus(plan, ray.nodes())
        yield
    finally:
        ray.shutdown()
        if fake_cluster is not None:
            fake_cluster.shutdown()


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
