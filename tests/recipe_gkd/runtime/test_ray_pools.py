"""The Ray pools' weight transport is built once from the config (`ray_transport`), the one place that reads it."""

from __future__ import annotations

import ast

from repo_paths import REPO_ROOT

from recipe_gkd.config import load_config
from recipe_gkd.runtime.ray_pools import RayBucketStore, ray_transport
from recipe_gkd.weight_sync import FullStudent, Gloo, Nccl, ObjectStore

GPU_PRESET = REPO_ROOT / "configs" / "presets" / "1x8_a2_r2_t4.yaml"
# Who may compare a resolved weight_sync.transport: the config (its rules and `weight_transport` itself), the factory,
# and the plan's sizing (the object store's memory, NCCL's /dev/shm: facts of the transport not yet asked of its class).
READS_THE_TRANSPORT = {
    "recipe_gkd/runtime/ray_pools.py",
    "recipe_gkd/plan/memory_plan.py",
    "recipe_gkd/plan/shm.py",
}


def test_the_transport_is_chosen_by_the_config() -> None:
    cpu = ray_transport(load_config(None, []), "127.0.0.1", 1, engines=2)
    assert type(cpu) is ObjectStore and isinstance(cpu.store, RayBucketStore) and isinstance(cpu.payload, FullStudent)
    gloo = ray_transport(load_config(None, ["weight_sync.transport=gloo"]), "10.0.0.1", 7, engines=2)
    assert type(gloo) is Gloo and gloo.wire_dtype is None
    assert (gloo.group.host, gloo.group.port, gloo.group.world_size) == ("10.0.0.1", 7, 3)
    nccl = ray_transport(load_config(GPU_PRESET, ["rollout.tp=2"]), "10.0.0.1", 7, engines=1)
    # bf16 buckets; every TP worker of a vLLM engine a receiver of its own.
    assert type(nccl) is Nccl and nccl.wire_dtype == "bfloat16" and nccl.group.world_size == 1 + 2


def test_only_the_factory_branches_on_the_transport() -> None:
    readers = set()
    for path in sorted((REPO_ROOT / "recipe_gkd").rglob("*.py")):
        rel = str(path.relative_to(REPO_ROOT))
        if rel.startswith("recipe_gkd/config/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "WeightTransport":
                    readers.add(rel)
    assert readers == READS_THE_TRANSPORT, "weight_sync.transport is chosen in ray_pools.ray_transport"
