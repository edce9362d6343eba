"""The longest sequence each GPU preset's actor can train, by the memory plan, at context-parallel sizes 1, 2, 4, 8.

    python benchmarks/cp_lengths_table.py                       # every GPU preset (docs/context_parallel.md)
    python benchmarks/cp_lengths_table.py --presets configs/presets/1x8_a4_r2_t2_cp2.yaml \
        --set actor.megatron.tp=1 cluster.gpu_memory_gib=139.8  # the same split at TP 1 on H200s

For each preset (default: every GPU preset under configs/presets) and each cp its actor GPUs take (tp x pp x cp
dividing them, no expert parallelism, one tokenizer), the largest token budget L (data.max_prompt_length +
rollout.sampling.max_new_tokens = L, or rollout.max_total_tokens = L for multi-turn) whose actor rank fits the plan's
GPU (cluster.gpu_memory_gib, or where it is 0 the plan's 79 GiB default, never this machine's GPUs), found by
bisection over L: the actor's estimate (recipe_gkd.plan.memory_plan.actor_memory) only grows with L. Everything
else is the preset's (micro-batch, recompute, precision, the split); a budget of micro-batch tokens
(actor.max_tokens_per_micro_batch) grows with L when shorter.
The rollout and teacher GPUs are not part of it (their KV caches and teacher.max_model_len are sized apart). Reads
each student's config.json from a directory or the Hugging Face cache (hf download ID config.json); prints a
markdown table, the preset's own cp in bold.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from recipe_gkd.config import CONFIG_DIR, ConfigError, GKDConfig, load_config, validate
from recipe_gkd.config.rules import CONTEXT_PARALLEL_SIZES
from recipe_gkd.plan.gpu_memory import DEFAULT_GPU_MEMORY_GIB
from recipe_gkd.plan.memory_plan import actor_memory
from recipe_gkd.plan.model_shape import read_shape

# Bisection's upper end: 2^21 tokens, far beyond any model's positions (it reports "> 2M" there).
LONGEST = 2**21
# The shortest budget tried: a prompt of the preset's data.max_prompt_length and one response token.
RESPONSE_MIN = 1


def with_length(cfg: GKDConfig, length: int) -> GKDConfig:
    """`cfg` training sequences of `length` tokens (the response grows; a multi-turn run's max_total_tokens)."""
    rollout = cfg.rollout
    if rollout.env:
        rollout = dataclasses.replace(rollout, max_total_tokens=length)
    else:
        sampling = dataclasses.replace(rollout.sampling, max_new_tokens=length - cfg.data.max_prompt_length)
        rollout = dataclasses.replace(rollout, sampling=sampling)
    actor = cfg.actor
    if actor.max_tokens_per_micro_batch:
        actor = dataclasses.replace(actor, max_tokens_per_micro_batch=max(actor.max_tokens_per_micro_batch, length))
    return dataclasses.replace(cfg, rollout=rollout, actor=actor)


def with_cp(cfg: GKDConfig, cp: int) -> GKDConfig | None:
    """`cfg` at actor.megatron.cp=`cp`, or None where the config rules refuse it (the GPUs, ep, a cross-tokenizer
    teacher, the batch's split over data parallel)."""
    megatron = dataclasses.replace(cfg.actor.megatron, cp=cp)
    candidate = dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, megatron=megatron))
    try:
        validate(candidate)
    except ConfigError:
        return None
    return candidate


def longest_fitting(cfg: GKDConfig) -> int:
    """The largest L the actor rank fits at (0: not even one response token)."""
    gib = cfg.cluster.gpu_memory_gib or DEFAULT_GPU_MEMORY_GIB
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, gpu_memory_gib=gib))
    shape = read_shape(cfg.model.student_path, "model.student_path", [])
    if shape is None:
        raise SystemExit(f"{cfg.model.student_path}: no config.json (hf download {cfg.model.student_path} config.json)")

    def fits(length: int) -> bool:
        role = actor_memory(with_length(cfg, length), shape)
        return role.total <= role.capacity

    lo = cfg.data.max_prompt_length + RESPONSE_MIN
    if not fits(lo):
        return 0
    hi = LONGEST
    if fits(hi):
        return hi
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def split(cfg: GKDConfig) -> str:
    m, a = cfg.actor.megatron, cfg.actor
    return (
        f"{a.nnodes * a.gpus_per_node} x {cfg.cluster.gpu_memory_gib or DEFAULT_GPU_MEMORY_GIB:g} GiB"
        f"{f' (a {a.gpu_memory_utilization:g} share)' if a.gpu_memory_utilization else ''}, TP {m.tp}"
        f"{f' PP {m.pp}' if m.pp > 1 else ''}, {cfg.model.student_path}, recompute {m.recompute.value}, "
        f"micro-batch {a.max_tokens_per_micro_batch or a.micro_batch_size}"
        f"{' tokens' if a.max_tokens_per_micro_batch else ''}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="*", type=Path, default=[])
    parser.add_argument("--set", nargs="*", default=[], help="key=value overrides applied to every preset")
    args = parser.parse_args()
    presets = args.presets or sorted(
        p for p in (CONFIG_DIR / "presets").glob("*.yaml") if not p.name.startswith("cpu_")
    )
    print("| preset | actor | " + " | ".join(f"cp {c}" for c in CONTEXT_PARALLEL_SIZES) + " |")
    print("|---|---|" + "---:|" * len(CONTEXT_PARALLEL_SIZES))
    for preset in presets:
        cfg = load_config(preset, args.set)
        cells = []
        for cp in CONTEXT_PARALLEL_SIZES:
            candidate = with_cp(cfg, cp)
            if candidate is None:
                cells.append("-")
                continue
            longest = longest_fitting(candidate)
            cell = "> 2M" if longest >= LONGEST else f"{longest:,}"
            cells.append(f"**{cell}**" if cp == cfg.actor.megatron.cp else cell)
        name = f"`{preset.name}`" + "".join(f" `{kv}`" for kv in args.set)
        print(f"| {name} | {split(cfg)} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
