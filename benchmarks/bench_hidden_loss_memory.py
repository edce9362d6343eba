"""Peak memory of the hidden-state loss (teacher.output=hidden) against a naive full-vocabulary loss (CPU).

    .venv/bin/python benchmarks/bench_hidden_loss_memory.py [--tokens 4096 --vocab 32000 --hidden 512]

Each variant runs in its own process (peak RSS is per process): jsd's forward and backward over
`tokens` positions, from fp32 student logits and the teacher's hidden states and head. The naive
loss builds both log-softmaxes and the mixture with autograd (about ten [T, V] fp32 tensors); the
chunked one (recipe_gkd/losses/hidden.py) holds the [T, V] gradient and DEFAULT_CHUNK_BYTES of chunks.
"""

from __future__ import annotations

import argparse
import math
import resource
import subprocess
import sys
import time

import torch


def run_one(variant: str, tokens: int, vocab: int, hidden: int) -> None:
    from recipe_gkd.losses import hidden_gkd_loss_sum

    torch.manual_seed(0)
    logits_BTV = torch.randn(1, tokens, vocab).requires_grad_(True)
    hidden_BTH = torch.randn(1, tokens, hidden)
    head_VH = torch.randn(vocab, hidden) * 0.05
    mask_BT = torch.ones(1, tokens, dtype=torch.bool)
    base_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    if variant == "chunked":
        loss, _ = hidden_gkd_loss_sum(logits_BTV, hidden_BTH, head_VH, mask_BT, divergence="jsd", beta=0.5)
    else:
        log_p = logits_BTV.log_softmax(-1)
        log_q = (hidden_BTH @ head_VH.T).log_softmax(-1)
        log_m = torch.logaddexp(log_p, log_q) - math.log(2.0)
        loss = 0.5 * (log_q.exp() * (log_q - log_m)).sum() + 0.5 * (log_p.exp() * (log_p - log_m)).sum()
    loss.backward()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    logits_mib = tokens * vocab * 4 / 2**20
    print(
        f"{variant:8s} logits {logits_mib:.0f} MiB; peak RSS above the inputs {peak_mib - base_mib:.0f} MiB; "
        f"{time.perf_counter() - start:.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--variant", choices=("chunked", "naive"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        run_one(args.variant, args.tokens, args.vocab, args.hidden)
        return
    for variant in ("chunked", "naive"):
        sizes = ["--tokens", str(args.tokens), "--vocab", str(args.vocab), "--hidden", str(args.hidden)]
        subprocess.run([sys.executable, __file__, "--variant", variant, *sizes], check=True)


if __name__ == "__main__":
    main()
