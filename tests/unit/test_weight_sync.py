"""Weight sync over Ray: buckets, versions, and errors or timeouts on either side fail loudly."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from recipe_gkd.weight_sync import WeightSyncError, bucketize, sync_weights


def test_bucketize_keeps_order_and_bounds() -> None:
    rng = np.random.default_rng(0)
    named = {f"w{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate([10, 300, 5, 5, 1000, 1])}
    buckets = bucketize(named, bucket_bytes=1300)
    assert [k for b in buckets for k in b] == list(named)
    for b in buckets:
        total = sum(a.nbytes for a in b.values())
        assert total <= 1300 or len(b) == 1, "only a single oversized tensor may exceed the bound"
    assert len(bucketize(named, bucket_bytes=10**9)) == 1


class FakeActor:
    """Obeys the actor's export interface; rank 0 owns the weights."""

    def __init__(self, rank: int, named: dict[str, np.ndarray], fail: bool = False) -> None:
        self.rank, self.named, self.fail = rank, named, fail

    def export_weight_buckets(self, bucket_mb: int) -> list | None:
        from recipe_gkd.weight_sync import put_buckets

        if self.fail:
            raise RuntimeError("gather over TP failed on rank 0")
        return put_buckets(self.named, bucket_mb) if self.rank == 0 else None


class FakeRollout:
    """Obeys the rollout's update interface; records what it loaded."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.loaded: dict[str, np.ndarray] = {}
        self.version = 0

    def update_weights(self, version: int, bucket_refs: list, timeout_s: float) -> dict[str, float]:
        import ray

        time.sleep(self.delay_s)
        for ref in bucket_refs:
            self.loaded.update(ray.get(ref, timeout=timeout_s))
        self.version = version
        return {"load_s": 0.0}

    def state(self) -> tuple[int, dict[str, np.ndarray]]:
        return self.version, self.loaded


def _remote(cls: type):
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray.remote(num_cpus=0)(cls)


def _named() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {f"layer{i}.weight": rng.standard_normal((64, 64)).astype(np.float32) for i in range(8)}


def test_every_rollout_gets_every_tensor(ray_local: None) -> None:
    import ray

    named = _named()
    actors = [_remote(FakeActor).remote(r, named) for r in range(2)]
    rollouts = [_remote(FakeRollout).remote() for _ in range(3)]
    stats = sync_weights(actors, rollouts, version=5, bucket_mb=1, timeout_s=30)
    assert stats["sync_export_s"] >= 0 and stats["sync_load_s"] >= 0
    for version, loaded in ray.get([r.state.remote() for r in rollouts], timeout=30):
        assert version == 5 and loaded.keys() == named.keys()
        assert all(np.array_equal(loaded[k], named[k]) for k in named)


def test_actor_error_fails_the_sync_with_its_message(ray_local: None) -> None:
    actors = [_remote(FakeActor).remote(0, _named(), True)]
    rollouts = [_remote(FakeRollout).remote()]
    with pytest.raises(WeightSyncError, match="gather over TP failed"):
        sync_weights(actors, rollouts, version=1, bucket_mb=1, timeout_s=30)


def test_stuck_rollout_times_out_naming_the_key(ray_local: None) -> None:
    actors = [_remote(FakeActor).remote(0, _named())]
    rollouts = [_remote(FakeRollout).remote(delay_s=20)]
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"weight_sync\.timeout_s=1"):
        sync_weights(actors, rollouts, version=1, bucket_mb=1, timeout_s=1)
    assert time.monotonic() - start < 10
