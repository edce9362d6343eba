"""The weight sync's wire: buckets of a weight version, their byte layout, the host arrays of the object store.

Actor rank 0 sends a version in buckets of at most `weight_sync.bucket_mb`, formed as the export yields its tensors
(one decoder layer at a time: rank 0 never holds a second copy of the whole model, benchmarks/bench_sync_memory.py);
a receiver loads each bucket as it arrives. The transports (recipe_gkd/weight_sync/transports.py) carry them: the
object store as numpy arrays (`to_host_arrays`), a gloo/nccl group as one byte buffer per bucket after its JSON layout
(`bucket_layout`, `pack_bucket`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

MIB = 1024 * 1024
ALIGN = 64  # bytes: every tensor in a collective bucket starts on a cache line


class WeightSyncError(RuntimeError):
    """The sync of one weight version failed; the message says which side and why."""


def bucketize(named: dict[str, np.ndarray], bucket_bytes: int) -> list[dict[str, np.ndarray]]:
    """Split named arrays, in order, into buckets of at most `bucket_bytes` (a larger tensor gets its own)."""
    return list(iter_buckets(named.items(), bucket_bytes))


def iter_buckets(named: Iterable[tuple[str, np.ndarray]], bucket_bytes: int) -> Iterator[dict[str, np.ndarray]]:
    """bucketize over a stream: each bucket is yielded as soon as the next tensor would overflow it."""
    current: dict[str, np.ndarray] = {}
    size = 0
    for name, array in named:
        if current and size + array.nbytes > bucket_bytes:
            yield current
            current, size = {}, 0
        current[name] = array
        size += array.nbytes
    if current:
        yield current


# Object-store buckets hold numpy arrays (Ray reads them without a copy), and numpy has no bfloat16: a
# bf16 tensor travels as its int16 bit pattern under its name with this prefix, viewed back on arrival.
BF16_PREFIX = "bf16:"


def to_host_arrays(named: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, np.ndarray]]:
    """(name, host torch tensor) -> (wire name, numpy array) for the object store, in the tensor's own dtype."""
    import torch

    for name, tensor in named:
        if tensor.dtype == torch.bfloat16:
            yield BF16_PREFIX + name, tensor.contiguous().view(torch.int16).numpy()
        else:
            yield name, np.ascontiguousarray(tensor.numpy())


def from_host_arrays(items: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The inverse of `to_host_arrays` on the receiving side: bf16 entries as torch bf16 views, the rest as is."""
    import warnings

    import torch

    for name, value in items:
        if not name.startswith(BF16_PREFIX):
            yield name, value
            continue
        with warnings.catch_warnings():
            # Arrays from Ray's object store are read-only views; the loaders only read them.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            yield name.removeprefix(BF16_PREFIX), torch.from_numpy(value).view(torch.bfloat16)


class TimedIterator:
    """Wraps an iterator of (name, tensor or array); `seconds` accumulates the time spent producing its items,
    `bytes` their sizes."""

    def __init__(self, items: Iterable[Any]) -> None:
        self._items = iter(items)
        self.seconds = 0.0
        self.bytes = 0

    def __iter__(self) -> Iterator[Any]:
        while True:
            start = time.perf_counter()
            try:
                item = next(self._items)
            except StopIteration:
                self.seconds += time.perf_counter() - start
                return
            self.seconds += time.perf_counter() - start
            self.bytes += nbytes(item[1])
            yield item


def nbytes(value: Any) -> int:
    """The bytes of a torch tensor or a numpy array."""
    return int(value.nbytes) if isinstance(value, np.ndarray) else int(value.numel() * value.element_size())


def _wire_tensor(value: Any, dtype: Any) -> Any:
    """A torch tensor of `value` (numpy arrays without a copy), floating ones cast to `dtype` when given."""
    import torch

    tensor = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor


def bucket_layout(bucket: dict[str, Any]) -> dict[str, Any]:
    """Where each tensor of a bucket sits in its byte buffer (offsets aligned to ALIGN)."""
    tensors = []
    offset = 0
    for name, tensor in bucket.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        tensors.append({"name": name, "dtype": dtype, "shape": list(tensor.shape), "offset": offset})
        offset += -(-tensor.nbytes // ALIGN) * ALIGN
    return {"nbytes": offset, "tensors": tensors}


def pack_bucket(bucket: dict[str, Any], layout: dict[str, Any], device: Any) -> Any:
    """The bucket's tensors in one uint8 buffer on `device`, at the layout's offsets."""
    import torch

    flat = torch.zeros(layout["nbytes"], dtype=torch.uint8, device=device)
    for entry in layout["tensors"]:
        tensor = bucket[entry["name"]].contiguous().reshape(-1).view(torch.uint8)
        flat[entry["offset"] : entry["offset"] + tensor.numel()].copy_(tensor)
    return flat


def unpack_bucket(flat: Any, layout: dict[str, Any]) -> dict[str, Any]:
    """Views into `flat`, one per tensor, with the sender's names, dtypes and shapes."""
    import torch

    out = {}
    for entry in layout["tensors"]:
        dtype = getattr(torch, entry["dtype"])
        count = int(np.prod(entry["shape"], dtype=np.int64))
        size = count * torch.empty((), dtype=dtype).element_size()
        view = flat[entry["offset"] : entry["offset"] + size].view(dtype)
        out[entry["name"]] = view.reshape(entry["shape"])
    return out


def load_draining(buckets: Iterator[dict[str, Any]], load: Callable[[Iterator[tuple[str, Any]]], set[str]]) -> set[str]:
    """`load` a received version's (name, tensor) stream; on its error, still receive the rest, then raise.

    Every rank of a broadcast group takes part in every broadcast: a receiver that stopped early
    would leave the sender waiting until its timeout.
    """
    stream = (item for bucket in buckets for item in bucket.items())
    try:
        loaded = load(stream)
    except Exception:
        for _ in buckets:
            pass
        raise
    leftover = sum(1 for _ in buckets)
    if leftover:
        raise WeightSyncError(f"the rollout engine stopped reading the weight stream with {leftover} buckets left")
    return loaded
