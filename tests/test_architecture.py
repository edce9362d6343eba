"""The seams, checked from the source: who imports Ray, what the teacher server depends on, no import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT as ROOT

PACKAGES = ("recipe_gkd", "teacher_server")
# The only modules of recipe_gkd that may import Ray (the cluster; the workers as Ray actors).
RAY_MODULES = {"recipe_gkd.runtime.ray_cluster", "recipe_gkd.runtime.ray_pools"}
# The only modules that may import vLLM: the rollout engine and the teacher server's backend.
VLLM_MODULES = {"recipe_gkd.rollout.vllm", "teacher_server.server.backends.vllm"}
# megatron-core stays inside the actor package.
MEGATRON_PACKAGE = "recipe_gkd.actor"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Every module `path` imports, at any depth of the file (function-level imports too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            found.add(stem)
            # `from pkg import mod` imports pkg.mod when it is a module.
            found.update(f"{stem}.{alias.name}" for alias in node.names)
    return found


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def project_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (a list of modules, first == last), or [] when there is none.

    A package's `__init__` importing its own submodules is not counted (Python handles it).
    """
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return []


def test_no_import_cycle_among_the_packages() -> None:
    cycle = find_cycle(project_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycle({"p": {"p.x"}, "p.x": {"p"}}) == [], "a package importing its own submodule is fine"


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of `graph` with more than one module, every edge counted (a
    package's `__init__` importing its own submodules too: a cycle through it is a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for start in sorted(graph):
        if start not in index:
            visit(start)
    return found


def package_of(module: str) -> str:
    """The package a module belongs to for the architecture: recipe_gkd.X / teacher_server.X (a top-level module is
    a package of its own)."""
    return ".".join(module.split(".")[:2])


def test_no_strongly_connected_component_spans_two_packages() -> None:
    """Within a package a cycle through its `__init__` is Python's business; across packages it ties wings together
    (a change to one reloads the other's world)."""
    spanning = [c for c in strongly_connected_components(project_graph()) if len({package_of(m) for m in c}) > 1]
    assert not spanning, "import cycles across packages: " + "; ".join(" <-> ".join(c) for c in spanning)


# The wings of recipe_gkd (and the teacher server) from the bottom up: a module may import its own layer's and the
# layers' below, never one above. The loop's contract (pools) sits below the runtime that implements it; the target
# kinds above the actor and the rollout wings they drive, which hold them through protocols of their own and are
# handed the kind built once above them (recipe_gkd/runtime/*_pools.py); the plan above the kinds it sizes.
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(layer.split())
    for layer in (
        "teacher_server recipe_gkd",
        "messages envs",
        "teacher_prompt",
        "config",
        "batch data stop_set parallel_layout weight_sync process_memory losses models offline_models",
        "cross_tokenizer",
        "actor",
        "rollout",
        "targets",
        "pools plan",
        "observe preflight",
        "runtime",
        "exit_codes gkd",
        "doctor selfcheck demo",
        "main config_reference layout_reference",
    )
)


def wing_of(module: str) -> str:
    """recipe_gkd.X.Y -> X (recipe_gkd itself: recipe_gkd); any teacher_server module: teacher_server."""
    parts = module.split(".")
    if parts[0] == "teacher_server":
        return "teacher_server"
    return parts[1] if len(parts) > 1 else parts[0]


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a wing to a wing of a higher layer (a wing missing from LAYERS is one too)."""
    level = {wing: i for i, layer in enumerate(LAYERS) for wing in layer}
    found = []
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            low, high = wing_of(module), wing_of(other)
            if low == high:
                continue
            if low not in level or high not in level:
                found.append(f"{module} -> {other} (a wing not in LAYERS)")
            elif level[high] > level[low]:
                found.append(f"{module} -> {other}")
    return found


def test_no_wing_imports_a_wing_above_it() -> None:
    up = upward_edges(project_graph())
    assert not up, "imports up the layers: " + "; ".join(up)


def test_an_upward_import_is_found() -> None:
    graph = {"recipe_gkd.observe.rows": {"recipe_gkd.runtime.pools"}, "recipe_gkd.runtime.x": {"recipe_gkd.observe"}}
    assert upward_edges(graph) == ["recipe_gkd.observe.rows -> recipe_gkd.runtime.pools"]


def test_the_component_finder_sees_a_cycle_through_a_package_init() -> None:
    """The case a plain cycle search that skips package -> own-submodule edges misses: a.b imports c, c imports a,
    and a (the package) imports a.b."""
    graph = {"top.p": {"top.p.kinds"}, "top.p.kinds": {"top.q.user"}, "top.q.user": {"top.p"}, "top.r": set()}
    assert strongly_connected_components(graph) == [["top.p", "top.p.kinds", "top.q.user"]]
    assert find_cycle(graph) == [], "the old search skips the top.p -> top.p.kinds edge"
    assert {package_of(m) for m in strongly_connected_components(graph)[0]} == {"top.p", "top.q"}


def test_ray_is_imported_in_two_modules_only() -> None:
    users = {
        name
        for name, path in project_modules().items()
        if name.startswith("recipe_gkd") and any(m == "ray" or m.startswith("ray.") for m in imports_of(path))
    }
    assert users == RAY_MODULES, f"Ray imported outside {sorted(RAY_MODULES)}: {sorted(users - RAY_MODULES)}"


def _importers_of(top: str) -> set[str]:
    return {
        name
        for name, path in project_modules().items()
        if any(m == top or m.startswith(top + ".") for m in imports_of(path))
    }


def test_vllm_is_imported_in_one_module_on_each_side() -> None:
    users = _importers_of("vllm")
    assert users == VLLM_MODULES, f"vLLM imported outside {sorted(VLLM_MODULES)}: {sorted(users - VLLM_MODULES)}"


def test_megatron_is_imported_inside_the_actor_package_only() -> None:
    users = _importers_of("megatron")
    outside = sorted(u for u in users if not u.startswith(MEGATRON_PACKAGE + "."))
    assert users and not outside, f"megatron imported outside {MEGATRON_PACKAGE}: {outside}"


def test_the_teacher_server_imports_nothing_from_the_trainer() -> None:
    offenders = {
        name: sorted(m for m in imports_of(path) if m.split(".")[0] == "recipe_gkd")
        for name, path in project_modules().items()
        if name.startswith("teacher_server")
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"teacher_server imports recipe_gkd: {offenders}"


# teacher_server's layers: the wire at the bottom with the config both sides read; the client and the server above it,
# the client reaching a server only over the wire (or as a subprocess). (layer, the layers it must not import)
TEACHER_SERVER_SEAMS = (
    ("teacher_server.config", ("teacher_server.wire", "teacher_server.client", "teacher_server.server")),
    ("teacher_server.wire", ("teacher_server.client", "teacher_server.server", "teacher_server.config")),
    ("teacher_server.client", ("teacher_server.server",)),
)


@pytest.mark.parametrize(("layer", "forbidden"), TEACHER_SERVER_SEAMS)
def test_the_teacher_server_layers_import_downwards_only(layer: str, forbidden: tuple[str, ...]) -> None:
    modules = project_modules()
    members = [m for m in modules if m == layer or m.startswith(layer + ".")]
    assert len(members) >= 3, f"{layer}: no such package"
    offenders = {
        name: sorted(m for m in imports_of(modules[name]) if any(m == f or m.startswith(f + ".") for f in forbidden))
        for name in members
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"{layer} imports {', '.join(forbidden)}: {offenders}"


# The loop and the callers of a target kind hold it through the registry (recipe_gkd.targets: build_target), never
# by importing a kind's own module: a kind is added in its module and the registry alone.
TARGET_CALLERS = (
    "recipe_gkd.gkd",
    "recipe_gkd.rollout.worker",
    "recipe_gkd.rollout.teacher_set",
    "recipe_gkd.actor.collate",
    "recipe_gkd.actor.objective",
    "recipe_gkd.plan.memory_plan",
)


@pytest.mark.parametrize("caller", TARGET_CALLERS)
def test_the_loop_and_the_workers_import_no_target_kind_module(caller: str) -> None:
    modules = project_modules()
    kinds = {m for m in modules if m.startswith("recipe_gkd.targets.") and m != "recipe_gkd.targets.base"}
    assert {"recipe_gkd.targets.hidden", "recipe_gkd.targets.spans", "recipe_gkd.targets.union"} <= kinds
    imported = imports_of(modules[caller]) & kinds
    assert not imported, f"{caller} imports target kind modules {sorted(imported)}: use recipe_gkd.targets"


def test_the_product_imports_nothing_from_the_demo() -> None:
    """recipe_gkd/demo is the CPU demo's task and asset builder: the product runs on any dataset without it."""
    offenders = {
        name: sorted(m for m in imports_of(path) if m.startswith("recipe_gkd.demo"))
        for name, path in project_modules().items()
        if not name.startswith("recipe_gkd.demo")
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"the product imports the demo: {offenders}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import ray\n", {"ray"}),
        ("def f():\n    from ray.util import x\n", {"ray.util", "ray.util.x"}),
        ("from . import sibling\n", {"pkg", "pkg.sibling"}),
    ],
)
def test_imports_are_found_at_any_depth(tmp_path: Path, source: str, expected: set[str]) -> None:
    (tmp_path / "pkg").mkdir()
    path = tmp_path / "pkg" / "mod.py"
    path.write_text(source)
    assert imports_of(path, root=tmp_path) == expected
