"""Actor -> rollout weight sync: bucketed, versioned, both sides awaited with a timeout.

Transport: Ray's object store. Actor rank 0 gathers the full HF-named state (over TP) and
puts it as buckets of at most `weight_sync.bucket_mb`; every rollout worker fetches the
buckets one at a time and loads them, then switches its version. Same-node fetches are
shared-memory reads and cross-node ones go over Ray's transfer; no process ever holds more
than one bucket beyond the model itself. An exception on either side fails the step with
its message, and a side that does not answer within `weight_sync.timeout_s` fails it too.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

MIB = 1024 * 1024


class WeightSyncError(RuntimeError):
    """The sync of one weight version failed; the message says which side and why."""


def bucketize(named: dict[str, np.ndarray], bucket_bytes: int) -> list[dict[str, np.ndarray]]:
    """Split named arrays, in order, into buckets of at most `bucket_bytes` (a larger tensor gets its own)."""
    buckets: list[dict[str, np.ndarray]] = []
    current: dict[str, np.ndarray] = {}
    size = 0
    for name, array in named.items():
        if current and size + array.nbytes > bucket_bytes:
            buckets.append(current)
            current, size = {}, 0
        current[name] = array
        size += array.nbytes
    if current:
        buckets.append(current)
    return buckets


def put_buckets(named: dict[str, np.ndarray], bucket_mb: int) -> list[Any]:
    """Inside the sending process: the state as a list of object refs, one per bucket."""
    import ray

    return [ray.put(bucket) for bucket in bucketize(named, bucket_mb * MIB)]


def sync_weights(
    actors: list[Any], rollouts: list[Any], version: int, bucket_mb: int, timeout_s: float
) -> dict[str, float]:
    """Push the actor's current weights to every rollout worker as `version`. Driver side.

    Every actor rank must take part (the export gathers over tensor parallelism); rank 0
    returns the bucket refs.
    """

    start = time.perf_counter()
    exports = [a.export_weight_buckets.remote(bucket_mb) for a in actors]
    buckets = _await(exports, timeout_s, f"actor export of weight version {version}")[0]
    if not buckets:
        raise WeightSyncError(f"actor rank 0 exported no weights for version {version}")
    exported = time.perf_counter()
    loads = [r.update_weights.remote(version, buckets, timeout_s) for r in rollouts]
    _await(loads, timeout_s, f"rollout load of weight version {version}")
    done = time.perf_counter()
    return {"sync_export_s": exported - start, "sync_load_s": done - exported}


def _await(refs: list[Any], timeout_s: float, what: str) -> list[Any]:
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        from recipe_gkd.workers import dump_stacks

        dumped = dump_stacks(f"weight sync {what}")  # before the cancel: the stacks show where it hung
        for ref in refs:
            ray.cancel(ref, force=False)
        raise WeightSyncError(f"{what} did not finish within weight_sync.timeout_s={timeout_s}s{dumped}") from None
    except RayError as err:
        raise WeightSyncError(f"{what} failed: {err}") from err
