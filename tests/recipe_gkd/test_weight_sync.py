"""Weight sync over Ray (object store) and a gloo group: buckets, versions, and errors or timeouts on either side
fail loudly."""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import pytest

from recipe_gkd.config import GKDConfig, WeightSyncConfig, load_config
from recipe_gkd.plan.ports import reserve_ports
from recipe_gkd.rollout.worker import RolloutWorker
from recipe_gkd.runtime.ray_cluster import SpillWatch, ray_env, spilled_bytes
from recipe_gkd.runtime.ray_pools import RayBucketStore, open_weight_sync
from recipe_gkd.targets import build_target
from recipe_gkd.weight_sync import (
    CollectiveChannel,
    FullStudent,
    Gloo,
    GroupAddress,
    ObjectStore,
    SyncDriver,
    TimedIterator,
    WeightSender,
    WeightSyncError,
    bucket_layout,
    bucketize,
    iter_buckets,
    pack_bucket,
    unpack_bucket,
)


def test_bucketize_keeps_order_and_bounds() -> None:
    rng = np.random.default_rng(0)
    named = {f"w{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate([10, 300, 5, 5, 1000, 1])}
    buckets = bucketize(named, bucket_bytes=1300)
    assert [k for b in buckets for k in b] == list(named)
    for b in buckets:
        total = sum(a.nbytes for a in b.values())
        assert total <= 1300 or len(b) == 1, "only a single oversized tensor may exceed the bound"
    assert len(bucketize(named, bucket_bytes=10**9)) == 1


def test_buckets_of_a_stream_are_yielded_before_the_stream_ends() -> None:
    consumed: list[str] = []

    def stream():
        for i in range(6):
            consumed.append(f"w{i}")
            yield f"w{i}", np.zeros(100, dtype=np.float32)  # 400 bytes each

    buckets = iter_buckets(stream(), bucket_bytes=800)
    assert list(next(buckets)) == ["w0", "w1"]
    assert consumed == ["w0", "w1", "w2"], "a bucket goes out once the next tensor would overflow it, not later"
    assert [list(b) for b in buckets] == [["w2", "w3"], ["w4", "w5"]]


def test_timed_iterator_counts_only_the_producer_and_the_bytes() -> None:
    import torch

    def slow():
        for i in range(3):
            time.sleep(0.05)
            yield f"t{i}", np.zeros(10, np.float32) if i else torch.zeros(3, dtype=torch.bfloat16)

    timed = TimedIterator(slow())
    for _ in timed:
        time.sleep(0.1)  # the consumer's time is not counted
    assert 0.15 <= timed.seconds < 0.25
    assert timed.bytes == 3 * 2 + 2 * 10 * 4


class FakeActor(WeightSender):
    """Obeys the actor's export interface over fixed weights (rank 0 owns them), with the real sending side."""

    def __init__(self, rank: int, named: dict[str, np.ndarray], fail: bool = False) -> None:
        self.rank, self.named, self.fail = rank, named, fail

    def iter_hf_tensors(self, on_device: bool, fp32: bool = False):
        import torch

        if self.fail:
            raise RuntimeError("gather over TP failed on rank 0")
        if self.rank == 0:
            yield from ((name, torch.from_numpy(array)) for name, array in self.named.items())

    def alive(self) -> bool:
        return True


class RecordingEngine:
    """The engine interface's weight methods; loading `bad_tensor` fails as a wrong name would."""

    def __init__(self, bad_tensor: str) -> None:
        self.bad_tensor = bad_tensor
        self.loaded: dict[str, np.ndarray] = {}

    def update_weights(self, named) -> set[str]:
        for name, tensor in named:
            if name == self.bad_tensor:
                raise KeyError(f"the rollout model has no {self.bad_tensor}")
            self.loaded[name] = np.array(tensor)  # a copy: a collective's bucket is a view, reused
        return set(self.loaded)

    def join_weight_group(self, backend: str, host: str, port: int, first_rank: int, world: int, timeout_s: float):
        self.channel = CollectiveChannel(backend, host, port, first_rank, world, timeout_s)

    def receive_weights(self) -> set[str]:
        from recipe_gkd.weight_sync import load_draining

        return load_draining(self.channel.receive(), self.update_weights)


class RecordingRollout(RolloutWorker):
    """The real rollout worker's weight sync (its transport handed down, its receive), over a recording engine."""

    def __init__(self, delay_s: float = 0.0, bad_tensor: str = "") -> None:
        cfg = load_config(None, [])
        super().__init__(cfg, 0, 1, build_target(cfg))
        self.engine = RecordingEngine(bad_tensor)
        self.delay_s = delay_s

    def receive_weights(self, version: int, sent: Any) -> dict[str, float]:
        time.sleep(self.delay_s)
        return super().receive_weights(version, sent)

    def state(self) -> tuple[int, dict[str, np.ndarray]]:
        return self.weight_version, self.engine.loaded


def _remote(cls: type):
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray.remote(num_cpus=0)(cls)


def _named() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {f"layer{i}.weight": rng.standard_normal((64, 64)).astype(np.float32) for i in range(8)}


def _object_store(actors: list, rollouts: list, timeout_s: float = 30) -> SyncDriver:
    transport = ObjectStore(
        WeightSyncConfig("object_store", bucket_mb=1, timeout_s=timeout_s), FullStudent(), RayBucketStore()
    )
    return open_weight_sync(actors, rollouts, transport, timeout_s=60)


def test_every_rollout_gets_every_tensor(ray_local: None) -> None:
    import ray

    named = _named()
    actors = [_remote(FakeActor).remote(r, named) for r in range(2)]
    rollouts = [_remote(RecordingRollout).remote() for _ in range(3)]
    stats = _object_store(actors, rollouts).push(5)
    assert stats["sync_export_s"] >= 0 and stats["sync_load_s"] >= 0
    for version, loaded in ray.get([r.state.remote() for r in rollouts], timeout=30):
        assert version == 5 and loaded.keys() == named.keys()
        assert all(np.array_equal(loaded[k], named[k]) for k in named)


def test_actor_error_fails_the_sync_with_its_message(ray_local: None) -> None:
    actors = [_remote(FakeActor).remote(0, _named(), True)]
    rollouts = [_remote(RecordingRollout).remote()]
    with pytest.raises(WeightSyncError, match="gather over TP failed"):
        _object_store(actors, rollouts).push(1)


def test_stuck_rollout_times_out_naming_the_key(ray_local: None) -> None:
    actors = [_remote(FakeActor).remote(0, _named())]
    rollouts = [_remote(RecordingRollout).remote(delay_s=20)]
    sync = _object_store(actors, rollouts, timeout_s=1)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"weight_sync\.timeout_s=1"):
        sync.push(1)
    assert time.monotonic() - start < 10


# ---------------------------------------------------------------- collective transport (gloo)


def test_pack_unpack_roundtrip_mixed_dtypes_and_shapes() -> None:
    import torch

    rng = np.random.default_rng(2)
    bucket = {
        "a": torch.from_numpy(rng.standard_normal((3, 5)).astype(np.float32)),
        "b": torch.from_numpy(rng.integers(-9, 9, 7).astype(np.int64)),
        "c": torch.from_numpy(rng.standard_normal(()).astype(np.float64)),
        "d": torch.zeros((0, 4), dtype=torch.float32),
        "e": torch.from_numpy(rng.standard_normal((2, 3)).astype(np.float16)),
        "f": torch.randn(5, 3, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),
    }
    layout = bucket_layout(bucket)
    assert all(t["offset"] % 64 == 0 for t in layout["tensors"])
    out = unpack_bucket(pack_bucket(bucket, layout, torch.device("cpu")), layout)
    assert list(out) == list(bucket)
    for name, tensor in bucket.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name], tensor)


def test_floating_tensors_travel_in_the_wire_dtype() -> None:
    import torch

    from recipe_gkd.weight_sync.wire import _wire_tensor

    weights = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    wire = _wire_tensor(weights, torch.bfloat16)
    assert wire.dtype == torch.bfloat16 and torch.equal(wire, torch.from_numpy(weights).to(torch.bfloat16))
    assert _wire_tensor(np.arange(3), torch.bfloat16).dtype == torch.int64  # integers as they are
    assert _wire_tensor(weights, None).dtype == torch.float32


def _group(actors: list, rollouts: list, timeout_s: float = 30) -> SyncDriver:
    """A gloo transport handed to the workers (its group joined) and the driver's side over them."""
    import ray

    # Every actor's process started first: a short group timeout bounds the join, not the workers' start.
    ray.get([a.__ray_ready__.remote() for a in [*actors, *rollouts]], timeout=120)
    group = GroupAddress("127.0.0.1", reserve_ports(1)[0], ranks_per_engine=1, engines=len(rollouts))
    transport = Gloo(WeightSyncConfig("gloo", bucket_mb=1, timeout_s=timeout_s), FullStudent(), group)
    return open_weight_sync(actors, rollouts, transport, timeout_s=60)


def test_gloo_broadcast_reaches_every_rollout_bit_for_bit(ray_local: None) -> None:
    import ray

    rng = np.random.default_rng(3)
    named = _named() | {"big.weight": rng.standard_normal((700, 700)).astype(np.float32)}  # > 1 MiB: own bucket
    actors = [_remote(FakeActor).remote(r, named) for r in range(2)]
    rollouts = [_remote(RecordingRollout).remote() for _ in range(3)]
    sync = _group(actors, rollouts)
    for version in (1, 2):
        stats = sync.push(version)
        assert stats["sync_load_s"] >= 0
    for version, loaded in ray.get([r.state.remote() for r in rollouts], timeout=30):
        assert version == 2 and list(loaded) == list(named)
        assert all(np.array_equal(loaded[k], named[k]) for k in named)


def test_gloo_load_error_fails_the_sync_promptly_with_its_message(ray_local: None) -> None:
    import ray

    big = {"big.weight": np.ones((700, 700), dtype=np.float32)}  # a second bucket after the failing one
    actors = [_remote(FakeActor).remote(0, _named() | big)]
    rollouts = [_remote(RecordingRollout).remote(), _remote(RecordingRollout).remote(bad_tensor="layer0.weight")]
    sync = _group(actors, rollouts)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"has no layer0\.weight"):
        sync.push(1)
    assert time.monotonic() - start < 20
    # The failing receiver drained the broadcast: rank 0 is free again, not blocked until gloo's 30 s timeout.
    assert ray.get(actors[0].alive.remote(), timeout=5)


def test_gloo_stuck_rollout_times_out_naming_the_key(ray_local: None) -> None:
    actors = [_remote(FakeActor).remote(0, _named())]
    rollouts = [_remote(RecordingRollout).remote(delay_s=120)]
    # The group's rendezvous is bounded by the same timeout: 2 s was too short for it on a loaded 2-core CI machine.
    sync = _group(actors, rollouts, timeout_s=8)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"weight_sync\.timeout_s=8"):
        sync.push(1)
    # Cut at the timeout, long before the stuck rollout's 120 s (a loaded 2-core CI machine took > 15 s once).
    assert time.monotonic() - start < 60


# Ray's object store spilling (a whole weight version larger than the store): the run says so once, in its own
# words; the raylet's own "Spilled N MiB" lines are off.


def test_the_raylet_does_not_print_its_spill_lines() -> None:
    assert ray_env(GKDConfig())["RAY_verbose_spill_logs"] == "0"


def test_spilling_is_said_once_naming_the_key(ray_local: None) -> None:
    import ray

    watch = SpillWatch(store_mb=256)
    if spilled_bytes() == 0:
        assert watch.check() is None, "nothing spilled yet: nothing to say"
    # The session's object store holds 256 MiB: 320 MiB of live objects must spill.
    refs = [ray.put(np.ones(32 * 1024 * 1024 // 8)) for _ in range(10)]
    assert spilled_bytes() > 0
    # The raylet is asked at calls 1, 2, 4, ...: within the next 3 calls it is asked at least once.
    warnings = [w for w in (watch.check() for _ in range(3)) if w]
    assert len(warnings) == 1 and warnings[0].startswith("warning: Ray's object store is full and has spilled")
    assert "cluster.ray_object_store_mb=256" in warnings[0] and "weight_sync.transport=gloo" in warnings[0]
    assert all(watch.check() is None for _ in range(8)), "said once"
    del refs


def test_object_store_arrays_carry_bf16_as_its_bit_pattern() -> None:
    """numpy has no bfloat16: bf16 tensors cross the object store as int16 and come back bit for bit."""
    import torch

    from recipe_gkd.weight_sync import from_host_arrays, to_host_arrays

    generator = torch.Generator().manual_seed(0)
    named = {
        "model.embed_tokens.weight": torch.randn(7, 5, generator=generator).to(torch.bfloat16),
        "model.norm.weight": torch.randn(5, generator=generator),
    }
    wire = dict(to_host_arrays(named.items()))
    assert wire["bf16:model.embed_tokens.weight"].dtype == np.int16 and wire["model.norm.weight"].dtype == np.float32
    for array in wire.values():
        array.setflags(write=False)  # as Ray's object store hands them out
    back = dict(from_host_arrays(wire.items()))
    assert back.keys() == named.keys()
    assert back["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(back["model.embed_tokens.weight"], named["model.embed_tokens.weight"])
    assert np.array_equal(back["model.norm.weight"], named["model.norm.weight"].numpy())


# ----------------------------------------------------------------------------- the weight check's checksums


def reference_checksum(values: np.ndarray, bits_dtype: type) -> int:
    """tensor_checksum written again with Python's integers, element by element, from numpy's bit patterns."""
    total = 0
    width = (1 << (8 * np.dtype(bits_dtype).itemsize)) - 1
    for raw in values.view(bits_dtype).reshape(-1).tolist():
        x = raw & width
        y = x * 0x5BD1E995
        x = (y ^ (y >> 29)) & ((1 << 31) - 1)
        y = x * 0x27D4EB2F
        x = (y ^ (y >> 31)) & ((1 << 31) - 1)
        total += x
    return total


def test_the_checksum_equals_a_python_reference_and_is_additive() -> None:
    import torch

    from recipe_gkd.weight_sync import CHECKSUM_CHUNK, tensor_checksum

    rng = np.random.default_rng(0)
    values = rng.standard_normal(5000).astype(np.float32) * 0.02
    fp32 = torch.from_numpy(values)
    assert tensor_checksum(fp32, torch.float32) == reference_checksum(values, np.int32)
    bf16_bits = fp32.to(torch.bfloat16).view(torch.int16).numpy()
    assert tensor_checksum(fp32, torch.bfloat16) == reference_checksum(bf16_bits, np.int16)
    # Fused or sharded: the sum of the parts; any order; zero padding adds nothing.
    parts = torch.split(fp32, [1000, 2500, 1500])
    assert tensor_checksum(fp32, torch.float32) == sum(tensor_checksum(p, torch.float32) for p in parts)
    assert tensor_checksum(fp32.flip(0), torch.float32) == tensor_checksum(fp32, torch.float32)
    padded = torch.cat([fp32, torch.zeros(64)])
    assert tensor_checksum(padded, torch.bfloat16) == tensor_checksum(fp32, torch.bfloat16)
    # An fp32 engine holding bf16 weights (widened exactly) has the bf16 tensor's checksum in bf16.
    assert tensor_checksum(fp32.to(torch.bfloat16).float(), torch.bfloat16) == tensor_checksum(fp32, torch.bfloat16)
    # One value one bf16 step away changes it.
    moved = fp32.to(torch.bfloat16).clone()
    moved[1234] = torch.nextafter(moved[1234].float(), torch.tensor(1.0)).to(torch.bfloat16)
    if moved[1234] == fp32.to(torch.bfloat16)[1234]:  # nextafter in fp32 may round back: step the bits
        moved.view(torch.int16)[1234] += 1
    assert tensor_checksum(moved, torch.bfloat16) != tensor_checksum(fp32, torch.bfloat16)
    # Chunks: a tensor longer than a chunk sums its chunks (the same as one pass).
    long = torch.from_numpy(rng.standard_normal(CHECKSUM_CHUNK + 3).astype(np.float32))
    head, tail = long[:CHECKSUM_CHUNK], long[CHECKSUM_CHUNK:]
    assert tensor_checksum(long, torch.float32) == tensor_checksum(head, torch.float32) + tensor_checksum(
        tail, torch.float32
    )


def test_weight_mismatches_name_what_differs() -> None:
    from recipe_gkd.weight_sync import EngineTensor, weight_mismatches

    actor = {"q": 10, "k": 20, "v": 30, "norm": 7}
    fused = EngineTensor("qkv_proj.weight", (("q", 1), ("k", 1), ("v", 1)), 60)
    norm = EngineTensor("norm", (("norm", 1),), 7)
    assert weight_mismatches(actor, [fused, norm]) == []
    # KV heads replicated over TP workers: k and v counted twice.
    replicated = EngineTensor("qkv_proj.weight", (("q", 1), ("k", 2), ("v", 2)), 110)
    assert weight_mismatches(actor, [replicated, norm]) == []
    stale = EngineTensor("qkv_proj.weight", (("q", 1), ("k", 1), ("v", 1)), 61)
    assert weight_mismatches(actor, [stale, norm]) == ["qkv_proj.weight differs from the actor's q+k+v"]
    assert weight_mismatches(actor, [fused]) == ["no engine tensor holds norm"]
    extra = EngineTensor("bias", (("q_bias", 1),), 0)
    assert weight_mismatches(actor, [fused, norm, extra]) == ["bias holds q_bias, which the actor does not export"]
