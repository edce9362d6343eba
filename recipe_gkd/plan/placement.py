"""GPU split -> placement plan -> Ray placement groups, and the placement report.

The plan is pure arithmetic on the config (no Ray): on every node the actor pool takes the
first GPUs, the rollout pool the next ones, the teacher the rest. Ray only ever sees the
actor + rollout GPUs (launch/ hides the teacher's), so the teacher's ids are the node-local
ids after them. Plan ids count the GPUs a process on the node may use: where CUDA_VISIBLE_DEVICES
is already set (a shared node, SLURM), plan id i is its i-th entry (`physical_gpu_ids`), as Ray
maps its own slots. `ray_cluster.ResourcePoolManager` turns the plan into one STRICT_PACK placement
group per (role, node), created in plan order so Ray hands out GPU ids in plan order.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipe_gkd.config import ConfigError, GKDConfig, TeacherLocation, node_gpus
from recipe_gkd.config.teachers import chosen_teacher, teacher_key, teacher_sections

# Ray resource that pins a bundle to a node of the plan; `launch/ray_start.sh --node-rank i`
# (and the fake multi-node cluster in tests) gives node i `{NODE_RESOURCE_PREFIX}i: 1`.
NODE_RESOURCE_PREFIX = "recipe_gkd_node_"
# Tiny demand on the node resource: pins the bundle without limiting how many fit.
NODE_RESOURCE_DEMAND = 0.001
ROLES = ("actor", "rollout")
VISIBLE_DEVICES_VAR = "CUDA_VISIBLE_DEVICES"
# The node the driver (and the placement report) runs on: the Ray head, node 0 of the plan (launch/run_gkd.sh).
DRIVER_NODE = 0


def visible_devices(env: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """The entries of a preset CUDA_VISIBLE_DEVICES (indices or UUIDs), or None when it is unset."""
    value = (os.environ if env is None else env).get(VISIBLE_DEVICES_VAR)
    if value is None:
        return None
    return tuple(x.strip() for x in value.split(",") if x.strip())


def physical_gpu_ids(ids: Sequence[int], env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Plan GPU ids -> the ids to write into a process's CUDA_VISIBLE_DEVICES on this node.

    The one mapping every consumer uses (Ray's start in launch/ray_start.sh, the teacher's --gpu-ids,
    the placement check): with no preset mask plan id i is device i; with CUDA_VISIBLE_DEVICES set,
    it is the mask's i-th entry, as Ray 2.60 maps its slots through the mask the raylet inherited
    (ray/_private/worker.py `get_accelerator_ids_for_accelerator_resource`).
    """
    mask = visible_devices(env)
    if mask is None:
        return tuple(str(i) for i in ids)
    beyond = [i for i in ids if i >= len(mask)]
    if beyond:
        raise ConfigError(
            "cluster.gpus_per_node",
            f"the plan uses GPU {beyond[0]} of this node but {VISIBLE_DEVICES_VAR}={','.join(mask)!r} shows "
            f"{len(mask)} GPU(s): lower cluster.gpus_per_node to {len(mask)} or widen {VISIBLE_DEVICES_VAR}",
        )
    return tuple(mask[i] for i in ids)


def gpu_list(ids: Sequence[int], env: Mapping[str, str] | None = None) -> str:
    """`physical_gpu_ids` as a CUDA_VISIBLE_DEVICES / --gpu-ids value."""
    return ",".join(physical_gpu_ids(ids, env))


@dataclass(frozen=True)
class Slot:
    """One worker of the plan: `gpu_ids` are node-local physical GPU ids."""

    role: str
    rank: int
    node: int
    gpu_ids: tuple[int, ...]
    # A teacher replica's teacher (its name under `teachers:`, `default` with only `teacher:`).
    teacher: str = ""

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(g) for g in self.gpu_ids)


@dataclass(frozen=True)
class PlacementPlan:
    nnodes: int
    gpus_per_node: int
    workers: tuple[Slot, ...]
    # Teacher replicas on this cluster's leftover GPUs (empty when teacher.location=remote).
    teacher: tuple[Slot, ...]
    # cluster.colocate: actor rank i, rollout engine i and the teacher share GPU i (one node).
    colocated: bool = False

    def role(self, role: str) -> tuple[Slot, ...]:
        return tuple(s for s in self.workers if s.role == role)

    def ray_gpu_ids(self, node: int) -> tuple[int, ...]:
        """The GPU ids Ray may see on `node`: the actor's and rollout's (each once), never the teacher's own."""
        return tuple(sorted({g for s in self.workers if s.node == node for g in s.gpu_ids}))

    def ray_gpus(self, node: int) -> int:
        """How many GPUs Ray may see on `node`."""
        return len(self.ray_gpu_ids(node))

    def teacher_gpu_ids(self, node: int, name: str | None = None) -> tuple[int, ...]:
        """The teacher GPUs of `node`: all teachers', or teacher `name`'s (each id once: colocated teachers share)."""
        ids = (g for s in self.teacher if s.node == node and name in (None, s.teacher) for g in s.gpu_ids)
        return tuple(dict.fromkeys(ids))

    def teacher_only_gpu_ids(self, node: int) -> tuple[int, ...]:
        """The teacher's GPUs on `node` that Ray must not see (none when the roles are colocated)."""
        ray_ids = set(self.ray_gpu_ids(node))
        return tuple(g for g in self.teacher_gpu_ids(node) if g not in ray_ids)

    def bundle_index(self, slot: Slot) -> int:
        """Index of the slot's bundle in its placement group: (role, node), or (node) when colocated,
        where bundle i is GPU i and holds actor rank i and rollout engine i."""
        if self.colocated:
            return self.ray_gpu_ids(slot.node).index(slot.gpu_ids[0])
        return [s for s in self.role(slot.role) if s.node == slot.node].index(slot)

    def shared_gpus(self, node: int) -> dict[int, list[str]]:
        """GPU id -> the roles on it (`actor 0`, `rollout 0`, `teacher 0`; several teachers: `teacher NAME 0`), for
        GPUs of `node` that hold several."""
        held: dict[int, list[str]] = {}
        several = len({s.teacher for s in self.teacher}) > 1
        for s in self.all_slots():
            if s.node == node:
                label = f"teacher {s.teacher} {s.rank}" if s.role == "teacher" and several else f"{s.role} {s.rank}"
                for g in s.gpu_ids:
                    held.setdefault(g, []).append(label)
        return {g: roles for g, roles in sorted(held.items()) if len(roles) > 1}

    def all_slots(self) -> Iterator[Slot]:
        yield from self.workers
        yield from self.teacher


def build_plan(cfg: GKDConfig) -> PlacementPlan:
    """The GPU assignment of every actor worker, rollout engine and teacher replica."""
    if cfg.cluster.colocate:
        return _colocated_plan(cfg)
    workers: list[Slot] = []
    teacher: list[Slot] = []
    ranks = {"actor": 0, "rollout": 0}
    leftover: list[list[int]] = []
    per_worker = {"actor": 1, "rollout": cfg.rollout.tp}
    for node in range(cfg.cluster.nnodes):
        next_gpu = 0
        for role in ROLES:
            count = node_gpus(cfg, role, node)
            for first in range(next_gpu, next_gpu + count, per_worker[role]):
                workers.append(Slot(role, ranks[role], node, tuple(range(first, first + per_worker[role]))))
                ranks[role] += 1
            next_gpu += count
        leftover.append(list(range(next_gpu, cfg.cluster.gpus_per_node)))
    teacher = _teacher_slots(cfg, leftover)
    return PlacementPlan(cfg.cluster.nnodes, cfg.cluster.gpus_per_node, tuple(workers), teacher)


def _teacher_slots(cfg: GKDConfig, leftover: list[list[int]]) -> tuple[Slot, ...]:
    """The teachers' replicas on the GPUs left on each node, teacher after teacher in config order
    (a replica never spans nodes). Ranks count the replicas of each teacher."""
    slots: list[Slot] = []
    node = 0
    free = [list(ids) for ids in leftover]
    for name, section in teacher_sections(cfg).items():
        if section.location != TeacherLocation.local:
            continue
        step = section.gpus_per_replica
        for rank in range(section.replicas):
            while node < len(free) and len(free[node]) < step:
                node += 1
            if node == len(free):
                raise ConfigError(
                    teacher_key(cfg, name, "replicas"),
                    f"teacher {name!r}'s replica {rank} finds no {step} GPUs left on one node (GPUs left per node "
                    f"after the actor and rollout pools: {[len(ids) for ids in leftover]})",
                )
            slots.append(Slot("teacher", rank, node, tuple(free[node][:step]), name))
            del free[node][:step]
    return tuple(slots)


def _colocated_plan(cfg: GKDConfig) -> PlacementPlan:
    """One node: actor rank i and rollout engine i on GPU i; each local teacher's replicas over the same GPUs
    (several teachers: every one of them on every GPU, each within its own memory share)."""
    gpus = cfg.cluster.gpus_per_node
    workers = tuple(Slot(role, i, 0, (i,)) for role in ROLES for i in range(gpus))
    teacher: list[Slot] = []
    for name, section in teacher_sections(cfg).items():
        if section.location != TeacherLocation.local:
            continue
        step = section.gpus_per_replica
        teacher += [Slot("teacher", n, 0, tuple(range(g, g + step)), name) for n, g in enumerate(range(0, gpus, step))]
    return PlacementPlan(1, gpus, workers, tuple(teacher), colocated=True)


def format_plan(plan: PlacementPlan, env: Mapping[str, str] | None = None) -> str:
    """The placement report: one line per worker and teacher replica with the CUDA_VISIBLE_DEVICES it is given.

    On the driver's node that is its plan GPU ids read through the mask in `env` (this process's by default),
    as Ray and the teacher's --gpu-ids map them (`physical_gpu_ids`); another node's rows keep the plan ids,
    which that node's own mask (if any) maps when it starts Ray and its teacher. Raises ConfigError (naming
    cluster.gpus_per_node) when the mask shows fewer GPUs than the plan uses.
    """
    rows = [("role", "rank", "node", "bundle", "CUDA_VISIBLE_DEVICES")]
    names = list(dict.fromkeys(s.teacher for s in plan.teacher))
    several = len(names) > 1
    for s in plan.all_slots():
        bundle = str(plan.bundle_index(s)) if s.role != "teacher" else "-"
        role = f"teacher {s.teacher}" if s.role == "teacher" and several else s.role
        rows.append((role, str(s.rank), str(s.node), bundle, _given_ids(s.gpu_ids, s.node, env)))
    role_width = max(8, *(len(r[0]) for r in rows))
    lines = [_row(r, role_width) for r in rows]
    for node in range(plan.nnodes):
        teacher_ids = _given_ids(plan.teacher_gpu_ids(node), node, env) or "-"
        if several:
            each = [f"{n} {_given_ids(plan.teacher_gpu_ids(node, n), node, env) or '-'}" for n in names]
            teacher_ids += f" ({'; '.join(each)})"
        lines.append(f"node {node}: Ray sees {plan.ray_gpus(node)} GPUs; teacher GPUs {teacher_ids}")
        lines += [
            f"GPU {_given_ids((g,), node, env)} of node {node} is shared (colocated): {', '.join(r)}"
            for g, r in plan.shared_gpus(node).items()
        ]
    mask = visible_devices(env)
    if mask is not None:
        note = f"{VISIBLE_DEVICES_VAR}={','.join(mask)} is set here: plan GPU i is its i-th device"
        if plan.nnodes > 1:
            note += f" on node {DRIVER_NODE}; the other nodes' rows show plan ids, mapped through their own mask"
        lines.append(note)
    return "\n".join(lines)


def _given_ids(ids: Sequence[int], node: int, env: Mapping[str, str] | None) -> str:
    """The CUDA_VISIBLE_DEVICES value of a process on `node` with plan GPUs `ids`, as far as this node knows it."""
    return gpu_list(ids, env) if node == DRIVER_NODE else ",".join(map(str, ids))


def _row(cells: tuple[str, ...], role_width: int = 8) -> str:
    widths = (role_width, 5, 5, 7, 20)
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()


# ----------------------------------------------------------------------------- what Ray must see


def node_resource(node: int) -> str:
    return f"{NODE_RESOURCE_PREFIX}{node}"


def check_ray_gpus(plan: PlacementPlan, ray_nodes: list[dict[str, Any]]) -> None:
    """Refuse a cluster where Ray sees GPUs the plan gives to the teacher (or fewer than it needs).

    `ray_nodes` is `ray.nodes()`. Raises ConfigError naming the key to change.
    """
    alive = [n for n in ray_nodes if n.get("Alive")]
    for node in range(plan.nnodes):
        matches = alive if plan.nnodes == 1 else [n for n in alive if node_resource(node) in n["Resources"]]
        if plan.nnodes > 1 and len(matches) != 1:
            raise ConfigError(
                "cluster.nnodes",
                f"{len(matches)} Ray nodes carry the resource {node_resource(node)!r} (want 1); start each node "
                "with launch/ray_start.sh --node-rank N",
            )
        if plan.nnodes == 1:
            matches = [n for n in alive if n["Resources"].get("GPU", 0) > 0]
            if len(matches) != 1:
                raise ConfigError("cluster.nnodes", f"cluster.nnodes=1 but Ray has {len(matches)} nodes with GPUs")
        seen = int(matches[0]["Resources"].get("GPU", 0))
        want = plan.ray_gpus(node)
        if seen > want and plan.teacher_only_gpu_ids(node):
            raise ConfigError(
                "cluster.gpus_per_node",
                f"Ray sees {seen} GPUs on node {node} but the plan gives Ray only {want} (the rest, "
                f"{plan.teacher_only_gpu_ids(node)}, are the teacher's); start Ray with launch/ray_start.sh "
                f"(CUDA_VISIBLE_DEVICES / --num-gpus={want})",
            )
        if seen < want:
            raise ConfigError(
                "cluster.gpus_per_node",
                f"Ray sees {seen} GPUs on node {node} but actor + rollout need {want} there",
            )


# ----------------------------------------------------------------------------- CLI for launch/


def main(argv: list[str] | None = None) -> int:
    """`python -m recipe_gkd.plan.placement --config P --node-rank N --print ray-gpus|teacher-gpus|ray-resources`.

    Prints one value for launch/ scripts (comma-separated GPU ids, or a JSON resources map).
    `python -m recipe_gkd.plan.placement teacher-argv ARGS` prints launch/start_teacher.sh's server argv.
    """
    import argparse
    import json
    import sys

    from recipe_gkd.config import load_config

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["teacher-argv"]:
        return teacher_argv(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m recipe_gkd.plan.placement")
    parser.add_argument("--config", required=True)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--print", dest="what", choices=("ray-gpus", "teacher-gpus", "ray-resources"), required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        plan = build_plan(load_config(args.config, args.overrides))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not 0 <= args.node_rank < plan.nnodes:
        print(f"error: --node-rank {args.node_rank} outside cluster.nnodes={plan.nnodes}", file=sys.stderr)
        return 2
    node = args.node_rank
    try:
        if args.what == "ray-gpus":
            print(gpu_list(plan.ray_gpu_ids(node)))
        elif args.what == "teacher-gpus":
            print(gpu_list(plan.teacher_gpu_ids(node)))
        else:
            print(json.dumps({node_resource(node): 1}))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def teacher_argv(argv: list[str]) -> int:
    """The `python -m teacher_server` arguments for launch/start_teacher.sh's, one per line.

    A run preset: its teacher GPUs on --node-rank are the ones this plan leaves over (added as
    --gpu-ids unless given); overrides of the trainer's keys are checked and shape that plan, and
    only teacher.* / server.* ones reach the server. Anything else (a teacher yaml, a missing file)
    passes through unchanged: the server checks every key itself.
    """
    import sys

    from omegaconf import OmegaConf

    from recipe_gkd.config import load_config

    flags = [a for a in argv if "=" not in a or a.startswith("--")]
    overrides = [a for a in argv if "=" in a and not a.startswith("--")]
    config = _flag(flags, "--config")
    if not config or not Path(config).is_file() or set(OmegaConf.load(config).keys()) <= {"teacher", "server"}:
        return _print_argv(argv)
    server_overrides = [o for o in overrides if o.split(".")[0] in ("teacher", "server")]
    try:
        cfg = load_config(config, [o for o in overrides if not o.startswith("server.")])
        plan = build_plan(cfg)
        node = int(_flag(flags, "--node-rank") or 0)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if _flag(flags, "--gpu-ids"):
        return _print_argv(flags + server_overrides)
    if not 0 <= node < plan.nnodes:
        print(f"error: --node-rank {node} outside cluster.nnodes={plan.nnodes} of {config}", file=sys.stderr)
        return 2
    name = _flag(flags, "--teacher")
    teacher = chosen_teacher(cfg, name)
    if teacher is None:
        # The server says the same; the plan below needs the name first.
        names = list(teacher_sections(cfg))
        print(f"error: {config} has several teachers {names}: pass --teacher NAME", file=sys.stderr)
        return 2
    ids = plan.teacher_gpu_ids(node, teacher.name)
    if teacher.section.location == TeacherLocation.local and not ids:
        print(
            f"error: {config} gives node {node} no {teacher.label} GPUs; pick a --node-rank that has some",
            file=sys.stderr,
        )
        return 2
    try:
        extra = ["--gpu-ids", gpu_list(ids)] if ids else []
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return _print_argv(flags + extra + server_overrides)


def _flag(flags: list[str], name: str) -> str:
    """The value of `name` in `flags` (`--name value` or `--name=value`), or ''."""
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            return flags[i + 1]
        if flag.startswith(name + "="):
            return flag.split("=", 1)[1]
    return ""


def _print_argv(argv: list[str]) -> int:
    print("\n".join(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
