"""Context parallelism's activation memory: each rank's peak in a long-trace step at CP=2 against CP=1 (CPU, gloo).

    .venv/bin/python benchmarks/bench_cp_memory.py [--seq-len 4096 --hidden 256 --layers 4 --vocab 8192]

Builds a random Llama-family student offline (GQA: 8 query heads over 4 groups), then per CP size launches one
process per rank running MegatronActor (TP=1, one data-parallel replica split over `cp` context-parallel ranks)
for two steps on full-length sequences with a teacher's top-k, and measures the second step on each rank with
bench_actor_memory's tracker of live tensor storages (activations, logits, the gathered keys and values,
temporaries). Writes benchmarks/results/bench_cp_memory.json and prints the table docs/context_parallel.md quotes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

RESULTS = ROOT / "benchmarks" / "results" / "bench_cp_memory.json"
MIB = 1024 * 1024
CP_SIZES = (1, 2)
PROMPT = 64
TIMEOUT_S = 1800


def worker(args: argparse.Namespace) -> None:
    from bench_actor_memory import LiveTensorBytes, full_length_sequence

    from recipe_gkd.actor.megatron_actor import MegatronActor
    from recipe_gkd.batch import TrainShard
    from recipe_gkd.config import load_config
    from recipe_gkd.targets import actor_kinds

    cfg = load_config(
        None,
        [
            f"model.student_path={args.student}",
            "actor.micro_batch_size=1",
            f"actor.gpus_per_node={args.world}",
            f"cluster.gpus_per_node={args.world + 2}",
            f"actor.megatron.cp={args.world}",
            "actor.megatron.distributed_optimizer=false",
            "actor.precision=fp32",
            "data.train_batch_size=1",
            f"data.max_prompt_length={PROMPT}",
            f"rollout.sampling.max_new_tokens={args.seq_len - PROMPT}",
        ],
    )
    actor = MegatronActor(cfg, args.rank, args.world, "127.0.0.1", args.port, actor_kinds(cfg))
    actor.setup()
    sequence = full_length_sequence(0, args.seq_len, PROMPT, actor.arch.vocab_size, cfg.teacher.top_k)
    shard = [TrainShard(step=0, weight_version=0, sequences=[sequence])]
    actor.train_step(shard)  # Adam's moments exist from here on
    start = time.perf_counter()
    with LiveTensorBytes() as tracker:
        stats = actor.train_step(shard)
    seconds = time.perf_counter() - start
    actor.shutdown()
    out = {"rank": args.rank, "step_peak_mib": tracker.peak / MIB, "loss": stats["loss"], "step_s": seconds}
    Path(args.out).write_text(json.dumps(out))


def launch(student: Path, cp: int, seq_len: int, workdir: Path) -> list[dict[str, Any]]:
    from recipe_gkd.plan.ports import reserve_ports

    port = reserve_ports(1)[0]
    procs = []
    for rank in range(cp):
        cmd = [sys.executable, __file__, "--worker", f"--rank={rank}", f"--world={cp}", f"--port={port}"]
        cmd += [f"--student={student}", f"--seq-len={seq_len}", f"--out={workdir / f'cp{cp}_rank{rank}.json'}"]
        procs.append(subprocess.Popen(cmd, env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **_env()}))
    for proc in procs:
        if proc.wait(timeout=TIMEOUT_S) != 0:
            raise RuntimeError(f"cp={cp}: a rank exited {proc.returncode}")
    return [json.loads((workdir / f"cp{cp}_rank{rank}.json").read_text()) for rank in range(cp)]


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)} | {"PYTHONPATH": str(ROOT)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--student", default="")
    parser.add_argument("--out", default="")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from bench_actor_memory import build_student

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        student = build_student(Path(tmp), args.hidden, args.layers, args.vocab)
        for cp in CP_SIZES:
            ranks = launch(student, cp, args.seq_len, Path(tmp))
            rows.append({"cp": cp, "ranks": ranks, "max_step_peak_mib": max(r["step_peak_mib"] for r in ranks)})
    base = rows[0]["max_step_peak_mib"]
    print(
        f"sequence of {args.seq_len} tokens, hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}, fp32"
    )
    print("| cp | per-rank step peak (MiB) | vs cp=1 | loss | step s (slowest rank) |")
    print("|---|---|---|---|---|")
    for row in rows:
        peak = row["max_step_peak_mib"]
        loss = row["ranks"][0]["loss"]
        seconds = max(r["step_s"] for r in row["ranks"])
        print(f"| {row['cp']} | {peak:.1f} | {peak / base:.2f} | {loss:.6f} | {seconds:.2f} |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
