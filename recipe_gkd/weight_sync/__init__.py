"""Actor -> rollout weight sync: what travels (a payload), how (a transport), the driver's side, the wire, the check.

After every step actor rank 0 gathers the student (over TP) and sends it in buckets of at most
`weight_sync.bucket_mb`; every rollout worker loads the buckets as they arrive, then switches its version. No process
holds more than one bucket beyond the model itself. Two choices are made once, where the pools are built, and handed
to every worker:
- the payload (payload.py): what a version is, the actor's export stream and the engine's load of it (today the full
  student; an adapter-only or per-expert sync is another payload class);
- the transport (transports.py, weight_sync.transport): the object store, gloo or nccl on Ray, in-process locally;
  each a class with the driver's `push`, actor rank 0's `send` and a rollout worker's `receive`.
driver.py is the pools' `WeightSync` over either pool's workers, wire.py the buckets' layout, check.py the sync check
(the engines' weights and logprobs against the actor's). docs/weight_sync.md tells how to add a transport or a payload.
"""

from recipe_gkd.weight_sync.check import (
    CHECKSUM_CHUNK,
    PROBE_ROWS,
    SYNC_TOLERANCE,
    EngineTensor,
    SyncCheck,
    probe_rows,
    tensor_checksum,
    weight_mismatches,
)
from recipe_gkd.weight_sync.driver import SyncDriver
from recipe_gkd.weight_sync.payload import AdapterOnly, FullStudent, SyncPayload, build_payload
from recipe_gkd.weight_sync.transports import (
    COLLECTIVES,
    BucketStore,
    Collective,
    CollectiveChannel,
    Gloo,
    GroupAddress,
    InProcess,
    Nccl,
    ObjectStore,
    SyncCrew,
    Transport,
    WeightSender,
)
from recipe_gkd.weight_sync.wire import (
    MIB,
    TimedIterator,
    WeightSyncError,
    bucket_layout,
    bucketize,
    from_host_arrays,
    iter_buckets,
    load_draining,
    pack_bucket,
    to_host_arrays,
    unpack_bucket,
)

__all__ = [
    "CHECKSUM_CHUNK",
    "COLLECTIVES",
    "MIB",
    "PROBE_ROWS",
    "SYNC_TOLERANCE",
    "AdapterOnly",
    "BucketStore",
    "Collective",
    "CollectiveChannel",
    "EngineTensor",
    "FullStudent",
    "Gloo",
    "GroupAddress",
    "InProcess",
    "Nccl",
    "ObjectStore",
    "SyncCheck",
    "SyncCrew",
    "SyncDriver",
    "SyncPayload",
    "TimedIterator",
    "Transport",
    "WeightSender",
    "WeightSyncError",
    "bucket_layout",
    "bucketize",
    "build_payload",
    "from_host_arrays",
    "iter_buckets",
    "load_draining",
    "pack_bucket",
    "probe_rows",
    "tensor_checksum",
    "to_host_arrays",
    "unpack_bucket",
    "weight_mismatches",
]
