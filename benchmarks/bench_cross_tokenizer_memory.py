"""Peak memory of the cross-tokenizer loss on one tensor-parallel rank, against the memory plan's figure (CPU).

    .venv/bin/python benchmarks/bench_cross_tokenizer_memory.py [--tokens 512 --vocab 32768 --tp 2]

Across tokenizers (algorithm.cross_tokenizer) the actor gathers the whole vocabulary on every TP rank
(recipe_gkd/actor/objective.py `full_vocabulary`: megatron-core 0.16.1 mappings.py
`_GatherFromModelParallelRegion`, an all-gather into a new [.., V] tensor whose backward keeps this rank's
contiguous slice), from the fp32 logits megatron's Float16Module hands the loss. This runs that gather's
memory behaviour in one process (the other ranks' columns are a fixed tensor) and the real
`cross_tokenizer_loss_sum` forward and backward, per objective in its own process (its peak RSS is its own),
and prints the peak above the rank's own logits in bytes per token per vocabulary id, beside the plan's
memory_plan.XTOK_GATHERED_BYTES. The child runs with glibc's mmap threshold fixed at 64 KiB, so every tensor of
the loss is its own mapping, returned when freed: peak RSS is then the peak of the live tensors (without it,
freed blocks reused or kept in the heap made the figure swing between 0 and 24 B at this size).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from recipe_gkd.losses import cross_tokenizer_loss_sum
from recipe_gkd.plan.memory_plan import XTOK_GATHERED_BYTES

# Teacher columns per position.
TOP_K = 8
# Allocations from this size up are mmap'd and unmapped on free (glibc mallopt M_MMAP_THRESHOLD, fixed).
MMAP_THRESHOLD = 64 * 1024


def measured_bytes(objective: str, tokens: int, vocab: int, tp: int) -> float:
    """`measure` in a fresh child process (its peak RSS is its own), with the fixed mmap threshold."""
    sizes = ["--tokens", str(tokens), "--vocab", str(vocab), "--tp", str(tp)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--objective", objective, *sizes],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
        env=env,
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def peak_rss_kib() -> int:
    """This process's peak RSS (Linux VmHWM, KiB). Not getrusage's ru_maxrss: Linux carries that over exec from the
    forked parent, so a child of a large process (pytest) starts at the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def measure(objective: str, tokens: int, vocab: int, tp: int) -> float:
    """Peak RSS above the inputs of one loss forward + backward, in bytes per token per vocabulary id."""
    torch.manual_seed(0)
    batch, seq = 4, tokens // 4
    shard = vocab // tp
    local_BTv = torch.randn(batch, seq, shard).requires_grad_(True)  # this rank's fp32 logits
    others_BTw = torch.randn(batch, seq, vocab - shard)

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x_BTv: torch.Tensor) -> torch.Tensor:
            return torch.cat([x_BTv, others_BTw], dim=-1)  # the all-gather's new [B, T, V]

        @staticmethod
        def backward(ctx: object, grad_BTV: torch.Tensor) -> torch.Tensor:
            return grad_BTV[..., :shard].contiguous()  # _split_along_last_dim: this rank's columns

    # Spans as the aligner makes them: one-token spans (some with folded pieces) and two-token spans.
    span_BT = torch.ones(batch, seq, dtype=torch.long)
    span_BT[:, 1::4], span_BT[:, 2::4] = 2, 0
    ids_BTK = torch.randint(0, vocab, (batch, seq, TOP_K))
    ids_BTK[:, ::3, : TOP_K // 2] = (1 << 30) + torch.arange(TOP_K // 2)
    inputs = (
        torch.randint(0, vocab, (batch, seq)),
        torch.log_softmax(torch.randn(batch, seq, TOP_K), -1),
        ids_BTK,
        torch.full((batch, seq), -3.0),
        -torch.rand(batch, seq) * 3,
        span_BT,
        torch.ones(batch, seq, dtype=torch.bool),
    )
    base = peak_rss_kib()
    loss, _ = cross_tokenizer_loss_sum(
        Gather.apply(local_BTv), *inputs, objective=objective, divergence="forward_kl", temperature=0.9
    )
    loss.backward()
    peak = peak_rss_kib()
    return (peak - base) * 1024 / (tokens * vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--objective", choices=("span", "uld"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.objective:
        print(json.dumps(measure(args.objective, args.tokens, args.vocab, args.tp)))
        return
    for objective in ("span", "uld"):
        measured = measured_bytes(objective, args.tokens, args.vocab, args.tp)
        print(
            f"{objective:5s} {args.tokens} tokens x {args.vocab} ids at TP {args.tp}: {measured:.1f} B per token per "
            f"id above the rank's logits; the plan counts {XTOK_GATHERED_BYTES}"
        )


if __name__ == "__main__":
    main()
