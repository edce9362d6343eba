"""On-policy knowledge distillation (GKD): the training loop, top to bottom.

1. Each rollout worker takes its shard of the step's prompts, samples responses with the
   student (a fraction 1 - algorithm.lmbda comes from the dataset instead), and has the
   teacher server score every response token with its top-k logprobs.
2. Each actor rank trains on its share: the GKD divergence over the teacher's top-k plus a
   tail bucket (or algorithm.divergence=sampled_reverse_kl: a policy-gradient step with the advantage
   log t - log s_old of each sampled token), token mean over the whole global batch, one optimizer step.
3. The new weights go to every rollout worker; the weight version goes up by one.
4. Metrics every step (a diverging objective, responses cut by the length limit, or a gradient of exactly zero
   are named in one line: observe/divergence_watch.py, observe/clip_watch.py, observe/grad_watch.py); a few decoded samples in samples.jsonl; evaluation
   every trainer.eval_every steps; a checkpoint every trainer.save_every steps (resumed from by
   trainer.resume=auto); the student exported at the end.

    python -m recipe_gkd.main                                            # CPU demo
    python -m recipe_gkd.main --config configs/presets/1x8_a1_r3_t4.yaml  # one 8-GPU node

The loop talks to its workers through recipe_gkd/pools.py: on Ray (runtime/ray_pools.py, every run)
the driver holds no model and no per-token data, it passes object refs between the pools;
in-process (runtime/local_pools.py, the tests) the same loop runs with the workers as plain objects.
What each step logs is built in observe/rows.py, the report after training in observe/report.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipe_gkd.batch import RolloutStats
from recipe_gkd.config import PIPELINE_DEPTH, GKDConfig, to_dict
from recipe_gkd.config.teachers import teacher_handles
from recipe_gkd.observe import console
from recipe_gkd.observe.clip_watch import ClipWatch
from recipe_gkd.observe.divergence_watch import DIVERGENCE_FILE, DivergenceWatch
from recipe_gkd.observe.grad_watch import ZeroGradWatch
from recipe_gkd.observe.metrics import MetricsLogger
from recipe_gkd.observe.report import FINAL_ADAPTER_DIR, FINAL_EXPORT_DIR, report, teacher_accuracy
from recipe_gkd.observe.rows import MEMORY_SUFFIXES, eval_row, eval_teacher_kls, memory_row, step_row
from recipe_gkd.plan.placement import PlacementPlan
from recipe_gkd.pools import Pending, Pools, ShardHandle
from recipe_gkd.runtime import checkpoint
from recipe_gkd.runtime.ray_cluster import ray_cluster
from recipe_gkd.runtime.ray_pools import launch_pools
from recipe_gkd.runtime.teacher_service import teacher_service
from recipe_gkd.targets import build_target
from recipe_gkd.weight_sync import SyncCheck

__all__ = ["FINAL_EXPORT_DIR", "RunDiverged", "RunStopped", "run", "train"]
# Teacher failures that survived the client's retries (bounded by teacher.timeout_s): the run stops.
TEACHER_DOWN_ERRORS = ("TeacherDeadError", "TeacherTimeoutError")


class RunStopped(RuntimeError):
    """The run stopped on purpose (a teacher that stays down); the message is one line saying what to do."""


class RunDiverged(RuntimeError):
    """trainer.stop_on_divergence: the objective diverged, the run saved a checkpoint and stopped."""


@dataclass
class Rollout:
    """One step's data as the driver sees it: stats, and per actor rank the handles of its shards."""

    stats: list[RolloutStats]
    shards: list[list[ShardHandle]]  # [dp rank][rollout worker]
    seconds: float


def run(cfg: GKDConfig, plan: PlacementPlan) -> Path:
    """Run the configured distillation to the end (from the checkpoint trainer.resume picks); returns the run dir."""
    resume = checkpoint.prepare_resume(cfg)  # before anything starts: a config mismatch exits at once
    metrics = metrics_logger(cfg)
    console.quiet_known_warnings(cfg.trainer.run_dir)  # the workers do the same (ray_cluster)
    try:
        with teacher_service(cfg) as teacher, ray_cluster(cfg, plan), launch_pools(cfg, plan, teacher) as pools:
            print(f"workers ready in {pools.setup_s:.1f}s; actor: {pools.actor.summary}", flush=True)
            train(cfg, pools, metrics, resume)
            report(cfg, *teacher_accuracy(cfg, pools.rollout))
    finally:
        metrics.close()
    return Path(cfg.trainer.run_dir)


def metrics_logger(cfg: GKDConfig) -> MetricsLogger:
    """The configured sinks (trainer.loggers); a W&B run gets the resolved config as its config."""
    tr = cfg.trainer
    return MetricsLogger(tr.run_dir, tr.loggers, tr.total_steps, wandb=tr.wandb, run_config=to_dict(cfg))


def train(cfg: GKDConfig, pools: Pools, metrics: MetricsLogger, resume: Path | None) -> None:
    # Fresh: the rollout workers start from the same student weights as the actor, version 0.
    first, version = checkpoint.restore(cfg, pools, resume) if resume else (0, 0)
    if cfg.trainer.eval_every and first == 0:
        evaluate(cfg, pools, metrics, step=0)
    metrics.start_progress(first)
    pipeline = RolloutPipeline(cfg, pools, first)
    watch = DivergenceWatch.for_run(cfg, first)
    clipped = ClipWatch(cfg.rollout.sampling.max_new_tokens)
    zero_grad = ZeroGradWatch(trained_description(cfg))
    sync_check = SyncCheck(cfg)  # the engines' weights and logprobs against the actor's, when due
    target = build_target(cfg)  # the target kind: which columns its teacher replies allow
    for step in range(first, cfg.trainer.total_steps):
        start = time.perf_counter()
        rollout = next_batch(cfg, pools, pipeline, step, version)  # launches the work the schedule overlaps
        check_staleness(cfg, rollout, version)
        stats = train_on(pools, rollout)
        pipeline.wait_for_generation()  # the engines must be idle before their weights change
        sync = pools.weights.push(version + 1)
        version += 1
        sync |= sync_check.after_sync(pools.weights, version)
        row = step_row(
            cfg, target, step, version, rollout.stats, rollout.seconds, stats, sync, time.perf_counter() - start
        )
        if cfg.debug.log_memory:
            row.update(memory_row(rollout.stats, stats))
        metrics.log_step(row)
        metrics.log_samples(step + 1, rollout.stats[0].step, (s for st in rollout.stats for s in st.samples))
        watch_divergence(cfg, pools, watch, row, version)
        watch_clipped(clipped, row, rollout.stats)
        if (line := zero_grad.observe(row)) is not None:
            print(line, flush=True)
        if cfg.trainer.eval_every and (step + 1) % cfg.trainer.eval_every == 0:
            evaluate(cfg, pools, metrics, step=step + 1)
        if cfg.trainer.save_every and (step + 1) % cfg.trainer.save_every == 0:
            checkpoint.save(cfg, pools, step + 1, version)
    if ends_between_evaluations(cfg, first):
        evaluate(cfg, pools, metrics, step=cfg.trainer.total_steps)  # the report's last column is the trained student
    metrics.end_progress()
    export_student(cfg, pools)


def ends_between_evaluations(cfg: GKDConfig, first: int) -> bool:
    """The run trains past its last periodic evaluation (trainer.total_steps not a multiple of trainer.eval_every):
    the trained student is evaluated once more at the end."""
    tr = cfg.trainer
    return tr.eval_every > 0 and tr.total_steps % tr.eval_every != 0 and first < tr.total_steps


class RolloutPipeline:
    """The rollout pool's work in flight, per algorithm.schedule. Every batch is produced once, in order.

    sync:         batch t is generated and scored when step t asks for it.
    one_step_off: batch t+1 is generated and scored while the actor trains on batch t.
    two_step_off: batch t+2 is generated and batch t+1 scored while the actor trains on batch t.
    Work is only launched for steps < trainer.total_steps, so nothing is left in flight at the end.
    A resumed run starts at batch `first` (the rollout workers were set back to its data position).

    A periodic checkpoint (trainer.save_every) is a pipeline boundary: no batch after it is launched before it,
    and the pipeline starts afresh there, as at the run's start. So the batches after a checkpoint are sampled
    with its weights, in the run that saved it and in a run resumed from it alike: a resumed run repeats the
    trajectories of the uninterrupted one, token for token. The cost: the overlap of one step (one_step_off) or
    two (two_step_off) per checkpoint.
    """

    def __init__(self, cfg: GKDConfig, pools: Pools, first: int = 0) -> None:
        self.rollout, self.dp_size, self.first = pools.rollout, pools.actor.dp_size, first
        self.depth = PIPELINE_DEPTH[cfg.algorithm.schedule]
        self.total = cfg.trainer.total_steps
        self.save_every = cfg.trainer.save_every
        self.generating: dict[int, Pending] = {}  # two_step_off: step -> generate()
        self.producing: dict[int, Pending] = {}  # step -> produce() / score()

    def starts_afresh(self, step: int) -> bool:
        """Batch `step` begins a pipeline: the run's first, or the first after a periodic checkpoint."""
        return step == self.first or (self.save_every > 0 and step % self.save_every == 0)

    def horizon(self, step: int) -> int:
        """The first batch after `step` that may not be launched yet: the next boundary, or the end."""
        if self.save_every == 0:
            return self.total
        return min(self.total, (step // self.save_every + 1) * self.save_every)

    def next_batch(self, step: int) -> Rollout:
        start = time.perf_counter()
        if self.starts_afresh(step):
            self._prefill(step)
        if self.depth == 0:
            self._produce(step)
        results = self.rollout.wait(self.producing.pop(step), f"rollout of step {step}")
        horizon = self.horizon(step)
        if self.depth == 1 and step + 1 < horizon:
            self._produce(step + 1)
        if self.depth == 2:
            if step + 1 < horizon:
                self._score(step + 1)
            if step + 2 < horizon:
                self._generate(step + 2)
        stats = [s for s, _ in results]
        return Rollout(stats, by_rank(results, self.dp_size), time.perf_counter() - start)

    def wait_for_generation(self) -> None:
        """Block until no engine is sampling (one_step_off waits for the whole produce of t+1)."""
        in_flight = self.generating if self.depth == 2 else self.producing
        for step, pending in in_flight.items():
            # Finished, not fetched: a failure (teacher down) surfaces when batch `step` is asked for.
            self.rollout.wait_done(pending, f"generation of step {step}")

    def _prefill(self, step: int) -> None:
        if self.depth == 1:
            self._produce(step)
        if self.depth == 2:
            self._generate(step)
            self._score(step)
            if step + 1 < self.horizon(step):
                self._generate(step + 1)

    def _produce(self, step: int) -> None:
        self.producing[step] = self.rollout.produce(step)

    def _generate(self, step: int) -> None:
        self.generating[step] = self.rollout.generate(step)

    def _score(self, step: int) -> None:
        # The worker scores what it generated for `step`: that generation must be finished.
        self.rollout.wait(self.generating.pop(step), f"generation of step {step}")
        self.producing[step] = self.rollout.score(step)


def by_rank(results: list[Any], dp_size: int) -> list[list[ShardHandle]]:
    """Per actor data-parallel rank, its shard from every rollout worker ([dp rank][rollout worker])."""
    return [[shards[d] for _, shards in results] for d in range(dp_size)]


def next_batch(cfg: GKDConfig, pools: Pools, pipeline: RolloutPipeline, step: int, version: int) -> Rollout:
    """Batch `step` of the pipeline. If the teacher stays down, checkpoint the `step` trained batches and stop."""
    try:
        return pipeline.next_batch(step)
    except Exception as err:  # Ray re-raises a worker's error as RayTaskError(<its type>)
        cause = getattr(err, "cause", err)
        if type(cause).__name__ not in TEACHER_DOWN_ERRORS:
            raise
        raise stop_for_teacher(cfg, pools, step, version, cause, trained_here=step > pipeline.first) from err


def stop_for_teacher(
    cfg: GKDConfig, pools: Pools, step: int, version: int, cause: BaseException, trained_here: bool
) -> RunStopped:
    """Save what is trained (the actor is healthy), and say in one line how to continue.

    `trained_here`: this process trained batches since its start (otherwise the checkpoint it
    resumed from, if any, already holds everything).
    """
    saved = "nothing new to checkpoint"
    if trained_here:
        saved = f"checkpoint {checkpoint.save(cfg, pools, step, version)} saved"
    reason = str(cause).strip().splitlines()[0]
    handles = teacher_handles(cfg)
    teacher = handles[getattr(cause, "teacher", None) or next(iter(handles))]
    # An autostarted server (a colocated one stops when its replica dies) says why in the run's log.
    why = f" (its log: {Path(cfg.trainer.run_dir) / teacher.log_name})" if teacher.section.autostart else ""
    return RunStopped(
        f"teacher server down ({type(cause).__name__}: {reason}){why}; {saved}. Restart {teacher.who} at "
        f"{teacher.key('address')}={teacher.address} and rerun the same command to continue"
    )


def watch_divergence(cfg: GKDConfig, pools: Pools, watch: DivergenceWatch, row: dict[str, Any], version: int) -> None:
    """The first time the objective diverges: print the line and keep it for the summary; with
    trainer.stop_on_divergence, also checkpoint the trained steps and stop (exit 5)."""
    line = watch.observe(row)
    if line is None:
        return
    print(line, flush=True)
    (Path(cfg.trainer.run_dir) / DIVERGENCE_FILE).write_text(line + "\n")
    if cfg.trainer.stop_on_divergence:
        saved = checkpoint.save(cfg, pools, row["step"], version)
        raise RunDiverged(f"{line}; stopped after checkpoint {saved} (trainer.stop_on_divergence=true)")


def watch_clipped(watch: ClipWatch, row: dict[str, Any], stats: list[RolloutStats]) -> None:
    """The first time most responses run to the length limit for a while: print the line (no stop: a task may need
    long answers)."""
    line = watch.observe(row, stats[0].stop_ids)
    if line is not None:
        print(line, flush=True)


def trained_description(cfg: GKDConfig) -> str:
    """What the actor trains, in a line's words."""
    lora = cfg.actor.lora
    return f"LoRA adapters of rank {lora.rank} on {', '.join(lora.targets)}" if lora.rank else "the whole student"


def check_staleness(cfg: GKDConfig, rollout: Rollout, version: int) -> None:
    """Refuse a batch sampled with weights more than algorithm.max_staleness syncs old."""
    staleness = version - min(s.weight_version for s in rollout.stats)
    if staleness > cfg.algorithm.max_staleness:
        raise RuntimeError(
            f"batch {rollout.stats[0].step} was sampled with weight version {version - staleness}, {staleness} syncs "
            f"old; algorithm.max_staleness={cfg.algorithm.max_staleness}"
        )


def train_on(pools: Pools, rollout: Rollout) -> dict[str, float]:
    """One optimizer step on every actor rank, each on its own shards."""
    start = time.perf_counter()
    results = pools.actor.train(rollout.shards)
    # The step statistics are the same on every rank; the memory figures are each rank's own.
    memory = {k: v for ranks in results for k, v in ranks.items() if k.endswith(MEMORY_SUFFIXES)}
    return {**results[0], **memory, "train_s": time.perf_counter() - start}


def evaluate(cfg: GKDConfig, pools: Pools, metrics: MetricsLogger, step: int) -> None:
    """Greedy responses to the held-out prompts: task reward and the divergence to the teacher."""
    start = time.perf_counter()
    results = pools.rollout.wait(pools.rollout.produce_eval(), "eval rollout")
    shards = by_rank(results, pools.actor.dp_size)
    loss = pools.actor.eval_loss(shards)
    kls = eval_teacher_kls(cfg, pools, results, shards)
    metrics.log_eval({**eval_row(cfg, step, loss, [s for s, _ in results], time.perf_counter() - start), **kls})


def export_student(cfg: GKDConfig, pools: Pools) -> Path:
    """The trained student as an HF directory under the run directory (every actor rank takes part); a LoRA
    student merged, and its adapter as a PEFT directory beside it."""
    run_dir = Path(cfg.trainer.run_dir).resolve()
    out = run_dir / FINAL_EXPORT_DIR
    pools.actor.export_hf(str(out))
    if cfg.actor.lora.rank > 0:
        pools.actor.export_adapter(str(run_dir / FINAL_ADAPTER_DIR))
    return out
