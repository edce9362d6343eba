"""The pools on Ray: every actor rank and rollout worker a Ray actor in its placement-group bundle.

One of the two modules that import Ray (the other, recipe_gkd/runtime/ray_cluster.py, starts the cluster
and makes the placement groups). Everything here implements recipe_gkd/pools.py's Protocols:
- `RayActorPool`, `RayRolloutPool`: `.remote` calls; the shards travel as object refs from the
  rollout workers to the actor ranks (the driver holds refs and small stats only);
- the weight sync: `ray_transport` builds the run's transport (object store, gloo, nccl: recipe_gkd/weight_sync/
  transports.py) once, `open_weight_sync` hands it to every worker and drives it over a `RayCrew` of remote calls;
  Ray's object store behind the object-store transport is `RayBucketStore`;
- `wait` / `wait_done`: every blocking call on a worker, bounded by debug.hang_timeout_s (the
  workers' set-up: debug.setup_timeout_s) and
  naming its phase; a timeout first has every worker dump its Python stack (recipe_gkd/runtime/watchdog.py);
- `launch_pools`: placement groups, workers, the weight sync (a collective's group) and the watchdog; all
  stopped on exit.
The worker classes stay plain (tests build them directly): `ray.remote` is applied here, to
subclasses that add the methods taking and giving object refs.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from recipe_gkd.batch import only_teacher
from recipe_gkd.config import (
    GKDConfig,
    Precision,
    WeightTransport,
    actor_data_parallel_size,
    weight_group_ranks_per_engine,
    weight_transport,
)
from recipe_gkd.parallel_layout import data_parallel_rank
from recipe_gkd.plan.memory_plan import object_store_mib
from recipe_gkd.plan.placement import PlacementPlan, Slot
from recipe_gkd.plan.ports import reserve_ports
from recipe_gkd.pools import Pending, Pools, Produced
from recipe_gkd.rollout.answer_accuracy import AnswerAccuracy
from recipe_gkd.rollout.worker import RolloutWorker
from recipe_gkd.runtime import watchdog
from recipe_gkd.runtime.model_pins import Reader, on_this_node
from recipe_gkd.runtime.ray_cluster import ResourcePoolManager, SpillWatch
from recipe_gkd.runtime.watchdog import HANG_KEY, SETUP_KEY, WorkerProcess, phase_timeout
from recipe_gkd.targets import actor_kinds, build_target
from recipe_gkd.weight_sync import (
    COLLECTIVES,
    GroupAddress,
    ObjectStore,
    SyncDriver,
    Transport,
    WeightSyncError,
    build_payload,
)

# ----------------------------------------------------------------------------- bounded waits


def wait(refs: list[Any], timeout_s: float, phase: str, key: str = HANG_KEY) -> list[Any]:
    """ray.get with a timeout whose error names the phase and the key to change (`key`, the bound's)."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        raise phase_timeout(phase, timeout_s, key) from None


def wait_done(refs: list[Any], timeout_s: float, phase: str) -> None:
    """Block until every task behind `refs` has finished, without fetching (nor raising) its result."""
    import ray

    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)
    if pending:
        raise phase_timeout(phase, timeout_s)


# ----------------------------------------------------------------------------- the worker classes on Ray


class RayRolloutWorker(RolloutWorker):
    """The rollout worker with its shards put into Ray's object store and its buckets fetched from it."""

    def setup(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        # The driver's pinned hub ids, resolved in this node's cache before anything loads (recipe_gkd/runtime/model_pins.py).
        self.cfg = on_this_node(self.cfg, Reader.rollout)
        return super().setup(*args, **kwargs)

    def produce(self, step: int, dp_size: int) -> Produced:  # type: ignore[override]
        return _put_shards(super().produce(step, dp_size))

    def score(self, step: int, dp_size: int) -> Produced:  # type: ignore[override]
        return _put_shards(super().score(step, dp_size))

    def produce_eval(self, dp_size: int) -> Produced:  # type: ignore[override]
        return _put_shards(super().produce_eval(dp_size))


def _put_shards(produced: tuple[Any, list[Any]]) -> Produced:
    import ray

    stats, shards = produced
    return stats, [ray.put(s) for s in shards]


def ray_actor_worker_class() -> type:
    """The actor worker plus the methods taking and giving object refs (megatron imported lazily)."""
    from recipe_gkd.actor.worker import actor_worker_class

    class RayActorWorker(actor_worker_class()):  # type: ignore[misc]
        def setup(self) -> dict[str, Any]:
            # The driver's pinned hub ids, resolved in this node's cache before anything loads.
            self.cfg = on_this_node(self.cfg, Reader.actor)
            return super().setup()

        def train_refs(self, shard_refs: list[Any]) -> dict[str, float]:
            """Train on the TrainShards behind `shard_refs` (one per rollout worker)."""
            import ray

            return self.train(ray.get(shard_refs))

        def eval_refs(self, shard_refs: list[Any], teacher: str | None = None) -> dict[str, float]:
            import ray

            return self.eval_loss([only_teacher(s, teacher) for s in ray.get(shard_refs)])

    return RayActorWorker


# ----------------------------------------------------------------------------- the pools


class RayRolloutPool:
    """RolloutPool over Ray actors (max_concurrency 2: two_step_off scores t+1 beside generating t+2)."""

    def __init__(self, handles: list[Any], dp_size: int, timeout_s: float) -> None:
        self.handles, self.dp_size, self.timeout_s = handles, dp_size, timeout_s
        self.size = len(handles)

    def produce(self, step: int) -> Pending:
        return [r.produce.remote(step, self.dp_size) for r in self.handles]

    def generate(self, step: int) -> Pending:
        return [r.generate.remote(step) for r in self.handles]

    def score(self, step: int) -> Pending:
        return [r.score.remote(step, self.dp_size) for r in self.handles]

    def produce_eval(self) -> Pending:
        return [r.produce_eval.remote(self.dp_size) for r in self.handles]

    def wait(self, pending: Pending, phase: str) -> list[Any]:
        return wait(pending, self.timeout_s, phase)

    def wait_done(self, pending: Pending, phase: str) -> None:
        wait_done(pending, self.timeout_s, phase)

    def data_positions(self, batch: int) -> list[int]:
        return wait([r.data_position.remote(batch) for r in self.handles], self.timeout_s, "checkpoint positions")

    def set_positions(self, positions: list[int]) -> None:
        calls = [r.set_position.remote(p) for r, p in zip(self.handles, positions, strict=True)]
        wait(calls, self.timeout_s, "checkpoint positions")

    def teacher_accuracy(self, own_prompt: bool = False) -> AnswerAccuracy:
        # In rollout worker 0, which has torch and transformers loaded (a Ray task of its own cost a
        # new process, ~4 s of a core).
        return wait([self.handles[0].teacher_accuracy.remote(own_prompt)], self.timeout_s, "teacher accuracy")[0]


class RayActorPool:
    """ActorPool over Ray actors: tensor-parallel ranks of one replica get the same shards."""

    def __init__(self, cfg: GKDConfig, handles: list[Any], summary: str) -> None:
        self.cfg, self.handles, self.summary = cfg, handles, summary
        self.dp_size = actor_data_parallel_size(cfg)
        self.timeout_s = cfg.debug.hang_timeout_s

    def train(self, shards: list[list[Any]]) -> list[dict[str, float]]:
        calls = [a.train_refs.remote(shards[data_parallel_rank(self.cfg, r)]) for r, a in enumerate(self.handles)]
        return wait(calls, self.timeout_s, "train")

    def eval_loss(self, shards: list[list[Any]], teacher: str | None = None) -> dict[str, float | None]:
        calls = [
            a.eval_refs.remote(shards[data_parallel_rank(self.cfg, r)], teacher) for r, a in enumerate(self.handles)
        ]
        return wait(calls, self.timeout_s, "eval loss")[0]

    def save_checkpoint(self, path: str) -> None:
        wait([a.save_checkpoint.remote(path) for a in self.handles], self.timeout_s, "checkpoint save")

    def load_checkpoint(self, path: str) -> None:
        wait([a.load_checkpoint.remote(path) for a in self.handles], self.timeout_s, "checkpoint load")

    def export_hf(self, out_dir: str) -> None:
        wait([a.save_hf.remote(out_dir) for a in self.handles], self.timeout_s, "export")

    def export_adapter(self, out_dir: str) -> None:
        wait([a.save_adapter.remote(out_dir) for a in self.handles], self.timeout_s, "adapter export")


# ----------------------------------------------------------------------------- the weight sync on Ray


class RayBucketStore:
    """Ray's object store as the object-store transport's store (weight_sync.BucketStore): rank 0 puts each bucket
    once it is full, each rollout worker fetches them one at a time; the driver's copy says once when it spills."""

    def __init__(self, spills: SpillWatch | None = None) -> None:
        self.spills = spills

    def put(self, bucket: dict[str, Any]) -> Any:
        import ray

        return ray.put(bucket)

    def get(self, handle: Any, timeout_s: float) -> dict[str, Any]:
        import ray

        return ray.get(handle, timeout=timeout_s)

    def after_push(self) -> None:
        if self.spills is not None and (warning := self.spills.check()):
            from tqdm import tqdm

            tqdm.write(warning)  # above the driver's progress bar, once


def ray_transport(cfg: GKDConfig, host: str, port: int, engines: int) -> Transport:
    """The transport of `cfg`'s weight sync on Ray, carrying `build_payload(cfg)`: weight_sync.transport (auto
    resolved), the rollout backend's receivers per engine, actor rank 0's rendezvous `host`:`port`. The one place that
    reads the transport's name: built once by `launch_pools` and handed to every worker."""
    payload = build_payload(cfg)
    kind = weight_transport(cfg)
    if kind == WeightTransport.object_store:
        return ObjectStore(cfg.weight_sync, payload, RayBucketStore(SpillWatch(object_store_mib(cfg))))
    group = GroupAddress(host, port, weight_group_ranks_per_engine(cfg), engines)
    wire_dtype = "bfloat16" if cfg.actor.precision == Precision.bf16 else None
    return COLLECTIVES[kind.value](cfg.weight_sync, payload, group, wire_dtype)


class RayCrew:
    """The workers a weight sync touches, on Ray (weight_sync.SyncCrew): remote calls, every wait bounded by
    weight_sync.timeout_s. Every actor rank takes part in a send (the export gathers over tensor parallelism)."""

    def __init__(self, actors: list[Any], rollouts: list[Any], timeout_s: float) -> None:
        self.actors, self.rollouts, self.timeout_s = actors, rollouts, timeout_s
        self.rollout_count = len(rollouts)

    def on_actors(self, method: str, *args: Any) -> list[Any]:
        return [getattr(a, method).remote(*args) for a in self.actors]

    def on_rollouts(self, method: str, *args: Any, only: int | None = None) -> list[Any]:
        handles = self.rollouts if only is None else [self.rollouts[only]]
        return [getattr(r, method).remote(*args) for r in handles]

    def wait(self, pending: list[Any], what: str) -> list[Any]:
        return _await(pending, self.timeout_s, what)


def open_weight_sync(actors: list[Any], rollouts: list[Any], transport: Transport, timeout_s: float) -> SyncDriver:
    """Hand `transport` to every actor rank and rollout worker (a collective's group joined, all at once, within
    `timeout_s`), and the driver's side over them (launch_pools; the tests and benchmarks over their own workers)."""
    joins = [a.init_weight_sync.remote(transport) for a in actors]
    joins += [r.init_weight_sync.remote(transport, i) for i, r in enumerate(rollouts)]
    wait(joins, timeout_s, transport.setup_phase, SETUP_KEY)
    return SyncDriver(RayCrew(actors, rollouts, transport.settings.timeout_s), transport)


def _await(refs: list[Any], timeout_s: float, what: str) -> list[Any]:
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    start = time.monotonic()
    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        dumped = watchdog.dump_stacks(f"weight sync {what}")  # before the cancel: the stacks show where it hung
        for ref in refs:
            ray.cancel(ref, force=False)
        raise WeightSyncError(f"{what} did not finish within weight_sync.timeout_s={timeout_s}s{dumped}") from None
    except RayError as err:
        if time.monotonic() - start >= timeout_s:
            # The collective group's own timeout (the same weight_sync.timeout_s) fired in a worker before this wait's.
            raise WeightSyncError(f"{what} did not finish within weight_sync.timeout_s={timeout_s}s: {err}") from err
        raise WeightSyncError(f"{what} failed: {err}") from err


# ----------------------------------------------------------------------------- launch and stop


@contextmanager
def launch_pools(cfg: GKDConfig, plan: PlacementPlan, teacher_address: Callable[[], dict[str, str]]) -> Iterator[Pools]:
    """Placement groups, then every actor rank and rollout worker set up; all stopped on exit (Ray must be up).

    `teacher_address` is called once the actor ranks are setting up (an autostarted teacher may
    still be loading until then): the rollout workers connect to what it returns (teacher name -> address).
    """
    import ray

    start = time.perf_counter()
    timeout = cfg.debug.hang_timeout_s
    groups = ResourcePoolManager(plan, cfg.cluster.placement_timeout_s)
    handles: list[Any] = []
    try:
        groups.create()
        actor_slots, rollout_slots = plan.role("actor"), plan.role("rollout")
        host, (megatron_port, sync_port) = _rank0_endpoint(groups, actor_slots[0], cfg.cluster.placement_timeout_s)
        # The run's target kind and objective, built once here and handed to every worker (pickled into each).
        kinds, target = actor_kinds(cfg), build_target(cfg)
        actor_cls = ray.remote(num_cpus=0)(ray_actor_worker_class())
        actors = [
            actor_cls.options(num_gpus=groups.gpu_request(s), scheduling_strategy=groups.scheduling_strategy(s)).remote(
                cfg, s.rank, len(actor_slots), host, megatron_port, kinds
            )
            for s in actor_slots
        ]
        # Two threads: two_step_off scores batch t+1 while generating t+2 (the worker locks its engine).
        rollout_cls = ray.remote(num_cpus=0, max_concurrency=2)(RayRolloutWorker)
        rollouts = [
            rollout_cls.options(
                num_gpus=groups.gpu_request(s), scheduling_strategy=groups.scheduling_strategy(s)
            ).remote(cfg, s.rank, len(rollout_slots), target)
            for s in rollout_slots
        ]
        handles = actors + rollouts
        names = {f"actor{i}": a for i, a in enumerate(actors)} | {f"rollout{i}": r for i, r in enumerate(rollouts)}
        install_watchdog(names, cfg.trainer.run_dir, cfg.cluster.placement_timeout_s)
        ready = _set_up(actors, rollouts, teacher_address, plan.colocated, cfg.debug.setup_timeout_s)
        transport = ray_transport(cfg, host, sync_port, len(rollouts))
        weights = open_weight_sync(actors, rollouts, transport, cfg.debug.setup_timeout_s)
        summary = str(ready[0].get("summary", ""))
        yield Pools(
            actor=RayActorPool(cfg, actors, summary),
            rollout=RayRolloutPool(rollouts, actor_data_parallel_size(cfg), timeout),
            weights=weights,
            setup_s=time.perf_counter() - start,
        )
    finally:
        watchdog.uninstall()
        _stop(handles, timeout)
        groups.remove()


def _set_up(
    actors: list[Any],
    rollouts: list[Any],
    teacher_address: Callable[[], dict[str, str]],
    colocated: bool,
    timeout_s: float,
) -> list[dict[str, Any]]:
    """Every worker's setup(); the results, actors first.

    Disjoint pools set up together (the teacher loads meanwhile). Colocated roles set up one after
    another, actor, then teacher, then rollout, so that each vLLM engine's start-up check and
    memory profile see the others' memory already taken, never an allocation in progress
    (vllm/v1/worker/gpu_worker.py, Worker.init_device / determine_available_memory). The rollout
    engines come last because their setup connects to the teacher.
    """
    actor_setup = [a.setup.remote() for a in actors]
    if not colocated:
        address = teacher_address()
        return wait(
            actor_setup + [r.setup.remote(None, address) for r in rollouts], timeout_s, "worker setup", SETUP_KEY
        )
    marks = [time.perf_counter()]
    ready = wait(
        actor_setup, timeout_s, "actor setup (colocated: before the teacher and the rollout engines)", SETUP_KEY
    )
    marks.append(time.perf_counter())
    address = teacher_address()
    marks.append(time.perf_counter())
    ready += wait([r.setup.remote(None, address) for r in rollouts], timeout_s, "rollout setup", SETUP_KEY)
    marks.append(time.perf_counter())
    took = [f"{b - a:.1f} s" for a, b in itertools.pairwise(marks)]
    print(f"colocated set-up, one role at a time: actor {took[0]}, teacher {took[1]}, rollout {took[2]}", flush=True)
    return ready


def _rank0_endpoint(groups: ResourcePoolManager, slot: Slot, timeout_s: float) -> tuple[str, list[int]]:
    """Address and two free ports on actor rank 0's node: megatron's rendezvous, the weight-sync group's."""
    import ray

    if groups.plan.nnodes == 1:
        return "127.0.0.1", reserve_ports(2)

    @ray.remote(num_cpus=0)
    def endpoint() -> tuple[str, list[int]]:
        from recipe_gkd.plan.ports import reserve_ports

        return ray.util.get_node_ip_address(), reserve_ports(2, host="0.0.0.0")

    return wait(
        [endpoint.options(scheduling_strategy=groups.scheduling_strategy(slot)).remote()], timeout_s, "rendezvous"
    )[0]


def _stop(handles: list[Any], timeout_s: float) -> None:
    """Ask actors to release their process groups, then kill every worker this run started."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    shutdowns = [h.shutdown.remote() for h in handles if hasattr(h, "shutdown")]
    try:
        ray.get(shutdowns, timeout=min(timeout_s, 30.0))
    except (GetTimeoutError, RayError) as err:
        print(f"warning: a worker did not shut down cleanly ({type(err).__name__}); killing it", flush=True)
    for h in handles:
        ray.kill(h)


# ----------------------------------------------------------------------------- the watchdog on Ray


def install_watchdog(handles: dict[str, Any], run_dir: str, timeout_s: float) -> watchdog.Watchdog:
    """Register the stack dump in every worker (`handles`: name -> Ray actor handle); phase timeouts use it."""
    import ray

    dog = watchdog.Watchdog(Path(run_dir).resolve(), ray.get_runtime_context().get_node_id())
    names = list(handles)
    calls = [handles[n].__ray_call__.remote(_register, n, str(dog.run_dir), dog.driver_node) for n in names]
    registered = ray.get(calls, timeout=timeout_s)
    dog.workers = {n: WorkerProcess(*r) for n, r in zip(names, registered, strict=True)}
    dog.collect_remote = _collect_on
    return watchdog.install(dog)


def _register(_worker: Any, name: str, run_dir: str, driver_node: str) -> tuple[int, str, str]:
    """Inside a worker (via `__ray_call__`): its stack dump registered; (pid, node id, file)."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    pid, path = watchdog.register_stack_dump(name, run_dir, on_driver_node=node == driver_node)
    return pid, node, path


def _collect_on(node: str, workers: dict[str, WorkerProcess]) -> dict[str, str]:
    """collect_stacks run by a Ray task pinned to `node`; on failure every worker's text says why."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(watchdog.collect_stacks)
    strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
    timeout = watchdog.DUMP_WAIT_S + watchdog.PY_SPY_TIMEOUT_S * len(workers) + watchdog.REMOTE_SLACK_S
    ref = task.options(scheduling_strategy=strategy).remote(workers)
    try:
        return ray.get(ref, timeout=timeout)
    except Exception as err:  # noqa: BLE001 -- reported in each worker's dump file instead of masking the hang
        ray.cancel(ref, force=True)
        reason = f"stacks of node {node} not collected: {type(err).__name__}: {str(err)[:300]}\n"
        return dict.fromkeys(workers, reason)
