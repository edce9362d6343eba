"""`python -m recipe_gkd.selfcheck`: every path a machine can run, measured, in one command, in two stages.

- `--stage 0` (recipe_gkd/selfcheck/stage0.py): torch, transformers, megatron-core and the project only, one
  process, no Ray and no vLLM: the device facts against the memory plan's reading, the megatron actor at each
  recompute setting and with hidden-state targets, the losses at real sizes, a few steps of the whole loop on
  the in-process pools. On a CUDA GPU at Qwen3-0.6B's shape (V=151936); on a CPU at the rehearsal's sizes
  (`--sizes cpu`; `--sizes tiny` for the suite). A time budget (`--budget-s`); what it skips is recorded.
- `--stage 1` (recipe_gkd/selfcheck/full.py, the default): the whole stack, each run the real CLI on Ray with
  the vLLM engines (the one-GPU preset, the HF engines, the actor's recompute settings, the loss).

Writes <out>/selfcheck.md (device, driver, versions, every figure) and <out>/selfcheck.json.

    python -m recipe_gkd.selfcheck --stage 0 [--out runs/selfcheck0] [--budget-s 420] [--models DIR] [--only device,loss_topk]
    python -m recipe_gkd.selfcheck [--out runs/selfcheck] [--steps 4] [--only colocated_hf,loss]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recipe_gkd.selfcheck.full import (
    GPU_ONLY,
    WORDS,
    cpu_checks,
    export_bytes,
    gpu_checks,
    run_figures,
    sync_tolerance_figures,
)
from recipe_gkd.selfcheck.record import Check, Machine, describe_machine, write_record

__all__ = ["WORDS", "Check", "Machine", "export_bytes", "main", "run_figures", "sync_tolerance_figures"]

# Stage 0's default budget: on a GPU lent for 15 minutes in all (its start included), one run and a rerun
# (launch/gpu_check.sh runs it under a `timeout` a minute longer).
STAGE0_BUDGET_S = 420.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe_gkd.selfcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=(0, 1), default=1, help="0: no Ray/vLLM, in one process")
    parser.add_argument("--out", default="", help="where the runs and the record go (runs/selfcheck[0])")
    parser.add_argument("--steps", type=int, default=4, help="stage 1: training steps of each full run")
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    parser.add_argument("--budget-s", type=float, default=STAGE0_BUDGET_S, help="stage 0: seconds for all checks")
    parser.add_argument("--sizes", choices=("auto", "gpu", "cpu", "tiny"), default="auto", help="stage 0's sizes")
    parser.add_argument("--models", default="", help="stage 0: where its random models are built once (<out>/models)")
    args = parser.parse_args(argv)
    out = Path(args.out or ("runs/selfcheck0" if args.stage == 0 else "runs/selfcheck")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    machine = describe_machine()
    print(f"self-check stage {args.stage} on {machine.device}; versions: {machine.versions}", flush=True)
    wanted = [n for n in args.only.split(",") if n]
    if args.stage == 0:
        models = Path(args.models).resolve() if args.models else out / "models"
        return stage0_main(out, models, machine, wanted, args.budget_s, args.sizes)
    available = gpu_checks(out, args.steps) if machine.on_gpu else cpu_checks(out, args.steps)
    wanted = wanted or list(available)
    unknown = sorted(set(wanted) - set(available))
    if unknown:
        print(f"error: unknown check(s) {unknown}; this machine has {list(available)}", file=sys.stderr)
        return 2
    skipped = {} if machine.on_gpu else dict(GPU_ONLY)
    skipped |= {name: "not asked for (--only)" for name in available if name not in wanted}
    checks: list[Check] = []
    for name in wanted:
        print(f"[selfcheck] {name} ...", flush=True)
        check = available[name]()
        checks.append(check)
        print(f"[selfcheck] {name}: {check.status} in {check.seconds:.1f} s {check.detail[:300]}", flush=True)
    return finish(out, machine, checks, skipped, "recipe_gkd self-check")


def stage0_main(out: Path, models: Path, machine: Machine, wanted: list[str], budget_s: float, sizes_name: str) -> int:
    from recipe_gkd.selfcheck.sizes import SIZES
    from recipe_gkd.selfcheck.stage0 import run_checks, stage0_checks

    if sizes_name == "auto":
        sizes_name = "gpu" if machine.on_gpu else "cpu"
    sizes = SIZES[sizes_name]
    if sizes.device == "cuda" and not machine.on_gpu:
        print("error: --sizes gpu needs a CUDA GPU; this machine has none (--sizes cpu)", file=sys.stderr)
        return 2
    available = stage0_checks(out, models, sizes)
    names = [c.name for c in available]
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        print(f"error: unknown check(s) {unknown}; stage 0 has {names}", file=sys.stderr)
        return 2
    chosen = [c for c in available if not wanted or c.name in wanted]
    not_asked = {name: "not asked for (--only)" for name in names if wanted and name not in wanted}
    heading = f"recipe_gkd self-check, stage 0 ({sizes.name} sizes, budget {budget_s:.0f} s)"

    def record(done: list[Check], skipped: dict[str, str]) -> None:
        write_record(out, machine, done, skipped | not_asked, heading)

    checks, skipped = run_checks(chosen, budget_s, record)
    return finish(out, machine, checks, skipped | not_asked, heading)


def finish(out: Path, machine: Machine, checks: list[Check], skipped: dict[str, str], heading: str) -> int:
    md_path, json_path = write_record(out, machine, checks, skipped, heading)
    print(md_path.read_text(), flush=True)
    print(f"record: {md_path} and {json_path}", flush=True)
    return 1 if any(c.status == "failed" for c in checks) else 0
