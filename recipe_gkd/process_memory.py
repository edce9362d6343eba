"""A worker process's own memory, for debug.log_memory: resident MiB and, where it uses CUDA, torch's peak."""

from __future__ import annotations

MIB = 1024 * 1024


def process_memory_mb() -> float:
    """Resident memory of this process in MiB (for debug.log_memory)."""
    import psutil

    return psutil.Process().memory_info().rss / MIB


def worker_memory_mb(worker: str) -> dict[str, float]:
    """debug.log_memory of one worker: `<worker>_rss_mb`, and `<worker>_gpu_peak_mb` where it uses CUDA.

    The GPU figure is torch's peak allocation in this process (vLLM's KV cache included when its
    engine runs here), not what other processes hold on the device.
    """
    import torch

    memory = {f"{worker}_rss_mb": process_memory_mb()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        memory[f"{worker}_gpu_peak_mb"] = torch.cuda.max_memory_allocated() / MIB
    return memory
