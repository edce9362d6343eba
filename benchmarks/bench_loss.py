"""Peak memory and time of recipe_gkd.losses.gkd_loss vs a full-vocabulary reference written the TRL way.

Each (implementation, V, K, T) case runs forward + backward in a fresh subprocess. Peak memory is the
process's peak resident set size (VmHWM in /proc/self/status), reset with `echo 5 > /proc/self/clear_refs`
right after the inputs are built, minus the resident size at that moment: the extra memory the loss and its
backward take, the [B,T,V] bf16 gradient of the logits included (both implementations produce it).
Time is the median of --repeats timed forward + backward runs after that first one. By default T=8192 runs
for gkd_loss only (the reference would not fit in this machine's memory).

    .venv/bin/python benchmarks/bench_loss.py                    # CPU-sized default grid, a few minutes
    .venv/bin/python benchmarks/bench_loss.py --seq 2048 --vocab 152064 --topk 64 256 --ours-only-seq 16384

Writes benchmarks/results/bench_loss.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from recipe_gkd.losses import gkd_loss

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "bench_loss.json"
MEMORY_METHOD = (
    "peak RSS of a fresh subprocess per case: VmHWM after `echo 5 > /proc/self/clear_refs` (reset once the "
    "inputs exist) minus VmRSS at the reset; includes the [B,T,V] bf16 logits gradient"
)
KIB = 1024
MIB = 2**20
BF16_BYTES = 2
BETA = 0.5
TEMPERATURE = 1.0
SEED = 0
# Default CPU grid: the K and V at a sequence length a 2-core CPU runs in minutes.
DEFAULT_VOCABS = (32768, 152064)
DEFAULT_TOPKS = (64, 256)
DEFAULT_SEQS = (1024,)
# Longer sequences run for gkd_loss alone: the reference would need ~30 GiB at T=4096, V=152k.
DEFAULT_OURS_ONLY_SEQS = (8192,)


def reference_trl_loss(
    student_logits_BTV: torch.Tensor,
    teacher_logprobs_BTK: torch.Tensor,
    teacher_ids_BTK: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    beta: float,
    temperature: float,
) -> torch.Tensor:
    """TRL's generalized_jsd_loss on fp32-upcast full logits and a dense teacher built from its top-k.

    The dense teacher spreads the tail mass 1 - sum(top-k) uniformly over the other V - K ids (a full
    distribution, so F.kl_div sees no -inf target). Objective differs from ours in the tail only.
    """
    vocab, top_k = student_logits_BTV.shape[-1], teacher_ids_BTK.shape[-1]
    student_log_probs = F.log_softmax(student_logits_BTV.float() / temperature, dim=-1)
    top_mass_log_BT1 = torch.logsumexp(teacher_logprobs_BTK.float(), dim=-1, keepdim=True)
    tail_each_BT1 = torch.log(-torch.expm1(top_mass_log_BT1)) - math.log(vocab - top_k)
    teacher_log_probs = tail_each_BT1.expand_as(student_log_probs).clone()
    teacher_log_probs.scatter_(-1, teacher_ids_BTK, teacher_logprobs_BTK.float())
    beta_t = torch.tensor(beta, dtype=student_log_probs.dtype)
    mixture_log_probs = torch.logsumexp(
        torch.stack([student_log_probs + torch.log(1 - beta_t), teacher_log_probs + torch.log(beta_t)]), dim=0
    )
    kl_teacher = F.kl_div(mixture_log_probs, teacher_log_probs, reduction="none", log_target=True)
    kl_student = F.kl_div(mixture_log_probs, student_log_probs, reduction="none", log_target=True)
    jsd = beta * kl_teacher + (1 - beta) * kl_student
    jsd = jsd[loss_mask_BT]
    return jsd.sum() / loss_mask_BT.sum()


def ours_loss(
    student_logits_BTV: torch.Tensor,
    teacher_logprobs_BTK: torch.Tensor,
    teacher_ids_BTK: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    beta: float,
    temperature: float,
) -> torch.Tensor:
    return gkd_loss(
        student_logits_BTV,
        teacher_logprobs_BTK,
        teacher_ids_BTK,
        loss_mask_BT,
        divergence="jsd",
        beta=beta,
        temperature=temperature,
        tail=True,
    )


IMPLEMENTATIONS = {"ours": ours_loss, "reference": reference_trl_loss}


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def run_child(impl: str, batch: int, seq: int, vocab: int, top_k: int, repeats: int, threads: int) -> dict:
    """One case in this (fresh) process: peak extra memory of the first forward+backward, then timings."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(SEED)
    student_logits_BTV = torch.empty(batch, seq, vocab, dtype=torch.bfloat16)
    for b in range(batch):  # fill row by row: no fp32 [B,T,V] temporary before the baseline
        student_logits_BTV[b] = torch.randn(seq, vocab, generator=gen).mul_(2.0).to(torch.bfloat16)
    teacher_full_logits_TV = torch.randn(seq, vocab, generator=gen)
    teacher_logprobs_TV = teacher_full_logits_TV.mul_(2.0).log_softmax(-1)
    top = teacher_logprobs_TV.topk(top_k, dim=-1)
    teacher_logprobs_BTK = top.values.expand(batch, seq, top_k).contiguous()
    teacher_ids_BTK = top.indices.expand(batch, seq, top_k).contiguous()
    del teacher_full_logits_TV, teacher_logprobs_TV, top
    loss_mask_BT = torch.ones(batch, seq, dtype=torch.bool)
    student_logits_BTV.requires_grad_(True)
    loss_fn = IMPLEMENTATIONS[impl]
    args = (student_logits_BTV, teacher_logprobs_BTK, teacher_ids_BTK, loss_mask_BT, BETA, TEMPERATURE)

    gc.collect()
    _reset_peak_rss()
    baseline_kib = _proc_status_kib("VmRSS")
    start = time.perf_counter()
    loss = loss_fn(*args)
    loss.backward()
    first_s = time.perf_counter() - start
    peak_kib = _proc_status_kib("VmHWM")
    loss_value = loss.item()
    del loss

    times = []
    for _ in range(repeats):
        student_logits_BTV.grad = None
        gc.collect()
        start = time.perf_counter()
        loss_fn(*args).backward()
        times.append(time.perf_counter() - start)
    return {
        "impl": impl,
        "batch": batch,
        "seq": seq,
        "vocab": vocab,
        "top_k": top_k,
        "loss": loss_value,
        "peak_extra_bytes": (peak_kib - baseline_kib) * KIB,
        "inputs_bytes": baseline_kib * KIB,
        "first_fwd_bwd_s": first_s,
        "fwd_bwd_s": statistics.median(times) if times else first_s,
        "threads": threads,
    }


def run_case(impl: str, batch: int, seq: int, vocab: int, top_k: int, repeats: int, threads: int) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        impl,
        "--batch",
        str(batch),
        "--seq",
        str(seq),
        "--vocab",
        str(vocab),
        "--topk",
        str(top_k),
        "--repeats",
        str(repeats),
        "--threads",
        str(threads),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    completed = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if completed.returncode != 0:
        raise RuntimeError(
            f"{impl} V={vocab} K={top_k} T={seq} failed (rc {completed.returncode}):\n{completed.stderr[-4000:]}"
        )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def format_table(rows: list[dict]) -> str:
    header = (
        f"{'V':>7} {'K':>4} {'B*T':>6} | {'ours MiB':>9} {'ours-grad':>9} {'ref MiB':>9} {'mem ratio':>9} | "
        f"{'ours s':>7} {'ref s':>7} {'time ratio':>10}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        ours, ref = row["ours"], row.get("reference")
        ours_mib = ours["peak_extra_bytes"] / MIB
        # What the loss needs beyond the [B,T,V] bf16 gradient that any implementation returns.
        working_mib = ours_mib - ours["batch"] * ours["seq"] * ours["vocab"] * BF16_BYTES / MIB
        ref_mib = f"{ref['peak_extra_bytes'] / MIB:9.0f}" if ref else f"{'-':>9}"
        mem_ratio = f"{ours['peak_extra_bytes'] / ref['peak_extra_bytes']:9.3f}" if ref else f"{'-':>9}"
        ref_s = f"{ref['fwd_bwd_s']:7.2f}" if ref else f"{'-':>7}"
        time_ratio = f"{ours['fwd_bwd_s'] / ref['fwd_bwd_s']:10.3f}" if ref else f"{'-':>10}"
        lines.append(
            f"{ours['vocab']:>7} {ours['top_k']:>4} {ours['batch'] * ours['seq']:>6} | {ours_mib:9.0f} {working_mib:9.0f} {ref_mib} "
            f"{mem_ratio} | {ours['fwd_bwd_s']:7.2f} {ref_s} {time_ratio}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, nargs="+", default=list(DEFAULT_VOCABS))
    parser.add_argument("--topk", type=int, nargs="+", default=list(DEFAULT_TOPKS))
    parser.add_argument("--seq", type=int, nargs="+", default=list(DEFAULT_SEQS))
    parser.add_argument(
        "--ours-only-seq",
        type=int,
        nargs="*",
        default=list(DEFAULT_OURS_ONLY_SEQS),
        help="T values run without the reference",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="timed forward+backward runs after the first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--impls", nargs="+", default=["ours", "reference"], choices=sorted(IMPLEMENTATIONS))
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    parser.add_argument("--child", choices=sorted(IMPLEMENTATIONS), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        result = run_child(args.child, args.batch, args.seq[0], args.vocab[0], args.topk[0], args.repeats, args.threads)
        print(json.dumps(result))
        return

    plan = [(seq, args.impls) for seq in args.seq] + [(seq, ["ours"]) for seq in args.ours_only_seq]
    rows = []
    for seq, impls in plan:
        for vocab in args.vocab:
            for top_k in args.topk:
                row = {}
                for impl in impls:
                    row[impl] = run_case(impl, args.batch, seq, vocab, top_k, args.repeats, args.threads)
                    print(
                        f"  {impl:9} V={vocab} K={top_k} T={seq}: "
                        f"{row[impl]['peak_extra_bytes'] / MIB:.0f} MiB, {row[impl]['fwd_bwd_s']:.2f} s",
                        flush=True,
                    )
                rows.append(row)
    print(f"\ngkd_loss (jsd beta={BETA}, tail=True, bf16 logits) vs TRL-style full-vocab reference, forward+backward")
    print(f"memory: {MEMORY_METHOD}")
    print(f"time: median of {args.repeats} runs, {args.threads} threads, CPU shared with other work")
    print("ours-grad: ours minus the [B,T,V] bf16 logits gradient (the loss's own working memory)\n")
    print(format_table([row for row in rows if "ours" in row]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"memory_method": MEMORY_METHOD, "beta": BETA, "temperature": TEMPERATURE, "cases": rows}, indent=2)
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
