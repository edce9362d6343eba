"""Crash consistency of the real CLI: kill -9 the driver's process group mid-run, rerun, compare.

The trained prompt sequence of an uninterrupted run is known without running it: batch b is
stream positions [b * B, (b + 1) * B) of the (seed, epoch) order (recipe_gkd.data), so the
expected `sample_ids` of every step come from `epoch_order` alone.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from cli_runs import (
    SAVE_EVERY,
    TOTAL_STEPS,
    checkpointed_cli,
    env_with,
    expected_sample_ids,
    run_to_end,
    wait_for_rows,
    wait_gone,
)
from repo_paths import REPO_ROOT

from recipe_gkd.observe.metrics import read_metrics
from recipe_gkd.runtime.checkpoint import list_checkpoints, verify


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


# The read-ahead schedule (its checkpoint's data position trails the stream); every schedule's resume is checked
# against the uninterrupted run in-process (tests/recipe_gkd/test_gkd_loop.py).
CRASH_CASES = [("one_step_off", 1)]
# The killed run is multi-turn: the tool demo's committed student calls the calculator (configs/presets/cpu_tools.yaml).
TOOL_ASSETS = REPO_ROOT / "assets" / "tools"
TOOL_RECORDS = 24
MULTI_TURN = [
    "rollout.env=calculator",
    "rollout.max_turns=4",
    "rollout.max_total_tokens=224",
    "rollout.tool_timeout_s=5",
    "rollout.sampling.max_new_tokens=40",
    "data.max_prompt_length=64",
]
# A trajectory as the step rows hold it: a batch sampled with the same weights and seeds repeats every column.
TRAJECTORY_COLUMNS = (
    "batch",
    "sample_ids",
    "staleness",
    "response_tokens",
    "reward",
    "turns",
    "tool_calls",
    "tool_failures",
    "tool_tokens",
)


@pytest.fixture(scope="module")
def tool_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    data = tmp_path_factory.mktemp("crash_tools") / "train.jsonl"
    records = (TOOL_ASSETS / "data" / "train.jsonl").read_text().splitlines(keepends=True)[:TOOL_RECORDS]
    data.write_text("".join(records))
    return {"student": TOOL_ASSETS / "student", "teacher": TOOL_ASSETS / "teacher", "data": data}


# The rerun's actor: two pipeline stages, its weights to the rollout over a gloo group (tensor parallel through the
# CLI: test_recipe_smoke.py's TP x DP run).
PP2 = ["cluster.gpus_per_node=4", "actor.gpus_per_node=2", "actor.megatron.pp=2", "weight_sync.transport=gloo"]


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "case_seed"), CRASH_CASES, ids=[c[0] for c in CRASH_CASES])
def test_kill_9_then_resume_trains_every_prompt_once(
    tool_inputs: dict[str, Path], tmp_path: Path, schedule: str, case_seed: int
) -> None:
    """kill -9 of a multi-turn run (the calculator) at PP=1, rerun the command at PP=2 over a gloo weight-sync group:
    it resumes from the last complete checkpoint at the other pipeline size and trains every prompt once, in the
    uninterrupted order; the batches it redoes with the checkpoint's weights repeat the killed run's trajectories
    (turns, tool calls, tokens, rewards). Its export (stage 1 sends its layers to rank 0) equals, bit for bit, the
    export tool's from the last checkpoint into one stage."""
    run_dir = tmp_path / "run"
    cmd = checkpointed_cli(tool_inputs, run_dir, f"algorithm.schedule={schedule}", *MULTI_TURN)
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
    assert [r["sample_ids"] for r in rows] == expected_sample_ids(TOTAL_STEPS, TOOL_RECORDS), (
        "the trained prompt sequence differs from an uninterrupted run's"
    )
    assert all(r["tool_calls"] > 0 for r in rows), "the student calls the tool at every step"
    # one_step_off after checkpoint f: batches f and f + 1 are both sampled with its weights, in either run.
    resumed_at = int(complete[-1].name.split("_")[-1])
    redone = range(resumed_at, min(resumed_at + 2, len(written)))
    assert redone, f"the killed run wrote no step after checkpoint {resumed_at} (rows: {len(written)})"
    for i in redone:
        for key in TRAJECTORY_COLUMNS:
            assert rows[i][key] == written[i][key], f"batch {i}: {key} {rows[i][key]} != {written[i][key]} (killed run)"
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
    cmd = checkpointed_cli(inputs, run_dir, "algorithm.schedule=one_step_off", "trainer.total_steps=1000")
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
