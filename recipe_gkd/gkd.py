"""On-policy knowledge distillation (GKD): the training loop, top to bottom.

1. Each rollout worker takes its shard of the step's prompts, samples responses with the
   student (a fraction 1 - algorithm.lmbda comes from the dataset instead), and has the
   teacher server score every response token with its top-k logprobs.
2. Each actor rank trains on its share: the GKD divergence over the teacher's top-k plus a
   tail bucket (or algorithm.divergence=sampled_reverse_kl: a policy-gradient step with the advantage
   log t - log s_old of each sampled token), token mean over the whole global batch, one optimizer step.
3. The new weights go to every rollout worker; the weight version goes up by one.
4. Metrics every step (a diverging objective is named in one line: observe/divergence_watch.py); evaluation
   every trainer.eval_every steps; a checkpoint every trainer.save_every steps (resumed from by
   trainer.resume=auto); the student exported at the end.

    python -m recipe_gkd.main                                            # CPU demo
    python -m recipe_gkd.main --config configs/presets/1x8_a1_r3_t4.yaml  # one 8-GPU node

The loop talks to its workers through recipe_gkd/runtime/pools.py: on Ray (runtime/ray_pools.py, every run)
the driver holds no model and no per-token data, it passes object refs between the pools;
in-process (runtime/local_pools.py, the tests) the same loop runs with the workers as plain objects.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recipe_gkd.batch import RolloutStats, actor_rank_of
from recipe_gkd.config import (
    PIPELINE_DEPTH,
    Divergence,
    GKDConfig,
    to_dict,
    weight_transport,
)
from recipe_gkd.config.teachers import split_teachers, teacher_handles, teacher_sections
from recipe_gkd.observe import console
from recipe_gkd.observe.divergence_watch import DIVERGENCE_FILE, DivergenceWatch
from recipe_gkd.observe.metrics import (
    EVAL_FILE,
    MetricsLogger,
    alignment_columns,
    episode_columns,
    process_memory_mb,
    read_metrics,
    teacher_columns,
)
from recipe_gkd.observe.plots import before_after_table, plot_run
from recipe_gkd.plan.placement import PlacementPlan
from recipe_gkd.rollout.answer_accuracy import AnswerAccuracy
from recipe_gkd.runtime import checkpoint
from recipe_gkd.runtime.pools import Pending, Pools, RolloutPool, ShardHandle
from recipe_gkd.runtime.ray_cluster import ray_cluster
from recipe_gkd.runtime.ray_pools import launch_pools
from recipe_gkd.targets import Target, build_target
from recipe_gkd.weight_sync import SYNC_TOLERANCE, WeightSyncError, check_due, logprob_diffs, worst_tensor

FINAL_EXPORT_DIR = "final_student"
# Teacher failures that survived the client's retries (bounded by teacher.timeout_s): the run stops.
TEACHER_DOWN_ERRORS = ("TeacherDeadError", "TeacherTimeoutError")
# The actor's statistics of the sampled-token objective (algorithm.divergence=sampled_reverse_kl).
POLICY_KEYS = ("advantage_mean", "ratio_mean", "ratio_min", "ratio_max", "ratio_clipped_frac")
# Per-worker memory keys (debug.log_memory), e.g. actor1_rss_mb, rollout0_gpu_peak_mb.
MEMORY_SUFFIXES = ("_rss_mb", "_gpu_peak_mb")


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


def teacher_accuracy(cfg: GKDConfig, rollout: RolloutPool) -> tuple[AnswerAccuracy | None, str]:
    """The teacher's held-out accuracy for the report, and the line saying what it counts (or why it is missing).

    CPU runs with an HF teacher only: on GPU clusters the teacher's GPUs belong to the server.
    After training: a failure here is reported in that line and never fails a run that trained.
    """
    if not (cfg.trainer.eval_every and cfg.cluster.device.value == "cpu" and cfg.teacher.backend.value == "hf"):
        return None, ""
    # A teacher with a prompt of its own (privileged context) is measured from both prompts: what the student can
    # reach from its own prompt, and what the teacher's context adds (docs/privileged_teacher.md).
    privileged = any(h.prompt.privileged for h in teacher_handles(cfg).values())
    try:
        measured = rollout.teacher_accuracy()
        own = rollout.teacher_accuracy(own_prompt=True) if privileged else None
    except Exception as err:  # noqa: BLE001 -- the student is trained and exported; the report says what failed
        return None, f"teacher held-out accuracy: not measured ({_one_line(err)})"
    line = measured.describe("teacher held-out accuracy", cfg.data.answer_key)
    if own is not None:
        line += "\n" + own.describe(
            "teacher held-out accuracy from its own prompt (privileged context)", cfg.data.answer_key
        )
    return measured, line


def report(cfg: GKDConfig, teacher: AnswerAccuracy | None = None, teacher_line: str = "") -> None:
    """Plots, the before/after table (also saved as summary.txt) and where the student went.

    Runs after the export: nothing here may fail a run that trained (a plot that cannot be drawn is
    said so in the summary).
    """
    run_dir = Path(cfg.trainer.run_dir)
    lines = [
        f"run directory: {run_dir.resolve()}",
        f"exported student: {run_dir.resolve() / FINAL_EXPORT_DIR}",
        f"third-party warnings and banners: {console.log_path(run_dir).resolve()}",
    ]
    if cfg.trainer.eval_every:
        evals = read_metrics(run_dir, EVAL_FILE)
        accuracy = None if teacher is None else teacher.accuracy
        try:
            lines.append(f"plots: {plot_run(run_dir, accuracy)}")
        except Exception as err:  # noqa: BLE001 -- a plot is not worth failing a trained run for
            lines.append(f"plots: not drawn ({_one_line(err)})")
        table = before_after_table(evals, accuracy, cfg.algorithm.divergence.value)
        lines += ["", table, student_answers_line(cfg, evals)]
        lines += [teacher_line] if teacher_line else []
    diverged = run_dir / DIVERGENCE_FILE
    lines += ["", diverged.read_text().strip()] if diverged.is_file() else []
    text = "\n".join(lines)
    (run_dir / "summary.txt").write_text(text + "\n")
    print("\n" + text, flush=True)


def student_answers_line(cfg: GKDConfig, evals: list[dict[str, Any]]) -> str:
    """What the student's held-out accuracy counts: the evaluated records that have an answer."""
    if not evals:
        return ""
    last = evals[-1]
    answered, records = last.get("eval_answered"), last.get("eval_sequences")
    key = f"data.answer_key={cfg.data.answer_key}"
    if not answered:
        return f"student held-out accuracy: none of the {records} held-out records has an answer ({key})"
    return f"student held-out accuracy (table above): over the {answered} of {records} held-out records that have an answer ({key})"


def _one_line(err: BaseException) -> str:
    """`Type: first line` of an error (a Ray task error's own cause when it wraps one)."""
    cause = getattr(err, "cause", None) or err
    first = (str(cause).strip().splitlines() or [""])[0]
    return f"{type(cause).__name__}: {first}"


def train(cfg: GKDConfig, pools: Pools, metrics: MetricsLogger, resume: Path | None) -> None:
    # Fresh: the rollout workers start from the same student weights as the actor, version 0.
    first, version = checkpoint.restore(cfg, pools, resume) if resume else (0, 0)
    if cfg.trainer.eval_every and first == 0:
        evaluate(cfg, pools, metrics, step=0)
    metrics.start_progress(first)
    pipeline = RolloutPipeline(cfg, pools, first)
    watch = DivergenceWatch.for_run(cfg, first)
    target = build_target(cfg)  # the target kind: which columns its teacher replies allow
    for step in range(first, cfg.trainer.total_steps):
        start = time.perf_counter()
        rollout = next_batch(cfg, pools, pipeline, step, version)  # launches the work the schedule overlaps
        check_staleness(cfg, rollout, version)
        stats = train_on(pools, rollout)
        pipeline.wait_for_generation()  # the engines must be idle before their weights change
        sync = pools.weights.push(version + 1)
        version += 1
        sync |= check_sync(cfg, pools, version)
        row = step_row(cfg, target, step, version, rollout, stats, sync, time.perf_counter() - start)
        if cfg.debug.log_memory:
            row.update(memory_row(rollout, stats))
        metrics.log_step(row)
        watch_divergence(cfg, pools, watch, row, version)
        if cfg.trainer.eval_every and (step + 1) % cfg.trainer.eval_every == 0:
            evaluate(cfg, pools, metrics, step=step + 1)
        if cfg.trainer.save_every and (step + 1) % cfg.trainer.save_every == 0:
            checkpoint.save(cfg, pools, step + 1, version)
    metrics.end_progress()
    export_student(cfg, pools)


class RolloutPipeline:
    """The rollout pool's work in flight, per algorithm.schedule. Every batch is produced once, in order.

    sync:         batch t is generated and scored when step t asks for it.
    one_step_off: batch t+1 is generated and scored while the actor trains on batch t.
    two_step_off: batch t+2 is generated and batch t+1 scored while the actor trains on batch t.
    Work is only launched for steps < trainer.total_steps, so nothing is left in flight at the end.
    A resumed run starts at batch `first` (the rollout workers were set back to its data position).
    """

    def __init__(self, cfg: GKDConfig, pools: Pools, first: int = 0) -> None:
        self.rollout, self.dp_size, self.first = pools.rollout, pools.actor.dp_size, first
        self.depth = PIPELINE_DEPTH[cfg.algorithm.schedule]
        self.total = cfg.trainer.total_steps
        self.generating: dict[int, Pending] = {}  # two_step_off: step -> generate()
        self.producing: dict[int, Pending] = {}  # step -> produce() / score()

    def next_batch(self, step: int) -> Rollout:
        start = time.perf_counter()
        if step == self.first:
            self._prefill(step)
        if self.depth == 0:
            self._produce(step)
        results = self.rollout.wait(self.producing.pop(step), f"rollout of step {step}")
        if self.depth == 1 and step + 1 < self.total:
            self._produce(step + 1)
        if self.depth == 2:
            if step + 1 < self.total:
                self._score(step + 1)
            if step + 2 < self.total:
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
            if step + 1 < self.total:
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
    loss = pools.actor.eval_loss(by_rank(results, pools.actor.dp_size))
    rollout_stats = [s for s, _ in results]
    metrics.log_eval(
        {
            "step": step,
            # KL(teacher || student) over the K + 1 outcomes (top-k + tail), whatever the training
            # divergence: a lower bound of the full-vocabulary KL (merging outcomes never raises a KL).
            "eval_teacher_kl": loss["forward_kl"],
            "eval_divergence": loss["loss"],
            "eval_reward": _ratio(rollout_stats, "onpolicy_reward_sum", "onpolicy_rewarded"),
            # Records with an answer (the accuracy counts those only) among the eval_sequences evaluated.
            "eval_answered": sum(s.onpolicy_rewarded for s in rollout_stats),
            "eval_sequences": sum(s.num_sequences for s in rollout_stats),
            # Per evaluation: greedy generation by the rollout engine, teacher scoring (slowest worker), all of it.
            "eval_generate_s": max(s.timings["generate_s"] for s in rollout_stats),
            "eval_teacher_s": max(s.timings["teacher_s"] for s in rollout_stats),
            **teacher_columns(rollout_stats, "eval_"),
            **episode_columns(rollout_stats, "eval_"),
            **eval_teacher_kls(cfg, pools, results),
            "eval_s": time.perf_counter() - start,
        }
    )


def eval_teacher_kls(cfg: GKDConfig, pools: Pools, results: list[Any]) -> dict[str, float | None]:
    """Several teachers: eval_teacher_NAME_kl, KL(teacher || student) over the held-out sequences teacher NAME
    scored (one more forward pass per teacher). None where some actor rank holds none of them."""
    split = [h for h in teacher_handles(cfg).values() if h.metric_prefix is not None]
    if not split or not cfg.teacher.top_k:
        return {}
    dp = pools.actor.dp_size
    held: dict[str, set[int]] = {}  # teacher -> the actor ranks holding some of its sequences
    for worker, (stats, _) in enumerate(results):
        for j, name in enumerate(stats.sample_teachers):
            held.setdefault(name, set()).add(actor_rank_of(worker, len(stats.sample_teachers), j, dp))
    shards = by_rank(results, dp)
    return {
        f"eval_{h.metric_prefix}kl": pools.actor.eval_loss(shards, h.name)["forward_kl"]
        if len(held.get(h.name, ())) == dp
        else None
        for h in split
    }


def check_sync(cfg: GKDConfig, pools: Pools, version: int) -> dict[str, float]:
    """When due (weight_sync.check_every), the engines and the actor score the sync probe; past the
    tolerance the run stops naming the weight-sync settings and, where it can tell, the worst tensor."""
    if not check_due(version, cfg.weight_sync.check_every):
        return {}
    start = time.perf_counter()
    actor_BL, engines_BL = pools.weights.logprob_probe()
    diffs = logprob_diffs(actor_BL, engines_BL)
    tolerance = sync_tolerance(cfg)
    if max(diffs) > tolerance:
        raise WeightSyncError(sync_check_failure(cfg, pools, version, diffs, tolerance))
    return {"sync_logprob_diff": max(diffs), "sync_check_s": time.perf_counter() - start}


def sync_tolerance(cfg: GKDConfig) -> float:
    """weight_sync.check_tolerance, or the precision's (fp32 actors: 1e-4; bf16: 0.1)."""
    return cfg.weight_sync.check_tolerance or SYNC_TOLERANCE[cfg.actor.precision.value]


def sync_check_failure(cfg: GKDConfig, pools: Pools, version: int, diffs: list[float], tolerance: float) -> str:
    """The one-line error of a failed sync check (the worst tensor from per-tensor checksums, where the engine names them)."""
    engine = int(np.argmax(diffs))
    actor_sums, engine_sums = pools.weights.weight_checksums()
    worst = worst_tensor(actor_sums, engine_sums[engine])
    culprit = (
        f"worst tensor {worst[0]} (sum of |weights| off by {worst[1]:.2g} relative)"
        if worst
        else "no tensor can be named (a vLLM engine fuses them, or every checksum agrees)"
    )
    return (
        f"weight sync check after weight version {version}: rollout engine {engine}'s token logprobs on the probe "
        f"differ from the actor's by {diffs[engine]:.3g} on average (tolerance {tolerance:g}, "
        f"weight_sync.check_tolerance): the engine is not sampling with the trained weights "
        f"(weight_sync.transport={weight_transport(cfg).value}, rollout.backend={cfg.rollout.backend.value}); {culprit}"
    )


def export_student(cfg: GKDConfig, pools: Pools) -> Path:
    """The trained student as an HF directory under the run directory (every actor rank takes part)."""
    out = Path(cfg.trainer.run_dir).resolve() / FINAL_EXPORT_DIR
    pools.actor.export_hf(str(out))
    return out


def step_row(
    cfg: GKDConfig,
    target: Target,
    step: int,
    version: int,
    rollout: Rollout,
    train: dict[str, float],
    sync: dict[str, float],
    step_s: float,
) -> dict[str, Any]:
    """The metrics.jsonl row of one step."""
    sampled_with = min(s.weight_version for s in rollout.stats)
    return {
        "step": step + 1,
        "batch": rollout.stats[0].step,
        "loss": train["loss"],
        "divergence": cfg.algorithm.divergence.value,
        # The loss is KL(teacher || student) itself when training with forward KL.
        "teacher_kl": train["loss"] if cfg.algorithm.divergence.value == "forward_kl" else None,
        "weight_version": version,
        "staleness": (version - 1) - sampled_with,
        # Task reward of the student's own samples; dataset responses (lmbda < 1) apart.
        "reward": _ratio(rollout.stats, "onpolicy_reward_sum", "onpolicy_rewarded"),
        "offpolicy_reward": _ratio(rollout.stats, "offpolicy_reward_sum", "offpolicy_rewarded"),
        "response_tokens": sum(s.num_response_tokens for s in rollout.stats),
        "sequences": sum(s.num_sequences for s in rollout.stats),
        # None where no top-k over the student's vocabulary travels (the target kind says: teacher.top_k=0, hidden
        # states, spans across tokenizers).
        "teacher_topk_mass": (
            _ratio(rollout.stats, "teacher_topk_mass_sum", "num_response_tokens") if target.sends_topk() else None
        ),
        # None where the replies carry no sampled token's logprob (hidden states only: the loss is exact).
        "teacher_sampled_logprob": (
            _ratio(rollout.stats, "teacher_sampled_logprob_sum", "onpolicy_tokens") if target.sends_logprobs() else None
        ),
        "sampled_reverse_kl": sampled_reverse_kl(cfg, rollout.stats) if target.sends_logprobs() else None,
        # algorithm.divergence=sampled_reverse_kl: token means of A = log t - log s_old and of s_theta / s_old.
        **{key: train.get(key) for key in POLICY_KEYS},
        "teacher_ids_folded": train.get("teacher_ids_folded"),
        "grad_norm": train.get("grad_norm"),
        "lr": train.get("lr"),
        "generate_s": max(s.timings["generate_s"] for s in rollout.stats),
        "teacher_s": max(s.timings["teacher_s"] for s in rollout.stats),
        "rollout_wait_s": rollout.seconds,
        "train_s": train["train_s"],
        "sync_s": sync["sync_export_s"] + sync["sync_load_s"],
        # The actor's export (object store: up to every bucket put) and the engines' receive and in-place load.
        "sync_export_s": sync["sync_export_s"],
        "sync_load_s": sync["sync_load_s"],
        # Mean |token logprob difference| engine vs actor on the sync probe, on the steps that check it.
        "sync_logprob_diff": sync.get("sync_logprob_diff"),
        "sync_check_s": sync.get("sync_check_s"),
        "step_s": step_s,
        **teacher_columns(rollout.stats, ""),
        **teacher_loss_columns(cfg, train),
        **alignment_columns(rollout.stats),
        **episode_columns(rollout.stats, ""),
        "sample_ids": sorted(i for s in rollout.stats for i in s.sample_ids),
        # Several teachers: the teacher that scored each of sample_ids (same order).
        **sample_teachers(cfg, rollout.stats),
    }


def teacher_loss_columns(cfg: GKDConfig, train: dict[str, Any]) -> dict[str, float | None]:
    """Several teachers: the actor's teacher_<name>_loss (the objective over that teacher's tokens) and, training
    with forward KL, teacher_<name>_kl, the same figure (as teacher_kl is the loss); None for a teacher absent
    from the step's batch."""
    columns: dict[str, float | None] = {}
    handles = teacher_handles(cfg)
    for name in split_teachers(cfg):  # sorted by name, as before
        head = handles[name].metric_prefix
        loss = train.get(f"{head}loss")
        columns[f"{head}loss"] = loss
        columns[f"{head}kl"] = loss if cfg.algorithm.divergence == Divergence.forward_kl else None
    return columns


def sample_teachers(cfg: GKDConfig, stats: list[RolloutStats]) -> dict[str, list[str]]:
    """{"sample_teachers": the teacher of each sorted sample id} when the step's teachers have names in the rows
    (configured under `teachers:`), else {}."""
    pairs = sorted((i, t) for s in stats for i, t in zip(s.sample_ids, s.sample_teachers, strict=True))
    handles = teacher_handles(cfg)
    if all(handles[t].row_name is None for _, t in pairs):
        return {}
    return {"sample_teachers": [t for _, t in pairs]}


def memory_row(rollout: Rollout, train: dict[str, float]) -> dict[str, float]:
    """debug.log_memory: resident (and peak GPU) MiB of the driver and of every worker."""
    row = {"driver_rss_mb": process_memory_mb()}
    for stats in rollout.stats:
        row.update(stats.memory_mb)
    row.update({k: v for k, v in train.items() if k.endswith(MEMORY_SUFFIXES)})
    return row


def sampled_reverse_kl(cfg: GKDConfig, stats: list[RolloutStats]) -> float | None:
    """Monte Carlo estimate of the full-vocabulary KL(student || teacher) on the step's samples.

    mean(log s(x) - log t(x)) over on-policy tokens is unbiased only when x was drawn from s
    itself (rollout temperature 1, no top-p/top-k) and both sides are at temperature 1; else None.
    Unlike the loss (K + 1 outcomes) it sees the whole vocabulary.
    """
    s = cfg.rollout.sampling
    if s.temperature != 1.0 or s.top_p != 1.0 or s.top_k != 0 or cfg.algorithm.temperature != 1.0:
        return None
    student = _ratio(stats, "rollout_logprob_sum", "onpolicy_tokens")
    teacher = _ratio(stats, "teacher_sampled_logprob_sum", "onpolicy_tokens")
    return None if student is None or teacher is None else student - teacher


def _ratio(stats: list[RolloutStats], numerator: str, denominator: str) -> float | None:
    """sum(numerator) / sum(denominator) over the rollout workers; None when nothing was counted."""
    total = sum(getattr(s, denominator) for s in stats)
    return sum(getattr(s, numerator) for s in stats) / total if total else None


@contextmanager
def teacher_service(cfg: GKDConfig) -> Iterator[Callable[[], dict[str, str]]]:
    """The call that returns every teacher's address (name -> address). With autostart a teacher's
    local server starts here and the call waits until it is READY: Ray and the actor workers start meanwhile."""
    from recipe_gkd.rollout.teacher import start_local_teacher

    sections = teacher_sections(cfg)
    with ExitStack() as stack:
        # Colocated roles: the teacher starts only when asked for, after the actor set up on the shared GPU.
        starting = {
            name: stack.enter_context(start_local_teacher(cfg, name))
            for name, section in sections.items()
            if section.autostart and not cfg.cluster.colocate
        }

        @functools.cache
        def addresses() -> dict[str, str]:
            bound = {}
            for name, section in sections.items():
                if not section.autostart:
                    bound[name] = section.address
                    continue
                ready = starting.get(name) or stack.enter_context(start_local_teacher(cfg, name))
                bound[name] = ready()
                print(f"{teacher_handles(cfg)[name].server} autostarted at {bound[name]}", flush=True)
            return bound

        yield addresses
