"""`python -m recipe_gkd.doctor` on the CPU demo: every check on the run's real processes, one line each, exit 0,
nothing left behind and nothing written to the run's own directory; a broken setup exits 2 naming the key."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from cli_runs import run_to_end

pytestmark = pytest.mark.slow
CHECKS = (
    "local paths",
    "environment",
    "record fields",
    "record teachers",
    "student split",
    "teacher head",
    "shared memory",
    "memory plan",
    "prompt lengths",
    "chat templates",
    "turn ends",
    "teacher connects",
    "teacher agreement",
    "smoke step",
)


def test_the_doctor_passes_the_cpu_demo_on_its_real_processes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_to_end([sys.executable, "-m", "recipe_gkd.doctor", f"trainer.run_dir={run_dir}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ok  ", "warn", "FAIL"))]
    assert [line[6:].split(":")[0] for line in lines] == list(CHECKS), lines
    assert all(line.startswith("ok  ") for line in lines)
    agreement = next(line for line in lines if "teacher agreement" in line)
    assert "largest |logprob difference|" in agreement and "(doctor.teacher_tolerance 0.05)" in agreement
    smoke = next(line for line in lines if "smoke step" in line)
    assert "generate_s" in smoke and "sync check" in smoke and "actor0_rss" in smoke
    assert proc.stdout.rstrip().endswith("doctor: every check passed; the run may start")
    assert not run_dir.exists(), "the doctor works in a scratch directory, never the run's own"


def test_main_doctor_stops_at_the_first_failure_naming_the_key(tmp_path: Path) -> None:
    """Prompts longer than data.max_prompt_length: refused before any process starts (main --doctor)."""
    cmd = [
        sys.executable,
        "-m",
        "recipe_gkd.main",
        "--doctor",
        "data.max_prompt_length=12",
        f"trainer.run_dir={tmp_path}",
    ]
    proc = run_to_end(cmd)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    fail = [line for line in proc.stdout.splitlines() if line.startswith("FAIL")]
    assert len(fail) == 1 and fail[0].startswith("FAIL  prompt lengths:") and "[data.max_prompt_length]" in fail[0]
    assert "teacher connects" not in proc.stdout, "nothing after the first failure"
