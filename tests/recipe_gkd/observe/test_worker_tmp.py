"""A run's Ray workers leave nothing in the temporary directory when they are killed (recipe_gkd/observe/wandb_guard.py).

With wandb installed, megatron's timers import it in every actor process, and wandb's import makes two
`tmp*wandb*` directories that only a normal exit removes; the run kills its workers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from repo_paths import SUPPORT_DIR

SCENARIO = SUPPORT_DIR / "worker_tmp_scenario.py"


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temporary directory of the scenario's own, with a short path (Ray's socket paths live under it)."""
    path = Path(tempfile.mkdtemp(prefix="gkd", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_killed_worker_leaves_no_wandb_directory(short_tmp: Path, clean_env: dict[str, str]) -> None:
    pytest.importorskip("wandb")
    env = {**clean_env, "TMPDIR": str(short_tmp), "RAY_AUTH_MODE": "disabled"}
    run_dir = short_tmp / "run"
    proc = subprocess.run(
        [sys.executable, str(SCENARIO), str(run_dir)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["worker_tmp"] == str(short_tmp)
    assert not seen["worker_has_wandb"], "the worker imported wandb"
    assert not list(short_tmp.glob("tmp*wandb*")), sorted(p.name for p in short_tmp.iterdir())
