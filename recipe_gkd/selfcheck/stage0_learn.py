"""Stage 0's learning checks: a CPU preset's distillation, as shipped, run on the GPU in bf16 (no Ray, no vLLM).

The demo presets train a student the project builds offline (assets/) to a known gain on a CPU. Here the same
preset runs on the in-process pools (recipe_gkd/runtime/local_pools.py) with every role on GPU 0: the megatron
actor in bf16 with the distributed optimizer, the HF rollout engine and the HF teacher on CUDA, its schedule,
learning rate and objective unchanged. The check passes when the held-out accuracy (the environment's reward,
greedy, evaluated before the first step and after the last) gains at least the sizes' `learn_min_gain`:
the GPU path does not just run, it learns what the CPU run learns.

- `learn_demo`: configs/presets/cpu_demo.yaml (the running-sum task, single turn);
- `learn_tools`: configs/presets/cpu_tools.yaml (the same task solved with the calculator over several turns,
  the tool's tokens masked out of the loss).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from recipe_gkd.config import CONFIG_DIR, REPO_ROOT, GKDConfig, load_config
from recipe_gkd.selfcheck.record import GIB, Check
from recipe_gkd.selfcheck.sizes import Sizes
from recipe_gkd.selfcheck.stage0_actor import ACTOR_SHARE

LEARN_PRESETS = {
    "learn_demo": CONFIG_DIR / "presets" / "cpu_demo.yaml",
    "learn_tools": CONFIG_DIR / "presets" / "cpu_tools.yaml",
}


def learn_config(name: str, models: Path, sizes: Sizes) -> GKDConfig:
    """The preset of check `name` with its assets' paths made absolute, on the stage's device (bf16 on CUDA),
    `sizes.learn_steps` steps with an evaluation of `sizes.learn_eval_records` records before and after."""
    preset = LEARN_PRESETS[name]
    overrides = [
        f"trainer.total_steps={sizes.learn_steps}",
        f"trainer.eval_every={sizes.learn_steps}",
        "trainer.save_every=0",
        f"data.eval_batch_size={sizes.learn_eval_records}",
        # The run directory (with the student's final export) beside the models, not in `out` (whose files
        # come back from the machine); the record takes its metrics.
        f"trainer.run_dir={models / name}",
        "debug.log_memory=true",
    ]
    if sizes.device == "cuda":
        overrides += [
            "cluster.device=cuda",
            "cluster.fake_gpus=false",
            "actor.precision=bf16",
            "actor.megatron.distributed_optimizer=true",
            f"actor.gpu_memory_utilization={ACTOR_SHARE}",
        ]
    cfg = load_config(preset, overrides)
    # The presets name their assets relative to the repository (where `make demo` runs); the check runs anywhere.
    return load_config(
        preset,
        [
            *overrides,
            f"model.student_path={REPO_ROOT / cfg.model.student_path}",
            f"teacher.model_path={REPO_ROOT / cfg.teacher.model_path}",
            f"data.train_files=[{','.join(str(REPO_ROOT / f) for f in cfg.data.train_files)}]",
            f"data.eval_files=[{','.join(str(REPO_ROOT / f) for f in cfg.data.eval_files)}]",
        ],
    )


def learn_check(name: str, out: Path, models: Path, sizes: Sizes) -> Check:
    """Run check `name`'s preset for `sizes.learn_steps` steps on the in-process pools; the held-out accuracy
    before and after, per-phase seconds, peaks, and passed when the gain reaches `sizes.learn_min_gain`."""
    import torch

    from recipe_gkd.observe.metrics import EVAL_FILE, read_metrics
    from recipe_gkd.selfcheck.full import export_bytes, run_figures
    from recipe_gkd.selfcheck.stage0_actor import train_in_process

    cfg = learn_config(name, models, sizes)
    run_dir = Path(cfg.trainer.run_dir)
    on_gpu = sizes.device == "cuda"
    start = time.perf_counter()
    setup_s = train_in_process(cfg, on_gpu)
    wall_s = time.perf_counter() - start
    rows = read_metrics(run_dir)
    evals = read_metrics(run_dir, EVAL_FILE)
    (out / name).mkdir(parents=True, exist_ok=True)
    for file in ("metrics.jsonl", EVAL_FILE, "resolved_config.yaml"):
        shutil.copy(run_dir / file, out / name / file)
    figures: dict[str, Any] = {
        "preset": str(LEARN_PRESETS[name].relative_to(REPO_ROOT)),
        "schedule": cfg.algorithm.schedule.value,
        "precision": cfg.actor.precision.value,
        "setup_s": setup_s,
        "wall_s": wall_s,
    } | run_figures(run_dir, export_bytes(cfg.model.student_path))
    figures["accuracy_per_eval"] = {int(r["step"]): r["eval_reward"] for r in evals}
    figures["loss_first_last"] = [rows[0]["loss"], rows[-1]["loss"]] if rows else []
    figures["trend"] = trend(rows)
    if on_gpu:
        figures["process_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    status, detail = learn_verdict(rows, evals, sizes)
    return Check(name, status, time.perf_counter() - start, figures, detail)


def learn_verdict(rows: list[dict[str, Any]], evals: list[dict[str, Any]], sizes: Sizes) -> tuple[str, str]:
    """(status, detail): every step logged with a finite loss, evaluations before the first step and after the
    last, and the held-out accuracy's gain at least `sizes.learn_min_gain`."""
    if len(rows) != sizes.learn_steps or not all(np.isfinite(r["loss"]) for r in rows):
        return "failed", f"{len(rows)} of {sizes.learn_steps} steps logged, or a loss not finite"
    steps = [int(r["step"]) for r in evals]
    if steps[:1] != [0] or steps[-1:] != [sizes.learn_steps]:
        return "failed", f"evaluations at steps {steps}, expected 0 and {sizes.learn_steps}"
    before, after = evals[0]["eval_reward"], evals[-1]["eval_reward"]
    gain = after - before
    if gain < sizes.learn_min_gain:
        return "failed", (
            f"held-out accuracy {before:.1%} -> {after:.1%} in {sizes.learn_steps} steps: a gain of {gain:+.1%}, "
            f"below the {sizes.learn_min_gain:.0%} the preset reaches on a CPU"
        )
    return "passed", f"held-out accuracy {before:.1%} -> {after:.1%} ({gain:+.1%})"


# What a learning run's record keeps of its steps (the record is one file; a GPU machine may return few).
TREND_KEYS = (
    "loss",
    "grad_norm",
    "response_tokens",
    "reward",
    "turns",
    "tool_calls",
    "tool_failures",
    "tool_token_frac",
    "sync_logprob_diff",
)
TREND_STEPS = 10


def trend(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per logged column of TREND_KEYS: its mean over the first TREND_STEPS steps and over the last ones (a
    comparison of two devices' runs without their per-step files)."""
    out: dict[str, list[float]] = {}
    for key in TREND_KEYS:
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            head, tail = values[:TREND_STEPS], values[-TREND_STEPS:]
            out[key] = [sum(head) / len(head), sum(tail) / len(tail)]
    return out
