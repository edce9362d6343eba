"""The pools in the driver's own process: the same `gkd.train`, without Ray, processes or waits.

The workers are the real ones (the megatron actor, the rollout workers with their engines), held
as plain objects: one actor rank (actor world size 1), any number of rollout workers, and the
teacher either a `Scorer` given by the caller or `InProcessTeacher` (the teacher server's own HF
backend called directly, without the wire). Work runs when it is launched: `produce(t + 1)` of
one_step_off runs before the actor trains on batch t, so it samples with the weights before that
step, exactly what the overlapped Ray run samples with (its weight sync waits for generation).
A worker's error is kept and raised when its work is awaited, as on Ray.

Product use: the self-check's stage 0 (recipe_gkd/selfcheck/stage0_actor.py `loop_check`) runs the whole loop
this way on a machine without Ray or vLLM; the golden trajectories (benchmarks/golden_targets.py) and the tests
run `gkd.train` through it too. Nothing here is bounded by a timeout: it rehearses the loop on one machine and
is not a way to run a job (`python -m recipe_gkd.main` always runs on Ray).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from recipe_gkd.batch import TrainShard, only_teacher
from recipe_gkd.config import ConfigError, GKDConfig, actor_world_size, rollout_engines
from recipe_gkd.config.teachers import teacher_views
from recipe_gkd.plan.ports import reserve_ports
from recipe_gkd.pools import Pending, Pools
from recipe_gkd.rollout.answer_accuracy import AnswerAccuracy
from recipe_gkd.rollout.engine import Scorer
from recipe_gkd.rollout.worker import RolloutWorker
from recipe_gkd.targets import actor_kinds, build_target
from recipe_gkd.weight_sync import InProcess, SyncDriver, build_payload
from teacher_server.wire.protocol import TeacherScores


@dataclass
class Done:
    """Work a local pool ran when it was launched: one result per worker, or the first error raised."""

    results: list[Any] = field(default_factory=list)
    error: BaseException | None = None

    @staticmethod
    def run(calls: list[Callable[[], Any]]) -> Done:
        done = Done()
        try:
            done.results = [call() for call in calls]
        except Exception as err:  # noqa: BLE001 -- kept and raised where the work is awaited, as on Ray
            done.error = err
        return done


class LocalRolloutPool:
    """RolloutPool over RolloutWorker objects; a shard handle is the TrainShard itself."""

    def __init__(self, workers: list[RolloutWorker], dp_size: int) -> None:
        self.workers, self.dp_size = workers, dp_size
        self.size = len(workers)

    def produce(self, step: int) -> Pending:
        return Done.run([lambda w=w: w.produce(step, self.dp_size) for w in self.workers])

    def generate(self, step: int) -> Pending:
        return Done.run([lambda w=w: w.generate(step) for w in self.workers])

    def score(self, step: int) -> Pending:
        return Done.run([lambda w=w: w.score(step, self.dp_size) for w in self.workers])

    def produce_eval(self) -> Pending:
        return Done.run([lambda w=w: w.produce_eval(self.dp_size) for w in self.workers])

    def wait(self, pending: Pending, phase: str) -> list[Any]:
        done: Done = pending
        if done.error is not None:
            raise done.error
        return done.results

    def wait_done(self, pending: Pending, phase: str) -> None:
        """Already finished when launched; its error (if any) is raised by `wait`, as on Ray."""

    def data_positions(self, batch: int) -> list[int]:
        return [w.data_position(batch) for w in self.workers]

    def set_positions(self, positions: list[int]) -> None:
        for worker, position in zip(self.workers, positions, strict=True):
            worker.set_position(position)

    def teacher_accuracy(self, own_prompt: bool = False) -> AnswerAccuracy:
        return self.workers[0].teacher_accuracy(own_prompt)


class LocalActorPool:
    """ActorPool over one actor worker (actor world size 1, data-parallel size 1)."""

    dp_size = 1

    def __init__(self, actor: Any, summary: str) -> None:
        self.actor, self.summary = actor, summary

    def train(self, shards: list[list[TrainShard]]) -> list[dict[str, float]]:
        return [self.actor.train(shards[0])]

    def eval_loss(self, shards: list[list[TrainShard]], teacher: str | None = None) -> dict[str, float | None]:
        result: dict[str, float | None] = self.actor.eval_loss([only_teacher(s, teacher) for s in shards[0]])
        return result

    def save_checkpoint(self, path: str) -> None:
        self.actor.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.actor.load_checkpoint(path)

    def export_hf(self, out_dir: str) -> None:
        self.actor.save_hf(out_dir)

    def export_adapter(self, out_dir: str) -> None:
        self.actor.save_adapter(out_dir)


class LocalCrew:
    """The workers a weight sync touches, in this process (weight_sync.SyncCrew): each call runs when launched and
    raises there, unbounded; the in-process transport's export reaches a worker as a lazy stream."""

    def __init__(self, actor: Any, workers: list[RolloutWorker]) -> None:
        self.actor, self.workers = actor, workers
        self.rollout_count = len(workers)

    def on_actors(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.actor, method)(*args)]

    def on_rollouts(self, method: str, *args: Any, only: int | None = None) -> list[Any]:
        workers = self.workers if only is None else [self.workers[only]]
        return [getattr(w, method)(*args) for w in workers]

    def wait(self, pending: list[Any], what: str) -> list[Any]:
        return pending


class InProcessTeacher:
    """The teacher server's HF backend called in-process: what a replica computes, without the wire.

    Scores at teacher.top_k and teacher.temperature like the client asks the server to.
    """

    def __init__(self, cfg: GKDConfig) -> None:
        from teacher_server.server.backends import BackendOptions, load_backend

        t = cfg.teacher
        if t.backend.value != "hf":
            raise ConfigError("teacher.backend", f"the in-process teacher runs the hf backend, got {t.backend.value}")
        options = BackendOptions(
            model_path=t.model_path, max_top_k=t.max_top_k, max_batch_tokens=t.max_batch_tokens, dtype=t.dtype
        )
        self.backend = load_backend("hf", options)
        # What TeacherClient.from_config asks the server for (the target kind's: e.g. hidden states, no top-k).
        request = build_target(cfg).request_options(cfg)
        self.top_k, self.hidden_dtype, self.temperature = request["top_k"], request["hidden_dtype"], t.temperature

    def score(
        self, sequences: list[np.ndarray], score_from: list[int], named_ids: list[np.ndarray] | None = None
    ) -> list[TeacherScores]:
        from teacher_server.server.backends import parsed_request

        request = parsed_request(
            sequences,
            score_from,
            top_k=self.top_k,
            temperature=self.temperature,
            named_ids=named_ids,
            hidden_dtype=self.hidden_dtype,
        )
        return self.backend.score(request).split()


@contextmanager
def local_pools(cfg: GKDConfig, scorer: Scorer | None = None) -> Iterator[Pools]:
    """The actor and the rollout workers of `cfg` set up in this process; shut down on exit."""
    from recipe_gkd.actor.worker import actor_worker_class

    if actor_world_size(cfg) != 1:
        raise ConfigError(
            "actor.gpus_per_node",
            f"the in-process pools hold one actor rank, the config asks for {actor_world_size(cfg)} "
            "(actor.nnodes x actor.gpus_per_node); run it with python -m recipe_gkd.main",
        )
    start = time.perf_counter()
    with ExitStack() as stack:
        actor = actor_worker_class()(cfg, 0, 1, "127.0.0.1", reserve_ports(1)[0], actor_kinds(cfg))
        stack.callback(actor.shutdown)
        summary = str(actor.setup().get("summary", ""))
        teacher = scorer if scorer is not None else {n: InProcessTeacher(v) for n, v in teacher_views(cfg).items()}
        target = build_target(cfg)  # the run's target kind, built once and handed to every worker
        workers = [RolloutWorker(cfg, rank, rollout_engines(cfg), target) for rank in range(rollout_engines(cfg))]
        for worker in workers:
            worker.setup(scorer=teacher)
            stack.callback(worker.shutdown)  # closes the scorer's connection, if it has one
        # The weight sync's transport here: the actor's export streamed straight into each worker.
        transport = InProcess(cfg.weight_sync, build_payload(cfg))
        actor.init_weight_sync(transport)
        for index, worker in enumerate(workers):
            worker.init_weight_sync(transport, index)
        yield Pools(
            actor=LocalActorPool(actor, summary),
            rollout=LocalRolloutPool(workers, dp_size=1),
            weights=SyncDriver(LocalCrew(actor, workers), transport),
            setup_s=time.perf_counter() - start,
        )
