"""Two teachers in one run through the CLI (issue 37): configs/presets/cpu_two_teachers.yaml trains a few
steps with each record scored by the teacher it names; one teacher going down for good stops the run with
a checkpoint, exit 3 and a last line naming that teacher and its address; a resumed run keeps every
record's teacher and trains each prompt once."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest
from cli_runs import RUN_TIMEOUT_S, _free_port, env_with, wait_for_rows, wait_gone

from recipe_gkd.config import CONFIG_DIR, load_config
from recipe_gkd.main import EXIT_STOPPED
from recipe_gkd.observe.metrics import read_metrics
from recipe_gkd.runtime.checkpoint import list_checkpoints
from teacher_server.client.launcher import launch_teacher

PRESET = CONFIG_DIR / "presets" / "cpu_two_teachers.yaml"
STEPS = 2


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


@pytest.mark.slow
def test_one_teacher_down_for_good_stops_naming_it(tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{_free_port()}"
    # The `sum` teacher on the preset's GPU 3, started here; `reverse` autostarted by the run.
    server_args = ["teacher.model_path=assets/paper/teacher", f"teacher.address={address}", "server.gpu_ids=[3]"]
    run_dir = tmp_path / "run"
    cmd = _cmd(
        run_dir,
        "trainer.total_steps=200",
        "trainer.eval_every=0",
        "trainer.save_every=1000",  # the checkpoint must come from the failure itself
        "teachers.sum.autostart=false",
        f"teachers.sum.address={address}",
        "teachers.sum.timeout_s=5",
        "teachers.sum.client.retries=1",
    )
    tag = uuid.uuid4().hex
    with launch_teacher(PRESET.parent / "cpu_paper.yaml", server_args, log_path=tmp_path / "sum_teacher.log"):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_with(tag))
        try:
            wait_for_rows(proc, run_dir, 2)
            assert proc.poll() is None, "the run ended before the teacher was stopped"
        except BaseException:
            proc.kill()
            proc.wait(timeout=30)
            raise
    # The `sum` server is stopped for good when the `with` block exits.
    out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert not wait_gone(tag), "the stopped run left processes behind"
    assert proc.returncode == EXIT_STOPPED, out[-2000:] + err[-4000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: teacher server down") and "teacher 'sum'" in last, last
    assert f"teachers.sum.address={address}" in last, last
    assert list_checkpoints(run_dir), "no checkpoint written when the teacher went down"


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


@pytest.mark.slow
def test_the_preset_scores_each_record_by_its_teacher_and_a_resume_keeps_them(tmp_path: Path) -> None:
    """The two-teacher preset for 2 steps, then the same command to 4 resumes from its checkpoint: every record is
    scored by the teacher it names, trained once across the resume."""
    run_dir = tmp_path / "run"
    for steps in (STEPS, 2 * STEPS):  # the second command resumes from the first one's checkpoint at step STEPS
        tag = uuid.uuid4().hex
        cmd = _cmd(
            run_dir,
            f"trainer.total_steps={steps}",
            f"trainer.eval_every={STEPS}",
            "data.eval_batch_size=20",
            f"trainer.save_every={STEPS}",
        )
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env_with(tag), check=False
        )
        assert not wait_gone(tag), "the run left processes behind"
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        assert "teacher 'reverse' server autostarted" in proc.stdout
        assert "teacher 'sum' server autostarted" in proc.stdout
    assert "resuming from checkpoint" in proc.stdout
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 2 * STEPS + 1))
    _check_each_record_scored_by_its_teacher(run_dir)
    trained = [i for row in rows for i in row["sample_ids"]]
    assert len(trained) == len(set(trained)), "a prompt was trained twice across the resume"
