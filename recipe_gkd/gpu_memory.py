"""One GPU's memory for the memory plan: cluster.gpu_memory_gib, or (0) read from the device.

torch's per-process cap (actor.gpu_memory_utilization) and vLLM's utilization are fractions of the
real device, so the plan must budget the real size: a plan of 79 GiB on a 40 GiB card "fits" and
the actor runs out of memory at step 1. The size is read with `nvidia-smi` (the driver's NVML, no
CUDA context: a context here would hold ~0.5 GiB of the GPU the roles are planned on), for the
plan's GPUs on this node read through a preset CUDA_VISIBLE_DEVICES (placement.physical_gpu_ids).
Where no GPU can be read (a login node, a CPU machine) the plan stays on DEFAULT_GPU_MEMORY_GIB.
nvidia-smi numbers GPUs in PCI bus order, CUDA (and so a CUDA_VISIBLE_DEVICES index) fastest first unless
CUDA_DEVICE_ORDER=PCI_BUS_ID: on a node of mixed cards an index may name another card (a UUID mask never
does); the plan takes the smallest of the GPUs it maps the plan onto.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from recipe_gkd.config import ConfigError, GKDConfig
from recipe_gkd.placement import physical_gpu_ids

# An 80 GB H100/A100 as torch reports it: the plan's size where no GPU can be read.
DEFAULT_GPU_MEMORY_GIB = 79.0
# nvidia-smi's memory.total and torch's total_memory of one device differ by a few hundred MiB
# (the driver's reservation); a configured size further than this from the device's is a mistake.
CONFIGURED_SIZE_TOLERANCE_GIB = 1.0
QUERY = ["nvidia-smi", "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"]
QUERY_TIMEOUT_S = 30.0

# index, uuid, MiB of every GPU of the node (nvidia-smi ignores CUDA_VISIBLE_DEVICES), or None: no GPU here.
GpuQuery = Callable[[], list[tuple[str, str, int]] | None]


def query_gpus() -> list[tuple[str, str, int]] | None:
    """(index, uuid, memory.total MiB) of each GPU nvidia-smi lists; None where there is no nvidia-smi."""
    try:
        out = subprocess.run(QUERY, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S, check=False)
    except FileNotFoundError:
        return None
    if out.returncode != 0:
        # nvidia-smi without a working driver (a container without GPUs): no GPU to read here.
        return None
    rows = [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]
    return [(index, uuid, int(float(mib))) for index, uuid, mib in rows] or None


@dataclass(frozen=True)
class GpuMemory:
    """The size the plan budgets, and where it came from (for the plan's heading)."""

    gib: float
    source: str


def plan_gpu_memory(cfg: GKDConfig, query: GpuQuery | None = None) -> GpuMemory:
    """cluster.gpu_memory_gib checked against this node's GPUs (`query`, default nvidia-smi), or read
    from them when it is 0."""
    configured = cfg.cluster.gpu_memory_gib
    gpus = (query or query_gpus)()
    if gpus is None:
        if configured:
            return GpuMemory(configured, "cluster.gpu_memory_gib (no GPU here to check it against)")
        return GpuMemory(DEFAULT_GPU_MEMORY_GIB, "cluster.gpu_memory_gib=0 and no GPU here: an 80 GB card")
    by_id = {key: mib for index, uuid, mib in gpus for key in (index, uuid)}
    wanted = physical_gpu_ids(range(cfg.cluster.gpus_per_node))
    missing = [g for g in wanted if g not in by_id]
    if missing:
        raise ConfigError(
            "cluster.gpus_per_node",
            f"is {cfg.cluster.gpus_per_node} but this node has no GPU {missing[0]} (nvidia-smi lists {len(gpus)})",
        )
    smallest = min(wanted, key=lambda g: by_id[g])
    real = round(by_id[smallest] / 1024, 1)
    if configured and abs(configured - real) > CONFIGURED_SIZE_TOLERANCE_GIB:
        raise ConfigError(
            "cluster.gpu_memory_gib",
            f"is {configured} but GPU {smallest} of this node has {real} GiB (nvidia-smi); the memory shares are "
            f"fractions of the real device: set cluster.gpu_memory_gib=0 (read the device) or {real}",
        )
    return GpuMemory(configured or real, f"GPU {smallest} of this node (nvidia-smi)")
