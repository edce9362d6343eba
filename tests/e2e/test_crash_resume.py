"""Crash consistency of the real CLI: kill -9 the driver's process group mid-run, rerun, compare.

The trained prompt sequence of an uninterrupted run is known without running it: batch b is
stream positions [b * B, (b + 1) * B) of the (seed, epoch) order (recipe_gkd.data), so the
expected `sample_ids` of every step come from `epoch_order` alone.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from recipe_gkd.config import DEFAULT_CONFIG
from recipe_gkd.data import epoch_order
from recipe_gkd.observe.metrics import read_metrics
from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm
from recipe_gkd.runtime.checkpoint import list_checkpoints, verify

WORDS = ["abcde", "hello", "qwert", "zyxwv", "mnopq", "lkjhg", "asdfg", "poiuy", "rtyui", "vbnmx", "ghjkl", "wersd"]
TAG_VAR = "RECIPE_GKD_TEST_TAG"
BATCH = 8
TOTAL_STEPS = 6
SAVE_EVERY = 2
SEED = 1  # data.seed of the CPU preset
RUN_TIMEOUT_S = 420
ORPHAN_GRACE_S = 20


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("crash")
    student = build_tiny_causal_lm(root / "student", seed=0)
    teacher = build_tiny_causal_lm(root / "teacher", seed=1, spec=TinyModelSpec(hidden_size=96, num_layers=3))
    data = root / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"rev:{w}", "response": w[::-1], "answer": w[::-1]}) + "\n" for w in WORDS)
    )
    return {"student": student, "teacher": teacher, "data": data}


def cli(inputs: dict[str, Path], run_dir: Path, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "recipe_gkd.main",
        "--config",
        str(DEFAULT_CONFIG),
        f"model.student_path={inputs['student']}",
        f"teacher.model_path={inputs['teacher']}",
        f"data.train_files=[{inputs['data']}]",
        f"data.eval_files=[{inputs['data']}]",
        f"data.train_batch_size={BATCH}",
        "data.eval_batch_size=8",
        "actor.micro_batch_size=4",
        "rollout.sampling.max_new_tokens=6",
        "teacher.address=tcp://127.0.0.1:0",
        "trainer.eval_every=0",
        f"trainer.total_steps={TOTAL_STEPS}",
        f"trainer.save_every={SAVE_EVERY}",
        "trainer.keep_last=2",
        f"trainer.run_dir={run_dir}",
        *overrides,
    ]


def tagged_processes(tag: str) -> list[int]:
    """Pids of live processes whose environment carries `tag` (every descendant of a run inherits it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"{TAG_VAR}={tag}".encode() in environ:
            found.append(int(entry.name))
    return found


def wait_gone(tag: str) -> list[int]:
    deadline = time.monotonic() + ORPHAN_GRACE_S
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    return tagged_processes(tag)


def env_with(tag: str) -> dict[str, str]:
    return {**os.environ, TAG_VAR: tag, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


def run_to_end(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    tag = uuid.uuid4().hex
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env_with(tag), check=False)
    assert not wait_gone(tag), "the run left processes behind"
    return proc


def wait_for_rows(proc: subprocess.Popen, run_dir: Path, rows: int) -> None:
    """Until the running CLI `proc` has written `rows` rows to metrics.jsonl (or ended, or RUN_TIMEOUT_S passed)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= rows:
            return
        time.sleep(0.05)


def kill_after_rows(cmd: list[str], run_dir: Path, rows: int, log: Path) -> None:
    """Start the CLI in its own process group, SIGKILL the group once metrics.jsonl has `rows` rows."""
    tag = uuid.uuid4().hex
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env_with(tag), start_new_session=True)
    try:
        wait_for_rows(proc, run_dir, rows)
        assert proc.poll() is None, f"the run ended before step {rows}:\n{log.read_text()[-3000:]}"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    leftover = wait_gone(tag)
    assert not leftover, f"kill -9 of the driver's process group left processes behind: {leftover}"


def expected_sample_ids(steps: int, dataset_size: int) -> list[list[int]]:
    """Per step: the sorted sample ids of stream positions [s * BATCH, (s + 1) * BATCH)."""
    out = []
    for s in range(steps):
        ids = []
        for position in range(s * BATCH, (s + 1) * BATCH):
            epoch, offset = divmod(position, dataset_size)
            ids.append(int(epoch_order(dataset_size, SEED, epoch)[offset]))
        out.append(sorted(ids))
    return out


# The read-ahead schedule (its checkpoint's data position trails the stream); a sync resume is checked
# against the uninterrupted run in-process (tests/integration/test_gkd_loop.py).
CRASH_CASES = [("one_step_off", 1)]
# The rerun's actor: two pipeline stages, its weights to the rollout over a gloo group (tensor parallel through the
# CLI: test_recipe_smoke.py's TP x DP run).
PP2 = ["cluster.gpus_per_node=4", "actor.gpus_per_node=2", "actor.megatron.pp=2", "weight_sync.transport=gloo"]


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "case_seed"), CRASH_CASES, ids=[c[0] for c in CRASH_CASES])
def test_kill_9_then_resume_trains_every_prompt_once(
    inputs: dict[str, Path], tmp_path: Path, schedule: str, case_seed: int
) -> None:
    """kill -9 at PP=1, rerun the command at PP=2 over a gloo weight-sync group: it resumes from the last complete
    checkpoint at the other pipeline size and trains every prompt once, in the uninterrupted order. Its export (stage 1
    sends its layers to rank 0) equals, bit for bit, the export tool's from the last checkpoint into one stage."""
    run_dir = tmp_path / "run"
    cmd = cli(inputs, run_dir, f"algorithm.schedule={schedule}")
    crash_rows = random.Random(case_seed).randint(SAVE_EVERY + 1, TOTAL_STEPS - 1)  # a random step > 2
    kill_after_rows(cmd, run_dir, crash_rows, tmp_path / "killed.log")
    written = read_metrics(run_dir)
    assert len(written) >= crash_rows
    complete = [p for p in list_checkpoints(run_dir) if verify(p) is None]
    assert complete, "no complete checkpoint before the crash"

    proc = run_to_end([*cmd, *PP2])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "resuming from checkpoint" in proc.stdout and complete[-1].name in proc.stdout
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, TOTAL_STEPS + 1)), "every step exactly once"
    assert [r["batch"] for r in rows] == list(range(TOTAL_STEPS))
    assert [r["weight_version"] for r in rows] == list(range(1, TOTAL_STEPS + 1))
    assert [r["sample_ids"] for r in rows] == expected_sample_ids(TOTAL_STEPS, len(WORDS)), (
        "the trained prompt sequence differs from an uninterrupted run's"
    )
    kept = list_checkpoints(run_dir)
    assert [p.name for p in kept] == ["step_000004", "step_000006"], "trainer.keep_last=2"
    assert_export_on_demand_equals_the_final_export(run_dir, tmp_path / "exported")


def assert_export_on_demand_equals_the_final_export(run_dir: Path, out: Path) -> None:
    """`python -m recipe_gkd.runtime.export` reloads the run's last checkpoint into one stage: the run's own final export."""
    from safetensors.numpy import load_file

    from recipe_gkd.runtime.export import main as export_main

    cmd = [sys.executable, "-m", "recipe_gkd.runtime.export", "--run-dir", str(run_dir), "--out", str(out)]
    code = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert code.returncode == 0, code.stderr[-3000:]
    exported = load_file(str(out / "model.safetensors"))
    final = load_file(str(run_dir / "final_student" / "model.safetensors"))
    assert exported.keys() == final.keys()
    assert all(np.array_equal(exported[k], final[k]) for k in final)
    assert export_main(["--run-dir", str(run_dir.parent / "nothing"), "--out", str(out)]) == 2


@pytest.mark.slow
def test_sigterm_stops_workers_and_teacher_keeps_the_checkpoint_and_exits_143(
    inputs: dict[str, Path], tmp_path: Path
) -> None:
    """SIGTERM to the driver alone (slurm's scancel, `kill PID`): Ray's own handler, installed by ray.init, would end
    the driver with 15 and a C++ stack, past the run's cleanup. The run stops its workers and the autostarted
    teacher, keeps the last complete checkpoint, says so in one line and exits 143; nothing it started lives on."""
    run_dir = tmp_path / "run"
    tag = uuid.uuid4().hex
    log = tmp_path / "terminated.log"
    cmd = cli(inputs, run_dir, "algorithm.schedule=one_step_off", "trainer.total_steps=1000")
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env_with(tag), start_new_session=True)
    try:
        wait_for_rows(proc, run_dir, SAVE_EVERY + 1)  # the checkpoint of step SAVE_EVERY is complete
        assert proc.poll() is None, f"the run ended early:\n{log.read_text()[-3000:]}"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    text = log.read_text()
    assert code == 143, text[-3000:]
    assert "SIGTERM received" not in text and "*** " not in text, "Ray's C++ handler printed its stack"
    complete = [p for p in list_checkpoints(run_dir) if verify(p) is None]
    assert complete, "the last checkpoint is gone"
    lines = [line for line in text.splitlines() if "SIGTERM" in line]
    assert lines == [
        "stopped by SIGTERM: the run's workers and teacher are stopped; "
        f"the last checkpoint {complete[-1]} is kept (the same command resumes from it)"
    ], text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    leftover = wait_gone(tag)
    assert not leftover, f"SIGTERM to the driver left processes behind: {leftover}"
