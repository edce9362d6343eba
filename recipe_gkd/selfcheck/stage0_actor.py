"""Stage 0's checks of the megatron actor and of the whole loop in one process (no Ray, no vLLM).

- `actor_check`: the megatron actor (bf16, distributed optimizer, world size 1) built on a random model of the
  stage's shape, two steps on synthetic teacher targets of the stage's sizes: set-up and step seconds,
  `torch.cuda.max_memory_allocated` against the memory plan's actor lines (recipe_gkd/plan/memory_plan.py
  `actor_memory`, less its CUDA-context reserve, which the allocator does not count).
- `loop_check`: `gkd.train` on the in-process pools (recipe_gkd/runtime/local_pools.py): HF rollout, the teacher
  server's HF backend called in-process, the actor, the weight sync into the HF engine every step with its
  logprob probe: per-phase seconds, tokens/s generated and scored, the sync difference after every step
  (the run directory, with the student's final export, lies beside the models; its metrics go to <out>/loop).
"""

from __future__ import annotations

import gc
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from recipe_gkd.config import CONFIG_DIR, GKDConfig, load_config, to_yaml
from recipe_gkd.selfcheck.full import prompts_file
from recipe_gkd.selfcheck.record import GIB, Check
from recipe_gkd.selfcheck.sizes import Sizes
from recipe_gkd.targets import actor_kinds

PRESETS = {"cuda": CONFIG_DIR / "presets" / "1x1_colocated.yaml", "cpu": CONFIG_DIR / "presets" / "cpu_colocated.yaml"}
# Stage 0 holds the GPU alone (one process, every role in it): the actor's cap leaves room for nothing else.
ACTOR_SHARE = 0.9
# The plan's part that the caching allocator never sees (the CUDA context is outside torch's counters).
RESERVE_PART = "CUDA context, NCCL, allocator reserve"


def student_dir(models: Path, sizes: Sizes) -> Path:
    return models / f"student_{sizes.name}"


def student_model(models: Path, sizes: Sizes) -> Path:
    """The random model of the stage's shape (Qwen3 family, char tokenizer), built once under `models`
    (kept between runs: a rerun skips building it)."""
    from recipe_gkd.offline_models import build_tiny_causal_lm

    target = student_dir(models, sizes)
    if not (target / "config.json").is_file():
        build_tiny_causal_lm(target, seed=0, spec=sizes.student, family="qwen3")
    return target


def model_check(models: Path, sizes: Sizes) -> Check:
    """Build the stage's random model (or find it from an earlier run): seconds, parameters, bytes on disk."""
    start = time.perf_counter()
    built = not (student_dir(models, sizes) / "config.json").is_file()
    target = student_model(models, sizes)
    figures = {
        "path": str(target),
        "built_now": built,
        "disk_gib": sum(f.stat().st_size for f in target.glob("*.safetensors")) / GIB,
        "hidden": sizes.student.hidden_size,
        "layers": sizes.student.num_layers,
        "vocab": sizes.student.vocab_size,
    }
    return Check("model", "passed", time.perf_counter() - start, figures)


def stage0_config(out: Path, models: Path, sizes: Sizes, run: str, *overrides: str) -> GKDConfig:
    """The one-GPU preset (or its CPU twin) with the HF engines, the stage's model and sizes, bf16 and the
    distributed optimizer; teacher = student (one model to build, and the teacher head has the student's vocabulary).
    The model is `model_check`'s: a check that loads it builds it first if that check did not run."""
    student, data = student_dir(models, sizes), prompts_file(out)
    base = [
        f"model.student_path={student}",
        f"teacher.model_path={student}",
        f"data.train_files=[{data}]",
        f"data.eval_files=[{data}]",
        f"trainer.run_dir={out / run}",
        "trainer.eval_every=0",
        "rollout.backend=hf",
        "teacher.backend=hf",
        "weight_sync.transport=object_store",
        "actor.precision=bf16",
        "actor.megatron.distributed_optimizer=true",
        f"data.train_batch_size={sizes.batch}",
        f"data.max_prompt_length={sizes.prompt_len}",
        f"rollout.sampling.max_new_tokens={sizes.response_len}",
        f"actor.max_tokens_per_micro_batch={sizes.micro_tokens}",
        f"teacher.top_k={sizes.top_k}",
        f"teacher.max_top_k={sizes.top_k}",
        "algorithm.schedule=sync",
        "weight_sync.check_every=1",
        "debug.log_memory=true",
    ]
    if sizes.device == "cuda":
        # teacher.max_model_len: the longest sequence it scores, plus the one token vLLM samples (the preset's rule).
        max_len = sizes.prompt_len + sizes.response_len + 1
        base += [f"actor.gpu_memory_utilization={ACTOR_SHARE}", f"teacher.max_model_len={max_len}"]
    return load_config(PRESETS[sizes.device], [*base, *overrides])


# ----------------------------------------------------------------------------- the actor


def wire_hidden_states(values_NH: np.ndarray) -> Any:
    """Hidden states as the rollout worker hands them on: rounded to the wire's bfloat16, in its 16 bits."""
    from recipe_gkd.targets.hidden import HiddenStates
    from teacher_server.wire import hidden_codec

    return HiddenStates.from_float32(hidden_codec.round_to(values_NH.astype(np.float32), "bfloat16"), "bfloat16")


def synthetic_shard(cfg: GKDConfig, sizes: Sizes, hidden_size: int, seed: int = 0) -> Any:
    """One step's sequences with teacher targets of the stage's sizes: random ids, a top-k holding half the
    teacher's mass (the tail the other half), or final hidden states with teacher.output=hidden."""
    from recipe_gkd.batch import ScoredSequence, TrainShard
    from recipe_gkd.targets import build_target

    rng = np.random.default_rng(seed)
    # The target kind with the teacher on the actor (teacher.output=hidden) takes hidden states, not a top-k.
    vocab, k, hidden = sizes.student.vocab_size, sizes.top_k, build_target(cfg).teacher_on_actor
    sequences = []
    for i in range(sizes.batch):
        length = sizes.prompt_len + sizes.response_len
        ids = rng.integers(0, vocab, size=length, dtype=np.int32)
        r = sizes.response_len
        scores = rng.standard_normal((r, k)).astype(np.float32)
        topk_RK = scores - np.log(np.exp(scores).sum(-1, keepdims=True)) - np.log(2.0)  # half the mass in the top-k
        first_R1 = rng.integers(0, vocab, size=(r, 1))
        ids_RK = ((first_R1 + np.arange(k)) % vocab).astype(np.int32)  # K distinct ids per position
        sequences.append(
            ScoredSequence(
                sample_id=i,
                input_ids=ids,
                response_start=sizes.prompt_len,
                on_policy=True,
                teacher_topk_logprobs=np.zeros((r, 0), np.float32) if hidden else topk_RK.astype(np.float32),
                teacher_topk_ids=np.zeros((r, 0), np.int32) if hidden else ids_RK,
                teacher_tail_logmass=np.full(r, -np.log(2.0), np.float32),
                teacher_sampled_logprob=-rng.exponential(2.0, r).astype(np.float32),
                rollout_logprobs=-rng.exponential(2.0, r).astype(np.float32),
                payload=wire_hidden_states(rng.standard_normal((r, hidden_size))) if hidden else None,
            )
        )
    return TrainShard(step=0, weight_version=0, sequences=sequences)


def plan_lines(cfg: GKDConfig) -> dict[str, float]:
    """The memory plan's actor lines for `cfg` (GiB), as the plan computes them for a CUDA run."""
    import dataclasses

    from recipe_gkd.config import Device
    from recipe_gkd.plan.memory_plan import actor_memory
    from recipe_gkd.plan.model_shape import read_shape
    from recipe_gkd.targets import build_target

    skipped: list[str] = []
    shape = read_shape(cfg.model.student_path, "model.student_path", skipped)
    teacher = read_shape(cfg.teacher.model_path, "teacher.model_path", skipped)
    if shape is None:
        raise RuntimeError(f"the plan cannot read the student's shape: {skipped}")
    cuda = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, device=Device.cuda, gpu_memory_gib=80.0))
    role = actor_memory(cuda, shape, teacher if build_target(cfg).teacher_on_actor else None)
    return {name: b / GIB for name, b in [*role.parts, *role.outside]}


def actor_check(out: Path, models: Path, sizes: Sizes, recompute: str, output: str) -> Check:
    import torch

    from recipe_gkd.actor.worker import actor_worker_class
    from recipe_gkd.plan.ports import reserve_ports

    name = f"actor_{output}_recompute_{recompute}"
    student_model(models, sizes)
    cfg = stage0_config(out, models, sizes, name, f"actor.megatron.recompute={recompute}", f"teacher.output={output}")
    on_gpu = sizes.device == "cuda"
    start = time.perf_counter()
    figures: dict[str, Any] = {}
    if on_gpu:
        # The previous check's actor is freed only when collected: without this its GiBs stay in `base` and
        # the figures below come out that much too small (seen on an H200: after_setup 0 GiB).
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        figures["allocated_before_gib"] = base / GIB
    actor = actor_worker_class()(cfg, 0, 1, "127.0.0.1", reserve_ports(1)[0], actor_kinds(cfg))
    try:
        setup = actor.setup()
        figures |= {"setup_s": time.perf_counter() - start, "params": setup["num_params"]}
        if on_gpu:
            figures["after_setup_gib"] = (torch.cuda.memory_allocated() - base) / GIB
        shard = synthetic_shard(cfg, sizes, sizes.student.hidden_size)
        for step in (1, 2):
            timed = time.perf_counter()
            stats = actor.train_step([shard])
            if on_gpu:
                torch.cuda.synchronize()
            figures[f"step{step}_s"] = time.perf_counter() - timed
        figures["loss"] = float(stats["loss"])
        figures["tokens_per_step"] = sizes.batch * (sizes.prompt_len + sizes.response_len)
        lines = plan_lines(cfg)
        figures["plan_gib"] = sum(lines.values()) - lines.get(RESERVE_PART, 0.0)
        figures["plan_lines_gib"] = lines
        if on_gpu:
            figures["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
            figures["peak_over_plan"] = figures["peak_gib"] / figures["plan_gib"]
    finally:
        actor.shutdown()
        if on_gpu:
            torch.cuda.set_per_process_memory_fraction(1.0)  # the actor capped the whole process
    ok = bool(np.isfinite(figures["loss"]))
    return Check(
        name, "passed" if ok else "failed", time.perf_counter() - start, figures, "" if ok else "loss not finite"
    )


# ----------------------------------------------------------------------------- the loop


def loop_check(out: Path, models: Path, sizes: Sizes) -> Check:
    import torch

    from recipe_gkd.observe.metrics import read_metrics
    from recipe_gkd.selfcheck.full import export_bytes, run_figures

    student_model(models, sizes)
    cfg = stage0_config(
        out,
        models,
        sizes,
        "loop",
        f"trainer.total_steps={sizes.loop_steps}",
        f"data.train_batch_size={sizes.loop_batch}",
        f"rollout.sampling.max_new_tokens={sizes.loop_new_tokens}",
        # The run ends with an HF export of the student (GiBs at the GPU sizes): beside the models, not in `out`,
        # whose files come back from the machine; the record takes the metrics.
        f"trainer.run_dir={models / 'loop_run'}",
    )
    run_dir = Path(cfg.trainer.run_dir)
    on_gpu = sizes.device == "cuda"
    start = time.perf_counter()
    setup_s = train_in_process(cfg, on_gpu)
    rows = read_metrics(run_dir)
    (out / "loop").mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "resolved_config.yaml"):
        shutil.copy(run_dir / name, out / "loop" / name)
    figures: dict[str, Any] = {"setup_s": setup_s} | run_figures(run_dir, export_bytes(cfg.model.student_path))
    figures["sync_logprob_diff_per_step"] = [r.get("sync_logprob_diff") for r in rows]
    figures["loss_per_step"] = [r["loss"] for r in rows]
    if on_gpu:
        figures["process_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    ok = len(rows) == sizes.loop_steps and all(np.isfinite(r["loss"]) for r in rows)
    detail = "" if ok else f"{len(rows)} of {sizes.loop_steps} steps logged, or a loss not finite"
    return Check("loop", "passed" if ok else "failed", time.perf_counter() - start, figures, detail)


def train_in_process(cfg: GKDConfig, on_gpu: bool) -> float:
    """`gkd.train` of `cfg` on the in-process pools into a fresh trainer.run_dir (its resolved config written
    first; peaks counted from here on the GPU); returns the pools' set-up seconds."""
    import torch

    from recipe_gkd import gkd
    from recipe_gkd.observe.metrics import MetricsLogger
    from recipe_gkd.runtime.local_pools import local_pools

    run_dir = Path(cfg.trainer.run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a rerun's metrics start empty
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "resolved_config.yaml").write_text(to_yaml(cfg))
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    metrics = MetricsLogger(cfg.trainer.run_dir, cfg.trainer.loggers, cfg.trainer.total_steps)
    try:
        with local_pools(cfg) as pools:
            setup_s = pools.setup_s
            gkd.train(cfg, pools, metrics, None)
    finally:
        metrics.close()
        if on_gpu:
            torch.cuda.set_per_process_memory_fraction(1.0)  # the actor capped the whole process
    return setup_s
