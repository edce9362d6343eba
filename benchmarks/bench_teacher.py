"""Teacher server benchmark on a tiny CPU model: the server's overhead and its wire size.

    python benchmarks/bench_teacher.py [--quick] [--threads N]
    python benchmarks/bench_teacher.py --bytes-only     # table 2 alone, K = 0, 8, 64, 256 and the hidden states (no server)

1. Throughput: the same batches scored by the HF backend in-process and through the server
   (one replica, same torch threads), alternating batch by batch so that load from other
   processes hits both alike. Goal: server / in-process >= 0.95.
2. Wire bytes per scored token of the reply at K=0 (teacher.top_k=0: the sampled token's logprob
   only), 8 (the CPU demo), 64 and 256, per encoding (the request adds 4 bytes per input token).
   Goal: <= 1 KiB at K=256 (half of fp32 + int32).
3. Latency p50/p99 of single-sequence requests, in-process and through the server.
4. Server overhead per request: wall time minus the replica's own compute time (from the
   reply), which unlike the ratios above does not swing with other load on a shared CPU.
Prints a table and writes benchmarks/results/bench_teacher.json. The model is a random
Llama with a 32000-token vocabulary and no tokenizer, built offline in a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from teacher_server.client.launcher import launch_teacher
from teacher_server.client.zmq_client import TeacherClient
from teacher_server.server.backends import Backend, BackendOptions, load_backend, parsed_request
from teacher_server.wire import hidden_codec
from teacher_server.wire import protocol as P
from teacher_server.wire.score_frames import parse_score_reply, reply_frames, request_frames

RESULTS = Path(__file__).resolve().parent / "results" / "bench_teacher.json"
BYTES_RESULTS = Path(__file__).resolve().parent / "results" / "bench_teacher_bytes.json"
VOCAB = 32000
HIDDEN = 256
LAYERS = 4
SEQS_PER_BATCH = 8
SEQ_LEN = 192
PROMPT_LEN = 64
BATCHES = 6
LATENCY_REPEATS = 30
TOP_KS = (64, 256)
# Reply sizes also at K=0 (sampled_reverse_kl) and K=8 (the CPU demo's teacher.top_k).
BYTES_TOP_KS = (0, 8, 64, 256)
# (logprob dtype, id encoding): the default wire, and fp32 + int32 for comparison.
WIRES = (("float16", "elias_fano"), ("float32", "int32"))
INFLIGHT = (1, 4)
BYTES_GOAL_K256 = 1024
RATIO_GOAL = 0.95


@dataclass
class ThroughputRow:
    top_k: int
    wire: str
    max_inflight: int
    in_process_tok_s: float
    server_tok_s: float
    # server / in-process over all batches, and the median of the per-batch ratios (robust to load spikes).
    ratio: float
    median_batch_ratio: float


@dataclass
class OverheadRow:
    """Per request: wall time seen by the caller vs the replica's own compute time (robust to load)."""

    top_k: int
    wire: str
    wall_ms: float
    compute_ms: float
    overhead_ms: float
    overhead_fraction: float


@dataclass
class BytesRow:
    top_k: int
    wire: str
    reply_bytes_per_token: float


def build_model(out_dir: Path) -> Path:
    """A random tokenizer-less Llama with a realistic vocabulary size (the head dominates)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * SEQ_LEN,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(out_dir))
    return out_dir


def make_batches(n: int, seqs_per_batch: int, seed: int = 0) -> list[tuple[list[np.ndarray], list[int]]]:
    rng = np.random.default_rng(seed)
    return [
        (
            [rng.integers(0, VOCAB, size=SEQ_LEN).astype(np.int32) for _ in range(seqs_per_batch)],
            [PROMPT_LEN] * seqs_per_batch,
        )
        for _ in range(n)
    ]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def throughput(backend: Backend, client: TeacherClient, batches: list, top_k: int) -> tuple[list[float], list[float]]:
    """Seconds per batch (in-process, server) over the same batches, run alternately."""
    local_s, server_s = [], []
    for seqs, starts in batches:
        local_s.append(_timed(lambda s=seqs, f=starts: backend.score(parsed_request(s, f, top_k=top_k)).split()))
        server_s.append(_timed(lambda s=seqs, f=starts: client.score(s, f, top_k=top_k)))
    return local_s, server_s


def overhead(address: str, top_k: int, dtype: str, encoding: str, repeats: int) -> OverheadRow:
    """Median wall time of one batch request (send, wait, decode, split) minus the replica's compute_s."""
    import zmq

    seqs, starts = make_batches(1, SEQS_PER_BATCH, seed=11)[0]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    walls, computes = [], []
    try:
        for i in range(repeats + 1):
            start = time.perf_counter()
            frames = request_frames(
                i, seqs, starts, top_k=top_k, temperature=1.0, logprob_dtype=dtype, id_encoding=encoding
            )
            sock.send_multipart(frames)
            reply = sock.recv_multipart()
            header = P.decode_server_reply(reply[0])
            assert isinstance(header, P.ScoreReply), header
            parse_score_reply(header, reply[1:]).split()
            if i:  # the first one warms up
                walls.append(time.perf_counter() - start)
                computes.append(header.compute_s)
    finally:
        sock.close(linger=0)
    wall, compute = float(np.median(walls)) * 1e3, float(np.median(computes)) * 1e3
    extra = float(np.median(np.asarray(walls) - np.asarray(computes))) * 1e3
    return OverheadRow(top_k, f"{dtype}+{encoding}", wall, compute, extra, extra / wall)


def reply_bytes(backend: Backend, top_k: int) -> list[BytesRow]:
    """Reply frame bytes per scored token, header included, for every wire encoding."""
    seqs, starts = make_batches(1, SEQS_PER_BATCH, seed=7)[0]
    batch = backend.score(parsed_request(seqs, starts, top_k=top_k))
    rows = []
    for dtype in P.LOGPROB_DTYPES:
        for encoding in P.ID_ENCODINGS:
            frames = reply_frames(1, batch, vocab_size=VOCAB, logprob_dtype=dtype, id_encoding=encoding)
            per_token = sum(len(f) for f in frames) / batch.topk_ids.shape[0]
            rows.append(BytesRow(top_k, f"{dtype}+{encoding}", per_token))
    if top_k == 0:
        # teacher.output=hidden: no top-k, the sampled token's logprob and the 16-bit final hidden states.
        for hidden_dtype in hidden_codec.HIDDEN_DTYPES:
            hidden = backend.score(parsed_request(seqs, starts, top_k=0, hidden_dtype=hidden_dtype))
            frames = reply_frames(
                1, hidden, vocab_size=VOCAB, logprob_dtype="float16", id_encoding="int32", hidden_dtype=hidden_dtype
            )
            per_token = sum(len(f) for f in frames) / hidden.topk_ids.shape[0]
            rows.append(BytesRow(0, f"hidden {hidden_dtype} (H={HIDDEN})", per_token))
    return rows


def latency_ms(paths: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """p50/p99 ms of each path, sampled alternately so that load from other processes hits all alike."""
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for fn in paths.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in paths.items():
            samples[name].append(_timed(fn) * 1e3)
    out = {}
    for name, values in samples.items():
        out[f"{name}_p50_ms"] = float(np.percentile(values, 50))
        out[f"{name}_p99_ms"] = float(np.percentile(values, 99))
    return out


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 batches, 10 latency samples")
    # One thread by default: on a shared, oversubscribed CPU two OpenMP threads wait on each
    # other's time slices and the timings swing by 5x.
    parser.add_argument("--threads", type=int, default=1, help="torch threads, in-process and in the replica")
    parser.add_argument("--bytes-only", action="store_true", help="reply bytes per token only (no server)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    n_batches, repeats = (3, 10) if args.quick else (BATCHES, LATENCY_REPEATS)
    with tempfile.TemporaryDirectory(prefix="bench_teacher_") as tmp:
        model_dir = build_model(Path(tmp) / "model")
        backend = load_backend("hf", BackendOptions(str(model_dir), max_top_k=max(TOP_KS)))
        if args.bytes_only:
            report_bytes([r for k in BYTES_TOP_KS for r in reply_bytes(backend, k)], BYTES_RESULTS)
            return
        yaml_path = Path(tmp) / "teacher.yaml"
        teacher = {
            "address": "tcp://127.0.0.1:0",
            "backend": "hf",
            "model_path": str(model_dir),
            "max_top_k": max(TOP_KS),
        }
        yaml_path.write_text(json.dumps({"teacher": teacher, "server": {"torch_threads": args.threads}}))
        with launch_teacher(yaml_path, ready_timeout_s=300, log_path=Path(tmp) / "server.log") as server:
            rows, overheads, latency = run(backend, server.address, n_batches, repeats)
        bytes_rows = [r for k in BYTES_TOP_KS for r in reply_bytes(backend, k)]
    report(rows, overheads, bytes_rows, latency, args.threads)


def run(
    backend: Backend, address: str, n_batches: int, repeats: int
) -> tuple[list[ThroughputRow], list[OverheadRow], dict[str, float]]:
    batches = make_batches(n_batches, SEQS_PER_BATCH)
    rows = []
    for top_k in TOP_KS:
        for dtype, encoding in WIRES:
            for inflight in INFLIGHT:
                with TeacherClient(
                    address, max_inflight=inflight, logprob_dtype=dtype, id_encoding=encoding, top_k=top_k
                ) as client:
                    client.score(*batches[0], top_k=top_k)  # warm-up
                    local_s, server_s = throughput(backend, client, batches, top_k)
                tokens = sum(len(seqs) * (SEQ_LEN - PROMPT_LEN) for seqs, _ in batches)
                local, served = tokens / sum(local_s), tokens / sum(server_s)
                median = float(np.median(np.asarray(local_s) / np.asarray(server_s)))
                rows.append(
                    ThroughputRow(top_k, f"{dtype}+{encoding}", inflight, local, served, served / local, median)
                )
    seqs, starts = make_batches(1, 1, seed=3)[0]
    with TeacherClient(address, top_k=64) as client:
        paths = {
            "in_process": lambda: backend.score(parsed_request(seqs, starts, top_k=64)).split(),
            "server": lambda: client.score(seqs, starts),
        }
        latency = latency_ms(paths, repeats)
    overheads = [overhead(address, k, d, e, max(5, repeats // 3)) for k in TOP_KS for d, e in WIRES]
    return rows, overheads, latency


def report(
    rows: list[ThroughputRow],
    overheads: list[OverheadRow],
    bytes_rows: list[BytesRow],
    latency: dict[str, float],
    threads: int,
) -> None:
    print_table(
        f"throughput, scored tokens/s ({SEQS_PER_BATCH} x {SEQ_LEN} tokens per batch, {SEQ_LEN - PROMPT_LEN} scored each; goal ratio >= {RATIO_GOAL})",
        ["K", "wire", "max_inflight", "in-process", "server", "ratio", "median batch ratio"],
        [
            [
                str(r.top_k),
                r.wire,
                str(r.max_inflight),
                f"{r.in_process_tok_s:.0f}",
                f"{r.server_tok_s:.0f}",
                f"{r.ratio:.3f}",
                f"{r.median_batch_ratio:.3f}",
            ]
            for r in rows
        ],
    )
    print_table(
        f"server overhead per request of {SEQS_PER_BATCH} x {SEQ_LEN} tokens (median ms): wall - replica compute",
        ["K", "wire", "wall", "compute", "overhead", "fraction"],
        [
            [
                str(r.top_k),
                r.wire,
                f"{r.wall_ms:.1f}",
                f"{r.compute_ms:.1f}",
                f"{r.overhead_ms:.1f}",
                f"{r.overhead_fraction:.3f}",
            ]
            for r in overheads
        ],
    )
    print_bytes(bytes_rows)
    print_table(
        f"latency of one {SEQ_LEN}-token sequence, K=64 (ms)",
        ["path", "p50", "p99"],
        [
            ["in-process", f"{latency['in_process_p50_ms']:.1f}", f"{latency['in_process_p99_ms']:.1f}"],
            ["server", f"{latency['server_p50_ms']:.1f}", f"{latency['server_p99_ms']:.1f}"],
        ],
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": {"platform": platform.platform(), "torch_threads": threads},
        "model": {"vocab": VOCAB, "hidden": HIDDEN, "layers": LAYERS},
        "throughput": [asdict(r) for r in rows],
        "overhead": [asdict(r) for r in overheads],
        "reply_bytes": [asdict(r) for r in bytes_rows],
        "latency": latency,
    }
    RESULTS.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {RESULTS}")


def print_bytes(bytes_rows: list[BytesRow]) -> None:
    print_table(
        f"reply bytes per scored token (V={VOCAB}; goal <= {BYTES_GOAL_K256} at K=256)",
        ["K", "wire", "bytes/token"],
        [[str(r.top_k), r.wire, f"{r.reply_bytes_per_token:.1f}"] for r in bytes_rows],
    )


def report_bytes(bytes_rows: list[BytesRow], path: Path) -> None:
    print_bytes(bytes_rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"model": {"vocab": VOCAB}, "sequences": SEQS_PER_BATCH, "reply_bytes": [asdict(r) for r in bytes_rows]}
    path.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
