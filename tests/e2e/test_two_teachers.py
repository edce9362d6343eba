"""Two teachers in one run through the CLI: configs/presets/cpu_two_teachers.yaml trains with each record scored by
the teacher it names; one teacher going down for good stops the run with a checkpoint, exit 3 and a last line
naming that teacher and its address; the rerun resumes, keeps every record's teacher and trains each prompt once."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest
from cli_runs import RUN_TIMEOUT_S, env_with, wait_for_rows, wait_gone

from recipe_gkd.config import CONFIG_DIR, load_config
from recipe_gkd.exit_codes import EXIT_STOPPED
from recipe_gkd.observe.metrics import read_metrics
from recipe_gkd.plan.ports import reserve_ports
from recipe_gkd.runtime.checkpoint import list_checkpoints, verify
from teacher_server.client.launcher import launch_teacher

PRESET = CONFIG_DIR / "presets" / "cpu_two_teachers.yaml"
TOTAL_STEPS = 6
# The `sum` teacher is stopped once the run has trained this many steps.
STOP_AFTER_ROWS = 2


def _cmd(run_dir: Path, *overrides: str) -> list[str]:
    import sys

    # Requests of two teachers beside the Ray workers on 2 busy cores may wait longer than the preset's 60 s
    # (a test's own override still wins).
    ready = ["teachers.reverse.timeout_s=180", "teachers.sum.timeout_s=180"]
    return [
        sys.executable,
        "-m",
        "recipe_gkd.main",
        "--config",
        str(PRESET),
        f"trainer.run_dir={run_dir}",
        *ready,
        *overrides,
    ]


def _record_teachers() -> list[str]:
    """The teacher each training record names (a sample id is its record's index)."""
    cfg = load_config(PRESET)
    with open(cfg.data.train_files[0]) as f:
        return [json.loads(line)[cfg.data.teacher_key] for line in f if line.strip()]


def _check_each_record_scored_by_its_teacher(run_dir: Path) -> None:
    """Every trained sequence went to its record's teacher; the per-teacher losses and held-out KLs add up."""
    expected = _record_teachers()
    seen = set()
    for row in read_metrics(run_dir):
        # The trained batch's sequences, each with the teacher that scored it.
        assert row["sample_teachers"] == [expected[i] for i in row["sample_ids"]]
        for name in ("reverse", "sum"):
            assert row[f"teacher_{name}_sequences"] == row["sample_teachers"].count(name)
        # The actor's loss over each teacher's tokens; weighted by their tokens, the step's loss.
        present = [n for n in ("reverse", "sum") if row[f"teacher_{n}_sequences"]]
        tokens = {n: row[f"teacher_{n}_response_tokens"] for n in present}
        mixed = sum(row[f"teacher_{n}_loss"] * t for n, t in tokens.items()) / sum(tokens.values())
        assert mixed == pytest.approx(row["loss"], rel=1e-5)
        assert all(row[f"teacher_{n}_kl"] == row[f"teacher_{n}_loss"] for n in present)  # forward KL: the loss
        seen |= set(row["sample_teachers"])
    assert seen == {"reverse", "sum"}
    # Held-out KL per teacher: over each teacher's own sequences; weighted by their tokens, the whole figure.
    evals = read_metrics(run_dir, "eval.jsonl")
    assert evals, "no held-out evaluation"
    for row in evals:
        tokens = {n: row[f"eval_teacher_{n}_response_tokens"] for n in ("reverse", "sum")}
        assert row["eval_teacher_reverse_sequences"] == row["eval_teacher_sum_sequences"] == 10
        mixed = sum(row[f"eval_teacher_{n}_kl"] * t for n, t in tokens.items()) / sum(tokens.values())
        assert mixed == pytest.approx(row["eval_teacher_kl"], rel=1e-5)
        assert row["eval_teacher_reverse_kl"] != pytest.approx(row["eval_teacher_sum_kl"], rel=1e-2)


def _stopped_by_the_sum_teacher(cmd: list[str], run_dir: Path, server_args: list[str], log: Path) -> str:
    """Run `cmd` with the `sum` teacher up until the run has trained STOP_AFTER_ROWS steps, then stop that teacher
    for good; the run's stderr once it has exited 3 (EXIT_STOPPED), leaving no process behind."""
    tag = uuid.uuid4().hex
    with launch_teacher(PRESET.parent / "cpu_paper.yaml", server_args, log_path=log):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_with(tag))
        try:
            wait_for_rows(proc, run_dir, STOP_AFTER_ROWS)
            assert proc.poll() is None, "the run ended before the teacher was stopped"
        except BaseException:
            proc.kill()
            proc.wait(timeout=30)
            raise
    # The `sum` server is stopped (SIGTERM to its group) when the `with` block exits.
    out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert not wait_gone(tag), "the stopped run left processes behind"
    assert proc.returncode == EXIT_STOPPED, out[-2000:] + err[-4000:]
    assert "Traceback" not in err
    return err


@pytest.mark.slow
def test_a_teacher_down_stops_naming_it_and_the_rerun_keeps_every_records_teacher(tmp_path: Path) -> None:
    """The two-teacher preset with its `sum` teacher started here (`reverse` autostarted by the run): the `sum` server
    stopped for good after two trained steps stops the run with a checkpoint of every trained step, exit 3 and a
    last line naming that teacher and its address; the same command with the server back resumes from that
    checkpoint to the end. Every record is scored by the teacher it names and trained once across both runs.
    (One teacher is a set of one: the stop, its checkpoint and the rerun are the same code for a single teacher.)"""
    address = f"tcp://127.0.0.1:{reserve_ports(1)[0]}"
    server_args = ["teacher.model_path=assets/paper/teacher", f"teacher.address={address}", "server.gpu_ids=[3]"]
    run_dir = tmp_path / "run"
    sum_teacher = ["teachers.sum.autostart=false", f"teachers.sum.address={address}", "teachers.sum.client.retries=1"]
    common = [f"trainer.total_steps={TOTAL_STEPS}", "data.eval_batch_size=20", "trainer.save_every=1000", *sum_teacher]
    # The first run notices the stopped server within seconds, and evaluates nothing (the checkpoint must come from
    # the failure itself); the rerun may change both (neither is in the checkpoint's training setup).
    first = _cmd(run_dir, *common, "teachers.sum.timeout_s=5", "trainer.eval_every=0")
    err = _stopped_by_the_sum_teacher(first, run_dir, server_args, tmp_path / "sum_teacher1.log")
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: teacher server down") and "teacher 'sum'" in last, last
    assert f"teachers.sum.address={address}" in last and "rerun the same command" in last, last
    trained = len(read_metrics(run_dir))
    assert STOP_AFTER_ROWS <= trained < TOTAL_STEPS
    saved = [p for p in list_checkpoints(run_dir) if verify(p) is None]
    assert [p.name for p in saved] == [f"step_{trained:06d}"], "the failure checkpoints every trained step"

    rerun = _cmd(run_dir, *common, f"trainer.eval_every={TOTAL_STEPS}")
    with launch_teacher(PRESET.parent / "cpu_paper.yaml", server_args, log_path=tmp_path / "sum_teacher2.log"):
        tag = uuid.uuid4().hex
        proc = subprocess.run(
            rerun, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env_with(tag), check=False
        )
    assert not wait_gone(tag), "the run left processes behind"
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "resuming from checkpoint" in proc.stdout and "teacher 'reverse' server autostarted" in proc.stdout
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, TOTAL_STEPS + 1))
    _check_each_record_scored_by_its_teacher(run_dir)
    trained_ids = [i for row in rows for i in row["sample_ids"]]
    assert len(trained_ids) == len(set(trained_ids)), "a prompt was trained twice across the resume"
