"""/dev/shm before a GPU run starts: room for Ray's object store and NCCL's shared-memory transport.

A container's default /dev/shm is 64 MB. Ray then puts its object store in /tmp with only a log
warning (ray/_private/services.py `determine_plasma_store_config`, ray 2.60.0: /dev/shm is used
only when its free bytes >= object_store_memory), so every weight sync and rollout shard goes
through disk, and NCCL's intra-node transports fail when they cannot extend their /dev/shm
segments. The check runs on the driver's node, where the run's local Ray and its first workers run.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from recipe_gkd.config import ConfigError, Device, GKDConfig, WeightTransport, actor_world_size, weight_transport
from teacher_server.config.teacher import TeacherLocation

SHM_PATH = "/dev/shm"
MIB = 1024 * 1024
# NCCL's own advice for containers (NCCL user guide, Troubleshooting > Docker: `--shm-size=1g`): its
# shared-memory transport and proxy segments, a few buffers of NCCL_BUFFSIZE (4 MiB) per channel and peer.
NCCL_SHM_MIB = 1024

StatVfs = Callable[[str], os.statvfs_result]


def uses_nccl_on_a_node(cfg: GKDConfig) -> bool:
    """Whether two processes of this run talk over NCCL (actor ranks, a weight-sync group, vLLM tensor parallel)."""
    local_teacher_tp = cfg.teacher.location == TeacherLocation.local and cfg.teacher.gpus_per_replica > 1
    return (
        actor_world_size(cfg) > 1
        or weight_transport(cfg) == WeightTransport.nccl
        or cfg.rollout.tp > 1
        or local_teacher_tp
    )


def shm_needed_mib(cfg: GKDConfig, store_mib: int) -> dict[str, int]:
    """What this run puts in /dev/shm on the driver's node, by what needs it (MiB)."""
    need = {}
    if not cfg.cluster.ray_address:  # a cluster of the run's own: its object store is created here
        need[f"Ray's object store (cluster.ray_object_store_mb: {store_mib} MiB)"] = store_mib
    if uses_nccl_on_a_node(cfg):
        need["NCCL's shared-memory transport"] = NCCL_SHM_MIB
    return need


def check_shared_memory(cfg: GKDConfig, store_mib: int, statvfs: StatVfs = os.statvfs) -> None:
    """Raise ConfigError (cluster.ray_object_store_mb) when /dev/shm cannot hold what a GPU run puts there.

    CPU runs are not checked: Ray's fallback to /tmp only slows them, and they use no NCCL."""
    if cfg.cluster.device == Device.cpu:
        return
    need = shm_needed_mib(cfg, store_mib)
    try:
        st = statvfs(SHM_PATH)
    except FileNotFoundError:
        return  # no /dev/shm (not Linux): Ray keeps its store in /tmp there by design
    free_mib = st.f_bavail * st.f_frsize // MIB
    total = sum(need.values())
    if free_mib < total:
        parts = " + ".join(f"{what} {mib} MiB" for what, mib in need.items())
        size_gb = -(-total * MIB * 11 // 10 // 1024**3)  # 10% over, rounded up to whole GiB
        raise ConfigError(
            "cluster.ray_object_store_mb",
            f"{SHM_PATH} has {free_mib} MiB free but this run needs {total} MiB there ({parts}); Ray would put its "
            f"store in /tmp and NCCL fails without it: start the container with `docker run --shm-size={size_gb}g` "
            f"(or free {SHM_PATH}), or lower cluster.ray_object_store_mb",
        )
