"""A phase stuck past debug.hang_timeout_s: every worker's stack on disk, exit 4 naming the phase and worker (the
workers' set-up is bounded by debug.setup_timeout_s, not by that)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_runs import checkpointed_cli, run_to_end

from recipe_gkd.exit_codes import EXIT_HANG

# A step's bound, shorter than the workers' set-up on two busy cores (bounded by debug.setup_timeout_s instead) and
# far shorter than the emulated teacher latency.
HANG_TIMEOUT_S = 8
STUCK_TEACHER_S = 3600


@pytest.mark.slow
def test_a_stuck_rollout_dumps_every_stack_and_names_itself(
    inputs: dict[str, Path],
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    overrides = [f"debug.hang_timeout_s={HANG_TIMEOUT_S}", f"debug.teacher_latency_s={STUCK_TEACHER_S}"]
    proc = run_to_end(checkpointed_cli(inputs, run_dir, "trainer.save_every=0", *overrides))
    assert proc.returncode == EXIT_HANG, proc.stdout[-2000:] + proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "phase 'rollout of step 0'" in last and "stuck: rollout0 at rollout/teacher_set.py" in last, last
    assert "Traceback" not in proc.stderr
    dumps = list(run_dir.glob("hang_rollout_of_step_0_*"))
    assert len(dumps) == 1 and str(dumps[0]) in last
    files = {p.name: p.read_text() for p in dumps[0].iterdir()}
    assert set(files) == {"actor0.txt", "rollout0.txt", "driver.txt"}
    assert "in score" in files["rollout0.txt"] and "Thread" in files["rollout0.txt"]
    assert "Thread" in files["actor0.txt"], "the idle actor's stack is dumped too"
    assert "in wait" in files["driver.txt"]
