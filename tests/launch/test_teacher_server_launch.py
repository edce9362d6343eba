"""launch/start_teacher.sh: ready only after a real round trip, --join, fail fast, clean SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from teacher_servers import write_teacher_yaml

from teacher_server.client.launcher import stop_process_group
from teacher_server.client.zmq_client import TeacherClient

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "launch" / "start_teacher.sh"
READY_TIMEOUT_S = 180.0
FAIL_FAST_S = 30.0
STOP_TIMEOUT_S = 20.0
# Rounds of requests sent until the joined replica has answered one (each round: 8 sequences, 2 in flight).
JOIN_ROUNDS = 20


def _env(clean_env: dict[str, str]) -> dict[str, str]:
    import sys

    return {**clean_env, "PYTHON": sys.executable}


@contextmanager
def _script(args: list[str], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """Run start_teacher.sh in its own process group; stop exactly that group afterwards."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            ["bash", str(SCRIPT), *args], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        yield proc
    finally:
        stop_process_group(proc)


def _wait_line(proc: subprocess.Popen[bytes], log: Path, pattern: str) -> re.Match[str]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        match = re.search(pattern, log.read_text(errors="replace"), re.MULTILINE)
        if match:
            return match
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()}"
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} not printed in {READY_TIMEOUT_S} s:\n{log.read_text()}")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def test_ready_after_round_trip_join_sigterm_and_a_server_whose_replicas_are_not_restarted_stops(
    tiny_model_dir: Path, tmp_path: Path, clean_env: dict[str, str]
) -> None:
    """READY only after a real round trip; a second node joins with --join, serves, and stops cleanly on SIGTERM
    (exit 0, its replica gone). The main server runs with server.max_restarts=0 (a colocated run's teacher:
    recipe_gkd.runtime.teacher_service.colocated_teacher_overrides): its one replica killed, it exits 1 saying why, so the
    run hears it is gone. (One server for both: each launch costs the suite ~20-40 s.)"""
    from recipe_gkd.config import CONFIG_DIR, load_config
    from recipe_gkd.runtime.teacher_service import colocated_teacher_overrides

    overrides = colocated_teacher_overrides(load_config(CONFIG_DIR / "presets" / "cpu_colocated.yaml"))
    assert overrides == ["server.max_restarts=0"]
    assert colocated_teacher_overrides(load_config(None)) == []  # elsewhere a replica is restarted
    yaml_path = write_teacher_yaml(tmp_path / "teacher.yaml", tiny_model_dir)
    env = _env(clean_env)
    log = tmp_path / "main.log"
    with _script(["--config", str(yaml_path), *overrides], log, env) as main:
        ready = _wait_line(main, log, r"^READY (\S+) replica_address=(\S+)$")
        address, replica_address = ready.group(1), ready.group(2)
        client = TeacherClient(address, timeout_s=60, top_k=4)
        (replica,) = client.stats().replicas
        # Nobody but start-up has used the server: its one request is the readiness probe.
        assert replica.requests == 1
        with _script(
            ["--config", str(yaml_path), "--node-rank", "1", "--join", replica_address], tmp_path / "join.log", env
        ) as join:
            _wait_line(join, tmp_path / "join.log", rf"^JOINED {re.escape(replica_address)}$")
            stats = {r.name: r for r in client.stats().replicas}
            assert sorted(stats) == ["n0-r0", "n1-r0"]
            client.max_inflight = 2

            def joined_requests() -> int:
                return {r.name: r.requests for r in client.stats().replicas}["n1-r0"]

            # Least-loaded dispatch sends a request to the joined replica once the first one is busy: on a loaded
            # machine a whole round may finish on n0-r0 before its second request arrives, so a few rounds are sent.
            for _ in range(JOIN_ROUNDS):
                client.score([[1, 2, 3, 4]] * 8, [1] * 8)
                if joined_requests():
                    break
            assert stats["n1-r0"].pid and joined_requests() >= 1
            join.send_signal(signal.SIGTERM)
            assert join.wait(STOP_TIMEOUT_S) == 0
            assert _gone(stats["n1-r0"].pid)
        client.close()
        os.kill(replica.pid, signal.SIGKILL)
        assert main.wait(timeout=STOP_TIMEOUT_S) == 1
        assert _gone(replica.pid)
    text = log.read_text()
    assert "replica n0-r0 exited with code -9" in text and "not restarting it (server.max_restarts)" in text
    assert "every replica has exited and none is restarted (server.max_restarts=0): stopping the server" in text


def test_missing_model_path_fails_fast(tmp_path: Path, clean_env: dict[str, str]) -> None:
    yaml_path = write_teacher_yaml(tmp_path / "teacher.yaml", tmp_path / "no_such_model")
    start = time.monotonic()
    out = subprocess.run(
        ["bash", str(SCRIPT), "--config", str(yaml_path)],
        capture_output=True,
        text=True,
        env=_env(clean_env),
        timeout=FAIL_FAST_S,
    )
    assert out.returncode == 2
    assert "teacher.model_path" in out.stderr and "no_such_model" in out.stderr
    assert "READY" not in out.stdout and time.monotonic() - start < FAIL_FAST_S


@pytest.mark.slow
def test_a_replica_that_cannot_load_fails_start_up_with_its_log(tmp_path: Path, clean_env: dict[str, str]) -> None:
    not_a_model = tmp_path / "empty_dir"
    not_a_model.mkdir()
    yaml_path = write_teacher_yaml(tmp_path / "teacher.yaml", not_a_model)
    out = subprocess.run(
        ["bash", str(SCRIPT), "--config", str(yaml_path)],
        capture_output=True,
        text=True,
        env=_env(clean_env),
        timeout=READY_TIMEOUT_S,
    )
    assert out.returncode == 1 and "READY" not in out.stdout
    assert "replica n0-r0 exited with code 2" in out.stderr and "failed to load" in out.stderr
