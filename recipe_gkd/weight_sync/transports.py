"""How a weight version travels from actor rank 0 to every rollout worker: one class per transport, one interface.

A `Transport` is built once where the pools are built (recipe_gkd/runtime/ray_pools.py `ray_transport`, from
weight_sync.transport and the rollout backend; the in-process pools: `InProcess`) and handed to every actor rank and
rollout worker once (`init_weight_sync`; each process holds its own copy, which keeps that process's side of it, a
collective's channel). It has three sides and knows nothing of what it carries (the payload's names,
recipe_gkd/weight_sync/payload.py):
- the driver's `push(crew, version)`: which side runs when, what is awaited, the step's timings;
- actor rank 0's `send(actor)` (every rank calls: the export gathers over TP) of the payload's export stream;
- each rollout worker's `receive(engine, sent)` into the payload's load (`sent`: what rank 0's send returned).
Transports (`weight_sync.transport`):
- `ObjectStore`: rank 0 puts each bucket into Ray's object store, the workers fetch them (same node: shared-memory
  reads; other nodes: Ray's transfer). The store itself is handed in (`BucketStore`): Ray stays in ray_pools.py.
- `Gloo` / `Nccl` (`Collective`): a private torch.distributed group of actor rank 0 (rank 0) and the rollout engines'
  receivers (ranks 1..N: one per HF engine, one per TP rank of a vLLM engine), separate from megatron's and vLLM's
  groups; per bucket rank 0 broadcasts a JSON layout (names, dtypes, shapes, offsets) then the bucket as one byte
  buffer, and a zero length ends the version. Floating tensors travel in the training dtype; `nccl` keeps the
  buffers on the GPUs. benchmarks/bench_weight_sync.py measures the CPU transports.
- `InProcess`: the in-process pools' (recipe_gkd/runtime/local_pools.py): the export streamed straight into each
  worker's load, one export per worker.
An exception on either side fails the step with its message; a side that does not answer within
`weight_sync.timeout_s` fails it too (the crew's waits).
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Protocol

from recipe_gkd.config import WeightSyncConfig
from recipe_gkd.weight_sync.payload import ExportingActor, LoadingEngine, SyncPayload
from recipe_gkd.weight_sync.wire import (
    MIB,
    TimedIterator,
    WeightSyncError,
    _wire_tensor,
    bucket_layout,
    from_host_arrays,
    iter_buckets,
    pack_bucket,
    to_host_arrays,
    unpack_bucket,
)


class SyncCrew(Protocol):
    """The workers one sync touches, as the driver reaches them: a call launched on every actor rank (or rollout
    worker) at once, awaited with others (Ray: remote calls, each wait bounded by weight_sync.timeout_s and a failure
    re-raised as WeightSyncError naming `what`; in-process: direct calls, run and raised where launched)."""

    rollout_count: int

    def on_actors(self, method: str, *args: Any) -> list[Any]:
        """Launch `method(*args)` on every actor rank (results in rank order)."""
        ...

    def on_rollouts(self, method: str, *args: Any, only: int | None = None) -> list[Any]:
        """Launch `method(*args)` on every rollout worker, or on worker `only`."""
        ...

    def wait(self, pending: list[Any], what: str) -> list[Any]:
        """The results of `pending`, in launch order."""
        ...


class GroupEngine(LoadingEngine, Protocol):
    """A rollout engine whose own receivers join a collective's group (recipe_gkd/rollout/engine.py Engine)."""

    def join_weight_group(
        self, backend: str, host: str, port: int, first_rank: int, world_size: int, timeout_s: float
    ) -> None: ...


class Transport(ABC):
    """One way a weight version travels: the driver's schedule, actor rank 0's send, each rollout worker's receive.

    `settings`: weight_sync.* (bucket_mb, timeout_s); `payload`: what travels (its export, its load)."""

    kind: ClassVar[str]  # weight_sync.transport's value ("in-process" for the in-process pools)

    def __init__(self, settings: WeightSyncConfig, payload: SyncPayload) -> None:
        self.settings, self.payload = settings, payload

    @property
    def bucket_bytes(self) -> int:
        return self.settings.bucket_mb * MIB

    @property
    def setup_phase(self) -> str:
        """The set-up's phase, as a timeout names it."""
        return f"weight-sync setup ({self.kind})"

    def join_sender(self, actor: ExportingActor) -> None:
        """In each actor rank's process, once: take this rank's part of the set-up (a collective: rank 0 opens)."""
        return None  # nothing to open by default

    def join_receiver(self, engine: GroupEngine, index: int) -> None:
        """In rollout worker `index`'s process, once: take its part of the set-up (a collective: join the group)."""
        return None  # nothing to join by default

    @abstractmethod
    def push(self, crew: SyncCrew, version: int) -> dict[str, float]:
        """The driver: every rollout worker holds the actor's current weights as `version` afterwards.

        Returns {"sync_export_s", "sync_load_s", "sync_bytes"} (the bytes of one version as it travels, to each
        engine); raises WeightSyncError naming the side that failed."""

    @abstractmethod
    def send(self, actor: ExportingActor) -> Any:
        """In every actor rank (the export gathers over TP): rank 0 sends the payload's export; what it returns
        reaches the driver (and, for some transports, the receivers as `sent`)."""

    @abstractmethod
    def receive(self, engine: GroupEngine, sent: Any) -> set[str]:
        """In a rollout worker: one whole version into the payload's load; returns the names loaded."""


def load_buckets(payload: SyncPayload, engine: LoadingEngine, buckets: Iterable[dict[str, Any]]) -> set[str]:
    """A version's buckets, taken one at a time, into the payload's load (the object store's bf16 entries viewed
    back as bf16)."""
    return payload.load(engine, from_host_arrays(item for bucket in buckets for item in bucket.items()))


# ----------------------------------------------------------------------------- the actor rank's side


class WeightSender:
    """The actor rank's side of the weight sync (mixed into recipe_gkd/actor/worker.py ActorWorker): the transport
    handed down once, then one send per version, and the sync check's fingerprints of what it sends."""

    rank: int
    weight_transport: Transport

    def init_weight_sync(self, transport: Transport) -> None:
        """Keep the run's transport (its payload says what to export) and take this rank's part of its set-up."""
        self.weight_transport = transport
        transport.join_sender(self)  # type: ignore[arg-type]

    def send_weights(self) -> Any:
        """Every rank takes part in the export (TP gathers); rank 0 sends (the transport's `send`)."""
        return self.weight_transport.send(self)  # type: ignore[arg-type]

    def weight_checksums(self, dtype: str) -> dict[str, int]:
        """Per HF name, the fingerprint in `dtype` of what the payload exports (weight_sync.tensor_checksum), computed
        where each gathered tensor is (rank 0; {} elsewhere; every rank calls)."""
        import torch

        from recipe_gkd.weight_sync.check import tensor_checksum

        as_dtype = getattr(torch, dtype)
        exported = self.weight_transport.payload.export(self, on_device=True)  # type: ignore[arg-type]
        return {name: tensor_checksum(t, as_dtype) for name, t in exported}


# ----------------------------------------------------------------------------- Ray's object store


class BucketStore(Protocol):
    """Where the object-store transport keeps a version's buckets between the export and the loads
    (recipe_gkd/runtime/ray_pools.py RayBucketStore: Ray's object store)."""

    def put(self, bucket: dict[str, Any]) -> Any:
        """Store one bucket (in the sending process); returns its handle."""
        ...

    def get(self, handle: Any, timeout_s: float) -> dict[str, Any]:
        """The bucket behind `handle` (in a receiving process)."""
        ...

    def after_push(self) -> None:
        """In the driver, after each version: say once if the store has had to spill."""
        ...


class ObjectStore(Transport):
    """Rank 0 puts each bucket into the store as it fills (host copies in the training dtype, bf16 as its bit
    pattern: numpy has no bf16) and returns their handles; then every rollout worker fetches them one at a time.

    The store holds the whole version at once (two, with the next one's put: `cluster.ray_object_store_mb`)."""

    kind = "object_store"

    def __init__(self, settings: WeightSyncConfig, payload: SyncPayload, store: BucketStore) -> None:
        super().__init__(settings, payload)
        self.store = store

    def push(self, crew: SyncCrew, version: int) -> dict[str, float]:
        start = time.perf_counter()
        sent = crew.wait(crew.on_actors("send_weights"), f"actor export of weight version {version}")[0]
        if not sent or not sent["handles"]:
            raise WeightSyncError(f"actor rank 0 exported no weights for version {version}")
        exported = time.perf_counter()
        handles = sent["handles"]
        crew.wait(crew.on_rollouts("receive_weights", version, handles), f"rollout load of weight version {version}")
        done = time.perf_counter()
        self.store.after_push()
        return {"sync_export_s": exported - start, "sync_load_s": done - exported, "sync_bytes": float(sent["bytes"])}

    def send(self, actor: ExportingActor) -> dict[str, Any] | None:
        """Every rank gathers over TP; rank 0 puts the buckets as they fill and returns their handles and bytes."""
        # In the training dtype (bf16 halves the bytes of an fp32 export); the receivers decode bf16 entries.
        named = TimedIterator(to_host_arrays(self.payload.export(actor, on_device=False)))
        handles = [self.store.put(bucket) for bucket in iter_buckets(named, self.bucket_bytes)]
        return {"handles": handles, "bytes": named.bytes} if actor.rank == 0 else None

    def receive(self, engine: GroupEngine, sent: list[Any]) -> set[str]:
        """The buckets behind the handles `sent`, fetched one at a time."""
        return load_buckets(self.payload, engine, (self.store.get(h, self.settings.timeout_s) for h in sent))


# ----------------------------------------------------------------------------- gloo / nccl


@dataclass(frozen=True)
class GroupAddress:
    """A collective's group: actor rank 0's rendezvous, and the rollout engines' ranks after it."""

    host: str
    port: int
    ranks_per_engine: int  # each vLLM TP worker receives itself (config.weight_group_ranks_per_engine)
    engines: int

    @property
    def world_size(self) -> int:
        return 1 + self.ranks_per_engine * self.engines

    def first_rank(self, engine: int) -> int:
        """Rollout engine `engine`'s first rank (rank 0 sends)."""
        return 1 + engine * self.ranks_per_engine


class Collective(Transport):
    """A private torch.distributed group: rank 0 broadcasts the buckets while every rollout engine's receivers take
    them, all awaited together. Subclasses name the backend and open its process group."""

    backend: ClassVar[str]  # torch.distributed's name for it

    def __init__(
        self, settings: WeightSyncConfig, payload: SyncPayload, group: GroupAddress, wire_dtype: str | None = None
    ) -> None:
        super().__init__(settings, payload)
        self.group = group
        # Floating tensors cast to this torch dtype on the wire ("bfloat16" for a bf16 actor); None: as exported.
        self.wire_dtype = wire_dtype
        self.channel: CollectiveChannel | None = None  # actor rank 0's process only

    @property
    def setup_phase(self) -> str:
        return f"weight-sync group setup ({self.backend} on {self.group.host}:{self.group.port})"

    @staticmethod
    @abstractmethod
    def open_group(store: Any, rank: int, world_size: int, timeout: timedelta) -> tuple[Any, Any]:
        """This backend's process group over `store`, and the device its buffers live on."""

    def join_sender(self, actor: ExportingActor) -> None:
        """Rank 0 only: open the group as its rank 0 (the rollout workers join)."""
        if actor.rank == 0:
            g = self.group
            self.channel = CollectiveChannel(self.backend, g.host, g.port, 0, g.world_size, self.settings.timeout_s)

    def join_receiver(self, engine: GroupEngine, index: int) -> None:
        g = self.group
        engine.join_weight_group(
            self.backend, g.host, g.port, g.first_rank(index), g.world_size, self.settings.timeout_s
        )

    def push(self, crew: SyncCrew, version: int) -> dict[str, float]:
        start = time.perf_counter()
        sends = crew.on_actors("send_weights")
        loads = crew.on_rollouts("receive_weights", version, None)
        results = crew.wait(sends + loads, f"collective sync of weight version {version}")
        sent = results[0]
        if not sent or not sent.get("bytes"):
            raise WeightSyncError(f"actor rank 0 broadcast no weights for version {version}")
        total = time.perf_counter() - start
        return {"sync_export_s": sent["export_s"], "sync_load_s": total - sent["export_s"], "sync_bytes": sent["bytes"]}

    def send(self, actor: ExportingActor) -> dict[str, float]:
        """Every rank gathers over TP; rank 0 broadcasts the buckets to the rollout workers as they fill."""
        import torch

        # On GPUs the buckets are built from the gathered shards where they are, in the training dtype:
        # nothing goes through host memory (GPU-only, reasoned; on CPU the same code runs over gloo).
        weights = TimedIterator(self.payload.export(actor, on_device=True))
        if actor.rank != 0:
            for _ in weights:  # yields nothing here: this rank's part is the TP gathers
                pass
            return {}
        assert self.channel is not None, "call init_weight_sync() first"
        start = time.perf_counter()
        # Buckets travel in the training dtype (bf16 halves the bytes of fp32 exports).
        dtype = getattr(torch, self.wire_dtype) if self.wire_dtype else None
        sent = self.channel.send(weights, self.bucket_bytes, dtype=dtype)
        return {
            "export_s": weights.seconds,
            "send_s": time.perf_counter() - start - weights.seconds,
            "bytes": float(sent),
        }

    def receive(self, engine: GroupEngine, sent: Any) -> set[str]:
        """The engine's receivers take the broadcast from the group (draining it on a load error)."""
        return self.payload.receive(engine)


class Gloo(Collective):
    """The group over gloo: buffers in host memory (CPU runs, and GPU runs that choose it)."""

    kind = backend = "gloo"

    @staticmethod
    def open_group(store: Any, rank: int, world_size: int, timeout: timedelta) -> tuple[Any, Any]:
        import torch
        import torch.distributed as dist

        return dist.ProcessGroupGloo(store, rank, world_size, timeout), torch.device("cpu")


class Nccl(Collective):
    """The group over NCCL: buffers on each process's current GPU, GPU to GPU (GPU-only, reasoned from the code)."""

    kind = backend = "nccl"

    @staticmethod
    def open_group(store: Any, rank: int, world_size: int, timeout: timedelta) -> tuple[Any, Any]:
        import torch
        import torch.distributed as dist

        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        return group, torch.device("cuda", torch.cuda.current_device())


# The collectives by weight_sync.transport's value: a receiver in a vLLM worker is handed the name.
COLLECTIVES: dict[str, type[Collective]] = {Gloo.backend: Gloo, Nccl.backend: Nccl}


class CollectiveChannel:
    """A private process group: the sender is rank 0, the receivers (rollout engines' workers) ranks 1..N.

    It does not touch torch.distributed's default group (megatron's in the actor, vLLM's in its
    workers), so it lives beside them in one process. Every collective fails after `timeout_s`
    instead of waiting forever. Buckets are packed and received on the group's device: with
    nccl they go GPU to GPU, never through host memory.
    """

    def __init__(self, backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        import torch.distributed as dist

        kind = COLLECTIVES.get(backend)
        if kind is None:
            raise ValueError(f"weight_sync.transport={backend!r} is not a collective (gloo or nccl)")
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        self.store = store  # the master's store must outlive the group
        prefixed = dist.PrefixStore("recipe_gkd_weight_sync", store)
        self.rank, self.backend = rank, backend
        self.group, self.device = kind.open_group(prefixed, rank, world_size, timeout)

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


# ----------------------------------------------------------------------------- in one process


class InProcess(Transport):
    """The in-process pools' transport: the actor's export streamed in buckets straight into each rollout worker's
    load, one export per worker (nothing holds a second copy of the model). `send` returns the export itself, lazily:
    only a crew of direct calls in one process can hand it to a worker."""

    kind = "in-process"

    def push(self, crew: SyncCrew, version: int) -> dict[str, float]:
        start = time.perf_counter()
        export_s, sent = 0.0, 0
        for index in range(crew.rollout_count):  # one export per worker: nothing holds a second copy of the model
            weights = crew.wait(crew.on_actors("send_weights"), f"actor export of weight version {version}")[0]
            loads = crew.on_rollouts("receive_weights", version, weights, only=index)
            crew.wait(loads, f"rollout load of weight version {version}")
            export_s += weights.seconds
            sent = weights.bytes
        return {
            "sync_export_s": export_s,
            "sync_load_s": time.perf_counter() - start - export_s,
            "sync_bytes": float(sent),
        }

    def send(self, actor: ExportingActor) -> TimedIterator:
        """The export, timed as it is consumed (a host copy in the training dtype, as the object store's)."""
        return TimedIterator(self.payload.export(actor, on_device=False))

    def receive(self, engine: GroupEngine, sent: Iterator[tuple[str, Any]]) -> set[str]:
        return load_buckets(self.payload, engine, iter_buckets(sent, self.bucket_bytes))
