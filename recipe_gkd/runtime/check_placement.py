"""Place one probe worker per bundle on Ray and check what each sees against the plan.

    python -m recipe_gkd.runtime.check_placement --config configs/presets/1x8_a1_r3_t4.yaml [key=value ...]

Each probe reports CUDA_VISIBLE_DEVICES, Ray's GPU ids and its node from inside the worker.
Exits 0 when every worker sits on the GPUs the plan gives it and no two workers share a GPU;
1 otherwise; 2 for a bad config. On a machine without GPUs use cluster.fake_gpus=true.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping

from recipe_gkd.config import ConfigError, load_config
from recipe_gkd.plan.placement import PlacementPlan, build_plan, format_plan, physical_gpu_ids
from recipe_gkd.runtime.ray_cluster import Observed, observe, ray_cluster


def compare(plan: PlacementPlan, observed: list[Observed], env: Mapping[str, str] | None = None) -> list[str]:
    """Every difference between plan and observation, plus any GPU two workers share.

    Planned ids are read through the CUDA_VISIBLE_DEVICES in `env` (this process's by default), the
    mask Ray maps its slots through."""
    problems = []
    for slot, seen in zip(plan.workers, observed, strict=True):
        want = physical_gpu_ids(slot.gpu_ids, env)
        if (seen.node, seen.cuda_visible_devices) != (slot.node, ",".join(want)):
            problems.append(
                f"{slot.role} rank {slot.rank}: planned node {slot.node} GPUs {','.join(want)}, "
                f"got node {seen.node} CUDA_VISIBLE_DEVICES={seen.cuda_visible_devices!r}"
            )
        if seen.ray_gpu_ids != want:
            problems.append(f"{slot.role} rank {slot.rank}: ray.get_gpu_ids()={list(seen.ray_gpu_ids)}")
    owners: dict[tuple[int, str], str] = {}
    for seen in observed:
        for gpu in seen.ray_gpu_ids:
            key = (seen.node, gpu)
            if key in owners:
                problems.append(
                    f"node {seen.node} GPU {gpu} is shared by {owners[key]} and {seen.role} rank {seen.rank}"
                )
            owners[key] = f"{seen.role} rank {seen.rank}"
    teacher = {(s.node, g) for s in plan.teacher for g in physical_gpu_ids(s.gpu_ids, env)}
    for key in sorted(teacher & owners.keys()):
        problems.append(f"node {key[0]} GPU {key[1]} belongs to the teacher but Ray gave it to {owners[key]}")
    return problems


def format_observed(observed: list[Observed]) -> str:
    lines = ["role      rank  node  CUDA_VISIBLE_DEVICES  ray_gpu_ids"]
    for o in observed:
        lines.append(f"{o.role:<8}  {o.rank:<4}  {o.node:<4}  {o.cuda_visible_devices:<20}  {list(o.ray_gpu_ids)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipe_gkd.runtime.check_placement", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--config", default=None, help="yaml preset (default: the CPU demo)")
    parser.add_argument("overrides", nargs="*", help="key.path=value")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        plan = build_plan(cfg)
        print("plan:\n" + format_plan(plan), flush=True)
        with ray_cluster(cfg, plan):
            observed = observe(cfg, plan)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("seen from inside the workers:\n" + format_observed(observed))
    problems = compare(plan, observed)
    for p in problems:
        print(f"MISMATCH: {p}", file=sys.stderr)
    print("placement OK" if not problems else f"placement FAILED ({len(problems)} problems)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
