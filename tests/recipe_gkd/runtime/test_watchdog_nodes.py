"""The hang watchdog on two Ray nodes: a worker on another node than the driver's is dumped there
and its stack still lands in the driver's run directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import SUPPORT_DIR

SCENARIO = SUPPORT_DIR / "watchdog_scenario.py"


@pytest.mark.slow
def test_stacks_of_workers_on_another_node_reach_the_run_directory(tmp_path: Path, clean_env: dict[str, str]) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(SCENARIO), str(run_dir)], capture_output=True, text=True, timeout=240, env=clean_env
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    near, far = result["workers"]["near"], result["workers"]["far"]
    assert near["node"] == result["driver_node"] != far["node"], "one worker per node"
    assert Path(near["stack_file"]).parent == run_dir.resolve() / ".stacks"
    assert not Path(far["stack_file"]).is_relative_to(run_dir.resolve()), "the far node writes to its own disk"
    dumps = {p.name: p.read_text() for p in Path(result["dump_dir"]).iterdir()}
    assert set(dumps) == {"near.txt", "far.txt", "driver.txt"}
    for name in ("near.txt", "far.txt"):
        assert "in block_in_user_code" in dumps[name], dumps[name]
