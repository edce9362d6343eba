"""One GPU's memory for the memory plan: cluster.gpu_memory_gib, or (0) read from the device.

torch's per-process cap (actor.gpu_memory_utilization) and vLLM's utilization are fractions of the
real device, so the plan must budget the real size: a plan of 79 GiB on a 40 GiB card "fits" and
the actor runs out of memory at step 1. The size is what CUDA itself reports, `torch.cuda.mem_get_info`,
the total vLLM takes its share of (vllm/utils/mem_utils.py `MemorySnapshot.measure` ->
vllm/v1/worker/utils.py `request_memory`, 0.24.0/0.33.0); nvidia-smi would report a MIG slice's parent
GPU. It is read in a short child process (`CUDA_QUERY`) with this process's CUDA_VISIBLE_DEVICES, so the
context it creates goes with it and any mask works as it does for the workers: indices, `GPU-<uuid>` or
`MIG-<uuid>` entries. CUDA numbers the visible devices in the mask's order, so plan GPU i is visible
device i (`placement.physical_gpu_ids` names it). Where no NVIDIA driver is present (a login node, a CPU
machine) the plan stays on DEFAULT_GPU_MEMORY_GIB.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from recipe_gkd.config import ConfigError, GKDConfig
from recipe_gkd.plan.placement import VISIBLE_DEVICES_VAR, physical_gpu_ids, visible_devices

# An 80 GB H100/A100 as torch reports it: the plan's size where no GPU can be read.
DEFAULT_GPU_MEMORY_GIB = 79.0
# Two reads of one device (nvidia-smi's memory.total, CUDA's total) differ by a few hundred MiB
# (the driver's reservation); a configured size further than this from the device's is a mistake.
CONFIGURED_SIZE_TOLERANCE_GIB = 1.0
# A child importing torch and initialising CUDA on every visible GPU of a busy node.
QUERY_TIMEOUT_S = 120.0
# Present wherever an NVIDIA driver is loaded (also inside GPU containers): without them no child is started.
DRIVER_MARKERS = (Path("/dev/nvidiactl"), Path("/proc/driver/nvidia/version"))
# Prints [[name, total bytes], ...] per visible device ([] when CUDA sees none: a CPU torch, a mask naming no
# device). mem_get_info makes a context on each device: the child exits with it.
CUDA_QUERY = """
import json, torch
print(json.dumps([
    [torch.cuda.get_device_name(i), torch.cuda.mem_get_info(i)[1]] for i in range(torch.cuda.device_count())
]))
"""


@dataclass(frozen=True)
class VisibleGpu:
    """A device CUDA shows this process (visible index i = plan GPU i): its name and total MiB."""

    name: str
    mib: int


class GpuReadError(RuntimeError):
    """A driver is here but CUDA could not be asked for its devices (the reason in the message)."""


# The visible GPUs in CUDA's order, or None: no NVIDIA driver here. Raises GpuReadError.
GpuQuery = Callable[[], list[VisibleGpu] | None]


def query_gpus() -> list[VisibleGpu] | None:
    """What CUDA reports of each visible device, read in a child process; None where there is no NVIDIA driver."""
    if not any(marker.exists() for marker in DRIVER_MARKERS):
        return None
    return run_cuda_query([sys.executable, "-c", CUDA_QUERY])


def run_cuda_query(cmd: list[str]) -> list[VisibleGpu]:
    """Run `cmd` (CUDA_QUERY in a child with this environment) and parse what it prints."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise GpuReadError(f"reading the GPUs through CUDA took over {QUERY_TIMEOUT_S:.0f} s") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise GpuReadError(f"reading the GPUs through CUDA failed (exit {out.returncode}): {last}")
    try:
        rows = json.loads((out.stdout.strip().splitlines() or ["no output"])[-1])
    except ValueError:
        raise GpuReadError(f"reading the GPUs through CUDA printed {out.stdout[-200:]!r}") from None
    return [VisibleGpu(str(name), int(total) // 2**20) for name, total in rows]


@dataclass(frozen=True)
class GpuMemory:
    """The size the plan budgets, and where it came from (for the plan's heading)."""

    gib: float
    source: str


def plan_gpu_memory(cfg: GKDConfig, query: GpuQuery | None = None) -> GpuMemory:
    """cluster.gpu_memory_gib checked against this node's GPUs as CUDA sees them (`query`, default a child
    process), or read from them when it is 0."""
    configured = cfg.cluster.gpu_memory_gib
    try:
        gpus = (query or query_gpus)()
    except GpuReadError as err:
        if configured:
            return GpuMemory(configured, f"cluster.gpu_memory_gib (not checked: {err})")
        raise ConfigError(
            "cluster.gpu_memory_gib", f"is 0 (read the device) but {err}: set it to one GPU's GiB"
        ) from None
    if gpus is None:
        if configured:
            return GpuMemory(configured, "cluster.gpu_memory_gib (no GPU here to check it against)")
        return GpuMemory(DEFAULT_GPU_MEMORY_GIB, "cluster.gpu_memory_gib=0 and no GPU here: an 80 GB card")
    wanted = cfg.cluster.gpus_per_node
    if len(gpus) < wanted:
        mask = visible_devices()
        shown = f" ({VISIBLE_DEVICES_VAR}={','.join(mask)})" if mask is not None else ""
        raise ConfigError("cluster.gpus_per_node", f"is {wanted} but CUDA shows this node {len(gpus)} GPU(s){shown}")
    smallest = min(range(wanted), key=lambda i: gpus[i].mib)
    real = round(gpus[smallest].mib / 1024, 1)
    device = f"GPU {physical_gpu_ids((smallest,))[0]} of this node ({gpus[smallest].name})"
    if configured and abs(configured - real) > CONFIGURED_SIZE_TOLERANCE_GIB:
        raise ConfigError(
            "cluster.gpu_memory_gib",
            f"is {configured} but {device} has {real} GiB (CUDA); the memory shares are fractions of the real "
            f"device: set cluster.gpu_memory_gib=0 (read the device) or {real}",
        )
    return GpuMemory(configured or real, f"{device}, as CUDA sees it")
