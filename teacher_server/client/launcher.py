"""Start a teacher server as a subprocess and stop exactly it (teacher.autostart, tests, benchmarks).

    with launch_teacher("configs/presets/cpu_demo.yaml", ["teacher.address=tcp://127.0.0.1:0"]) as server:
        client = TeacherClient.from_config(cfg.teacher, address=server.address, ...)

The server runs `python -m teacher_server --config PATH ...` in a new session (its own
process group, holding its replicas); the context waits for its `READY <address>` line and on
exit sends SIGTERM to that group, then SIGKILL if it has not stopped in time.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

READY_PATTERN = re.compile(r"^READY (\S+) replica_address=(\S+)$", re.MULTILINE)
POLL_S = 0.1
STOP_TIMEOUT_S = 15.0
LOG_TAIL_LINES = 60
DEFAULT_READY_TIMEOUT_S = 600.0
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
# linux/prctl.h: deliver a signal to this process when its parent thread exits.
PR_SET_PDEATHSIG = 1


class TeacherLaunchError(RuntimeError):
    """The server exited or did not print READY in time; the message carries its log tail."""


@dataclass(frozen=True)
class TeacherProcess:
    """A running server: its pid (= its process group id), bound addresses and log file."""

    pid: int
    address: str
    # Where replicas of other processes or nodes join (`--join`).
    replica_address: str
    log_path: Path


class StartingTeacher:
    """A server process started and not waited for: `ready()` waits for its READY line (once)."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path, ready_timeout_s: float, log_start: int) -> None:
        self.proc = proc
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.deadline = time.monotonic() + ready_timeout_s  # READY must have come by then
        self.log_start = log_start
        self._ready: TeacherProcess | None = None

    def ready(self) -> TeacherProcess:
        """The running server once it printed READY; raises TeacherLaunchError (with its log tail) otherwise."""
        if self._ready is None:
            address, replica_address = _wait_ready(
                self.proc, self.log_path, self.deadline, self.ready_timeout_s, self.log_start
            )
            self._ready = TeacherProcess(self.proc.pid, address, replica_address, self.log_path)
        return self._ready


@contextmanager
def start_teacher(
    config: str | Path,
    overrides: Sequence[str] = (),
    *,
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    log_path: str | Path | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[StartingTeacher]:
    """Start a teacher server for the duration of the `with` block without waiting for it.

    The caller does other work while the server loads (a run starts Ray and its workers) and
    calls `ready()` where it needs the address; READY must come within ready_timeout_s of the start.
    """
    log_file_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="teacher_server_", suffix=".log")[1])
    cmd = [sys.executable, "-m", "teacher_server", "--config", str(config), *extra_args, *overrides]
    child_env = dict(env if env is not None else os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), child_env.get("PYTHONPATH", "")) if p)
    child_env["PYTHONUNBUFFERED"] = "1"
    # The log may hold earlier servers' READY lines (a rerun in the same run directory): read past them.
    log_start = log_file_path.stat().st_size if log_file_path.is_file() else 0
    with open(log_file_path, "ab") as log_file:
        proc = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,
            preexec_fn=functools.partial(_die_with_parent, os.getpid()),
        )
    try:
        yield StartingTeacher(proc, log_file_path, ready_timeout_s, log_start)
    finally:
        stop_process_group(proc)


@contextmanager
def launch_teacher(
    config: str | Path,
    overrides: Sequence[str] = (),
    *,
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    log_path: str | Path | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[TeacherProcess]:
    """Run a teacher server for the duration of the `with` block; yields once it is READY."""
    with start_teacher(
        config, overrides, extra_args=extra_args, ready_timeout_s=ready_timeout_s, log_path=log_path, env=env
    ) as starting:
        yield starting.ready()


def _die_with_parent(launcher_pid: int) -> None:
    """In the child before exec: SIGTERM it when the launching process dies, even by SIGKILL.

    The server runs in its own session (so stopping it never signals the launcher's group), which
    also means a kill -9 of the launcher's group would leave it orphaned without this (Linux only).
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != launcher_pid:  # the launcher died before prctl took effect
        os._exit(1)


def _wait_ready(
    proc: subprocess.Popen[bytes], log_path: Path, deadline: float, timeout_s: float, offset: int = 0
) -> tuple[str, str]:
    while True:
        with log_path.open("rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        match = READY_PATTERN.search(text)
        if match:
            return match.group(1), match.group(2)
        if proc.poll() is not None:
            raise TeacherLaunchError(f"the teacher server exited with code {proc.returncode}:\n{_tail(text)}")
        if time.monotonic() > deadline:
            raise TeacherLaunchError(f"the teacher server was not READY within {timeout_s} s:\n{_tail(text)}")
        time.sleep(POLL_S)


def stop_process_group(proc: subprocess.Popen[bytes], timeout_s: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM the group led by `proc` (started with start_new_session), SIGKILL it after timeout_s."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
    # Replicas left behind by a killed supervisor share its group: stop them too.
    _signal_group(proc.pid, signal.SIGKILL)
    return proc.returncode


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return


def _tail(text: str) -> str:
    return "\n".join(f"  | {line}" for line in text.splitlines()[-LOG_TAIL_LINES:])
