"""Actor rank 0's extra memory and time to send one weight version, with the real megatron actor.

    .venv/bin/python benchmarks/bench_sync_memory.py [--hidden 1024 --layers 12] [--bucket-mb 64]

Builds a random Llama-family student offline (fp32, untied embeddings, the char tokenizer's small vocab), starts one
MegatronActor (TP=1, CPU) in a Ray worker, and measures inside that process, per transport
path: the seconds of the object-store transport's `send_weights` (gather, convert, put every bucket into Ray's
object store) and two peaks above the process's memory at the start of the export:
- private: the peak of RssAnon (sampled every 2 ms by a thread), the copies the process makes;
- resident: VmHWM after `echo 5 > /proc/self/clear_refs`, minus VmRSS then; it also counts the
  object store's shared pages this process wrote (the buckets themselves: ~ the model size).
Prints a table and writes benchmarks/results/bench_sync_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recipe_gkd.config import load_config  # noqa: E402
from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm  # noqa: E402
from recipe_gkd.plan.ports import reserve_ports  # noqa: E402
from recipe_gkd.targets import actor_kinds  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_sync_memory.json"
MIB = 1024 * 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure_export(worker: Any, bucket_mb: int) -> dict[str, float]:
    """In the actor process (via __ray_call__): one object-store export, its peak extra memory and time."""
    import gc
    import threading

    import ray

    from recipe_gkd.config import WeightSyncConfig
    from recipe_gkd.runtime.ray_pools import RayBucketStore
    from recipe_gkd.weight_sync import FullStudent, ObjectStore

    worker.init_weight_sync(ObjectStore(WeightSyncConfig("object_store", bucket_mb), FullStudent(), RayBucketStore()))
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base_rss, base_anon = _status_kib("VmRSS"), _status_kib("RssAnon")
    peak_anon = [base_anon]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak_anon[0] = max(peak_anon[0], _status_kib("RssAnon"))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    refs = worker.send_weights()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    peak_rss = _status_kib("VmHWM")
    stored = sum(len(ray.get(r)) for r in refs)  # tensors sent, to check nothing was skipped
    del refs
    return {
        "export_s": seconds,
        "peak_private_mb": (peak_anon[0] - base_anon) / 1024,
        "peak_resident_mb": (peak_rss - base_rss) / 1024,
        "tensors": float(stored),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    import ray

    from recipe_gkd.runtime.ray_pools import ray_actor_worker_class

    spec = TinyModelSpec(
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75),
        num_layers=args.layers,
        num_heads=max(1, args.hidden // 64),
        num_kv_heads=max(1, args.hidden // 256),
        tie_word_embeddings=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_causal_lm(Path(tmp) / "student", seed=0, spec=spec)
        model_mb = sum(f.stat().st_size for f in model.glob("*.safetensors")) / MIB
        cfg = load_config(None, [f"model.student_path={model}", "actor.precision=fp32"])
        ray.init(
            address="local",
            num_cpus=2,
            num_gpus=1,
            object_store_memory=int((2 * model_mb + 256) * MIB),
            include_dashboard=False,
        )
        try:
            actor = ray.remote(num_cpus=0)(ray_actor_worker_class()).options(num_gpus=1)
            handle = actor.remote(cfg, 0, 1, "127.0.0.1", reserve_ports(1)[0], actor_kinds(cfg))
            ray.get(handle.setup.remote(), timeout=600)
            runs = [
                ray.get(handle.__ray_call__.remote(measure_export, args.bucket_mb), timeout=600)
                for _ in range(args.repeats)
            ]
            ray.get(handle.shutdown.remote(), timeout=120)
        finally:
            ray.shutdown()
    row = {
        "model_mb": model_mb,
        "bucket_mb": args.bucket_mb,
        "peak_private_mb": max(r["peak_private_mb"] for r in runs),
        "peak_resident_mb": max(r["peak_resident_mb"] for r in runs),
        "export_s": sorted(r["export_s"] for r in runs)[len(runs) // 2],
        "tensors": runs[0]["tensors"],
        "runs": runs,
    }
    print(
        f"{'model MB':>9} {'bucket MB':>9} {'peak private MB':>16} {'peak resident MB':>17} {'export s':>9} {'tensors':>8}"
    )
    print(
        f"{model_mb:>9.0f} {args.bucket_mb:>9} {row['peak_private_mb']:>16.0f} {row['peak_resident_mb']:>17.0f} "
        f"{row['export_s']:>9.3f} {row['tensors']:>8.0f}"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(row, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
