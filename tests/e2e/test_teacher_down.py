"""The whole teacher server goes down mid-run: checkpoint, one-line error naming the address, exit 3;
the same command after the server is back continues, and every prompt is trained exactly once."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest
from cli_runs import (
    RUN_TIMEOUT_S,
    TOTAL_STEPS,
    WORDS,
    _free_port,
    cli,
    env_with,
    expected_sample_ids,
    run_to_end,
    wait_for_rows,
    wait_gone,
)

from recipe_gkd.config import DEFAULT_CONFIG
from recipe_gkd.main import EXIT_STOPPED
from recipe_gkd.observe.metrics import read_metrics
from recipe_gkd.runtime.checkpoint import list_checkpoints, verify
from teacher_server.client.launcher import launch_teacher

# The client declares the server dead after this long without a reply (then the run stops).
TEACHER_TIMEOUT_S = 5
STOP_AFTER_ROWS = 2


@pytest.mark.slow
def test_teacher_down_checkpoints_and_exits_then_the_rerun_continues(
    inputs: dict[str, Path],
    tmp_path: Path,
) -> None:
    address = f"tcp://127.0.0.1:{_free_port()}"
    # The demo preset's teacher GPU (what launch/start_teacher.sh would pass from the placement plan).
    server_args = [f"teacher.model_path={inputs['teacher']}", f"teacher.address={address}", "server.gpu_ids=[2]"]
    run_dir = tmp_path / "run"
    cmd = cli(
        inputs,
        run_dir,
        "teacher.autostart=false",
        f"teacher.address={address}",
        f"teacher.timeout_s={TEACHER_TIMEOUT_S}",
        "teacher.client.retries=1",
        "trainer.save_every=100",  # the checkpoint must come from the failure itself
    )
    tag = uuid.uuid4().hex
    with launch_teacher(DEFAULT_CONFIG, server_args, log_path=tmp_path / "teacher1.log"):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_with(tag))
        try:
            wait_for_rows(proc, run_dir, STOP_AFTER_ROWS)
            assert proc.poll() is None, "the run ended before the teacher was stopped"
        except BaseException:
            proc.kill()
            proc.wait(timeout=30)
            raise
    # The server is stopped (SIGTERM to its group) when the `with` block exits.
    out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert not wait_gone(tag), "the stopped run left processes behind"
    assert proc.returncode == EXIT_STOPPED, out[-2000:] + err[-4000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: teacher server down") and address in last, last
    assert "Traceback" not in err
    trained = len(read_metrics(run_dir))
    assert trained >= STOP_AFTER_ROWS
    saved = [p for p in list_checkpoints(run_dir) if verify(p) is None]
    assert [p.name for p in saved] == [f"step_{trained:06d}"], "the failure checkpoints every trained step"

    with launch_teacher(DEFAULT_CONFIG, server_args, log_path=tmp_path / "teacher2.log"):
        again = run_to_end(cmd)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-4000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, TOTAL_STEPS + 1))
    assert [r["sample_ids"] for r in rows] == expected_sample_ids(TOTAL_STEPS, len(WORDS))
