"""Stage 0 of the self-check: what runs with torch, transformers, megatron-core and the project alone.

No Ray, no vLLM, one process, GPU 0 (or the CPU, at the rehearsal's sizes). Each check is isolated: one that
raises records its traceback and the rest still run; the stage has a time budget, and a check whose estimate
no longer fits in what is left is recorded as skipped with the seconds it lacked.

- `device`: nvidia-smi's index, uuid, memory.total and MIG mode beside `torch.cuda.mem_get_info()` and the
  visible-device variables: the size the memory plan reads (recipe_gkd/plan/gpu_memory.py) against what CUDA gives;
  and every installed distribution into <out>/image_packages.txt (what stage 1 must carry is the rest);
- `model`: the random model of the stage's shape built offline from a transformers config (kept for a rerun);
- `actor_*`: recipe_gkd/selfcheck/stage0_actor.py `actor_check`, one per actor.megatron.recompute
  (teacher.output=topk) and one with teacher.output=hidden;
- `loss_topk`, `loss_hidden`, `loss_span`: forward + backward of the three losses on fp32 logits (what megatron's
  Float16Module hands the loss) at each of the stage's token counts: seconds and peak against the plan's lines;
- `loop`: stage0_actor.py `loop_check`, a few steps of `gkd.train` on the in-process pools;
- `learn_demo`, `learn_tools`: recipe_gkd/selfcheck/stage0_learn.py, two CPU demo presets as shipped on the GPU
  in bf16: the held-out accuracy's gain against what the preset reaches on a CPU.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from recipe_gkd.selfcheck.record import GIB, Check, nvidia_smi_rows
from recipe_gkd.selfcheck.sizes import Sizes

RECOMPUTE = ("none", "selective", "full")
VISIBLE_DEVICE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
SMI_QUERY = "index,uuid,memory.total,mig.mode.current"
# A check's seconds at the GPU sizes, about twice those measured on one H200 (the stage's first GPU run: device
# 4.6, model 20, actor 3-11, each loss < 1, loop 23, learn_demo 26, learn_tools 98), scaled down for the smaller
# sizes: the budget skips a check whose estimate no longer fits. The actor's include building the model once.
GPU_ESTIMATE_S = {
    "device": 10.0,
    "model": 40.0,
    "actor": 25.0,
    "loss_topk": 10.0,
    "loss_hidden": 10.0,
    "loss_span": 10.0,
    "loop": 60.0,
    "learn_demo": 60.0,
    "learn_tools": 200.0,
}


@dataclass(frozen=True)
class StageCheck:
    """One check of the stage: its name, its estimated seconds, the call that runs it."""

    name: str
    estimate_s: float
    run: Callable[[], Check]


def stage0_checks(out: Path, models: Path, sizes: Sizes) -> list[StageCheck]:
    """Every check of stage 0 in the order it runs (cheap and independent first, the whole loop last)."""
    from recipe_gkd.selfcheck import stage0_actor, stage0_learn

    est = {k: v * sizes.estimate_scale for k, v in GPU_ESTIMATE_S.items()}
    checks = [StageCheck("device", est["device"], lambda: device_check(out, models, sizes))]
    checks.append(StageCheck("model", est["model"], lambda: stage0_actor.model_check(models, sizes)))
    checks += [
        StageCheck(f"loss_{kind}", est[f"loss_{kind}"], lambda kind=kind: loss_check(kind, sizes))  # type: ignore[misc]
        for kind in ("topk", "hidden", "span")
    ]
    checks += [
        StageCheck(
            f"actor_topk_recompute_{r}",
            est["actor"],
            lambda r=r: stage0_actor.actor_check(out, models, sizes, r, "topk"),  # type: ignore[misc]
        )
        for r in RECOMPUTE
    ]
    checks.append(
        StageCheck(
            "actor_hidden_recompute_none",
            est["actor"],
            lambda: stage0_actor.actor_check(out, models, sizes, "none", "hidden"),
        )
    )
    checks.append(StageCheck("loop", est["loop"], lambda: stage0_actor.loop_check(out, models, sizes)))
    checks += [
        StageCheck(
            name,
            GPU_ESTIMATE_S[name] * sizes.learn_estimate_scale,
            lambda name=name: stage0_learn.learn_check(name, out, models, sizes),  # type: ignore[misc]
        )
        for name in stage0_learn.LEARN_PRESETS
    ]
    return checks


def run_checks(
    checks: list[StageCheck], budget_s: float, after_each: Callable[[list[Check], dict[str, str]], None]
) -> tuple[list[Check], dict[str, str]]:
    """Run each check in turn, isolated (an exception becomes a failed check with its traceback), within
    `budget_s` seconds in all: a check whose estimate exceeds what is left is skipped, with the reason.
    `after_each(done, skipped)` gets the record so far (written at once: a run killed by an outer timeout
    keeps what it finished), the checks not reached yet listed as skipped."""
    start = time.perf_counter()
    done: list[Check] = []
    skipped: dict[str, str] = {}
    for check in checks:
        left = budget_s - (time.perf_counter() - start)
        if check.estimate_s > left:
            skipped[check.name] = (
                f"time budget: {max(left, 0.0):.0f} s left of {budget_s:.0f} s, estimated {check.estimate_s:.0f} s"
            )
            continue
        print(f"[selfcheck] {check.name} ...", flush=True)
        began = time.perf_counter()
        try:
            result = check.run()
        except Exception:  # noqa: BLE001 -- isolation is the point: record it, run the rest
            result = Check(check.name, "failed", time.perf_counter() - began, detail=traceback.format_exc())
            release_gpu_memory()
        done.append(result)
        pending = {c.name: "not reached (the run stopped before it)" for c in checks[checks.index(check) + 1 :]}
        after_each(done, skipped | pending)
        last = result.detail.strip().splitlines()[-1:] if result.status == "failed" else []
        print(f"[selfcheck] {check.name}: {result.status} in {result.seconds:.1f} s {''.join(last)[:300]}", flush=True)
    return done, skipped


def release_gpu_memory() -> None:
    """After a failed check: what it left in torch's cache goes back, so the next one starts clean."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)


# ----------------------------------------------------------------------------- the device


def device_check(out: Path, models: Path, sizes: Sizes) -> Check:
    """nvidia-smi and CUDA's view of GPU 0, and the GPU size the memory plan budgets (cluster.gpu_memory_gib=0)."""
    import torch

    from recipe_gkd.config import ConfigError
    from recipe_gkd.plan.gpu_memory import plan_gpu_memory
    from recipe_gkd.selfcheck.stage0_actor import stage0_config

    start = time.perf_counter()
    figures: dict[str, Any] = {v: os.environ.get(v, "(unset)") for v in VISIBLE_DEVICE_VARIABLES}
    figures["nvidia_smi"] = nvidia_smi_rows(SMI_QUERY) or "(no nvidia-smi or no driver)"
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(0)
        figures |= {
            "cuda_devices": torch.cuda.device_count(),
            "cuda_free_gib": free / GIB,
            "cuda_total_gib": total / GIB,
        }
        figures["cuda_name"] = torch.cuda.get_device_name(0)
    else:
        figures["cuda"] = "not available"
    # What the image holds (name==version): stage 1's carry is what vLLM and Ray need beyond it.
    packages = sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions() if d.metadata["Name"])
    (out / "image_packages.txt").write_text("".join(f"{p}\n" for p in packages))
    figures["installed_distributions"] = len(packages)
    cfg = stage0_config(out, models, sizes, "device", "cluster.gpu_memory_gib=0")
    try:
        planned = plan_gpu_memory(cfg)
    except ConfigError as err:
        # The plan cannot read GPU 0 as CUDA sees it (a mask naming no device, CUDA failing): the finding,
        # recorded beside the device facts above.
        return Check("device", "failed", time.perf_counter() - start, figures, detail=f"memory plan: {err}")
    figures |= {"plan_gpu_gib": planned.gib, "plan_source": planned.source}
    if "cuda_total_gib" in figures:
        figures["plan_minus_cuda_gib"] = planned.gib - figures["cuda_total_gib"]
    return Check("device", "passed", time.perf_counter() - start, figures)


# ----------------------------------------------------------------------------- the losses


def loss_check(kind: str, sizes: Sizes) -> Check:
    """One loss, forward + backward, at each of the stage's token counts (out of memory at one is recorded there)."""
    import torch

    figures: dict[str, Any] = {"vocab": sizes.loss_vocab, "top_k": sizes.top_k}
    start = time.perf_counter()
    ok = True
    for tokens in sizes.loss_tokens:
        try:
            row = one_loss(kind, sizes, tokens)
        except torch.OutOfMemoryError as err:  # a finding at this size: the smaller sizes' figures stay
            release_gpu_memory()
            row = {"finite": False, "out_of_memory": str(err).splitlines()[0][:300]}
        ok = ok and row.pop("finite")
        figures |= {f"T{tokens}_{k}": v for k, v in row.items()}
    return Check(
        f"loss_{kind}",
        "passed" if ok else "failed",
        time.perf_counter() - start,
        figures,
        "" if ok else "non-finite loss or gradient",
    )


def one_loss(kind: str, sizes: Sizes, tokens: int) -> dict[str, Any]:
    import torch

    device, vocab = sizes.device, sizes.loss_vocab
    generator = torch.Generator(device=device).manual_seed(0)
    if device == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    # fp32 logits [1, T, V], as megatron's Float16Module hands them to the loss.
    logits_BTV = torch.randn(1, tokens, vocab, device=device, generator=generator).requires_grad_(True)
    mask_BT = torch.ones(1, tokens, device=device)
    loss_fn, extra_plan_gib = LOSSES[kind](sizes, tokens, generator)
    if device == "cuda":
        torch.cuda.synchronize()
    timed = time.perf_counter()
    loss = loss_fn(logits_BTV, mask_BT)
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    row: dict[str, Any] = {"s": time.perf_counter() - timed, "loss": float(loss.detach())}
    # The plan's line: logits in the compute dtype, their fp32 copy, the fp32 log-softmax and two gradients.
    row["plan_gib"] = tokens * vocab * (2 + 4 * 4) / GIB + extra_plan_gib
    if device == "cuda":
        row["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
        row["peak_over_plan"] = row["peak_gib"] / row["plan_gib"]
    grad = logits_BTV.grad
    row["finite"] = bool(torch.isfinite(loss)) and grad is not None and bool(torch.isfinite(grad).all())
    return row


def _topk_loss(sizes: Sizes, tokens: int, generator: Any) -> tuple[Callable[..., Any], float]:
    import torch

    from recipe_gkd.losses import gkd_loss

    device, vocab, k = sizes.device, sizes.loss_vocab, sizes.top_k
    # A teacher whose top-k holds half its mass (the tail bucket the other half), K distinct ids per position.
    teacher_BTK = torch.log_softmax(torch.randn(1, tokens, k, device=device, generator=generator), -1) - math.log(2)
    first_BT1 = torch.randint(0, vocab, (1, tokens, 1), device=device, generator=generator)
    ids_BTK = (first_BT1 + torch.arange(k, device=device)) % vocab
    tail_BT = torch.full((1, tokens), -math.log(2), device=device)

    def run(logits: Any, mask: Any) -> Any:
        return gkd_loss(logits, teacher_BTK, ids_BTK, mask, divergence="forward_kl", teacher_tail_logmass=tail_BT)

    return run, 0.0


def _hidden_loss(sizes: Sizes, tokens: int, generator: Any) -> tuple[Callable[..., Any], float]:
    import torch

    from recipe_gkd.losses import hidden_gkd_loss_sum
    from recipe_gkd.plan.memory_plan import HIDDEN_LOSS_CHUNK_BYTES

    device, vocab, hidden = sizes.device, sizes.loss_vocab, sizes.student.hidden_size
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the head in the teacher's dtype
    head_VH = (torch.randn(vocab, hidden, device=device, generator=generator) / math.sqrt(hidden)).to(dtype)
    hidden_BTH = torch.randn(1, tokens, hidden, device=device, generator=generator).to(dtype)

    def run(logits: Any, mask: Any) -> Any:
        total, count = hidden_gkd_loss_sum(logits, hidden_BTH, head_VH, mask, divergence="forward_kl")
        return total / count.clamp(min=1)

    return run, HIDDEN_LOSS_CHUNK_BYTES / GIB


def _span_loss(sizes: Sizes, tokens: int, generator: Any) -> tuple[Callable[..., Any], float]:
    import torch

    from recipe_gkd.losses import cross_tokenizer_loss_sum

    device, vocab, k = sizes.device, sizes.loss_vocab, sizes.top_k
    # Spans of 1-3 student tokens: span_len > 0 at a span's first token, 0 inside; the teacher's span logprob.
    lengths = torch.randint(1, 4, (tokens,), generator=generator, device=device)
    span_T = torch.zeros(tokens, dtype=torch.int64, device=device)
    starts = torch.cumsum(lengths, 0) - lengths
    keep = starts < tokens
    span_T[starts[keep]] = torch.minimum(lengths[keep], tokens - starts[keep])
    teacher_BTK = torch.log_softmax(torch.randn(1, tokens, k, device=device, generator=generator), -1) - math.log(2)
    # Student ids in every row: one-token spans take the shared-piece route (top-k + tail), longer ones the span's.
    first_BT1 = torch.randint(0, vocab, (1, tokens, 1), device=device, generator=generator)
    ids_BTK = (first_BT1 + torch.arange(k, device=device)) % vocab
    targets_BT = torch.randint(0, vocab, (1, tokens), device=device, generator=generator)
    span_lp_BT = -torch.rand(1, tokens, device=device, generator=generator) * 4

    def run(logits: Any, mask: Any) -> Any:
        total, count = cross_tokenizer_loss_sum(
            logits,
            targets_BT,
            teacher_BTK,
            ids_BTK,
            torch.full((1, tokens), -math.log(2), device=device),
            span_lp_BT,
            span_T[None],
            mask,
            objective="span",
            divergence="forward_kl",
        )
        return total / count.clamp(min=1)

    return run, 0.0


LOSSES: dict[str, Callable[[Sizes, int, Any], tuple[Callable[..., Any], float]]] = {
    "topk": _topk_loss,
    "hidden": _hidden_loss,
    "span": _span_loss,
}
