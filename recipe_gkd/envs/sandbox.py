"""The python tool: the model's code in a child process with a wall timeout, memory, CPU and file-size
limits, no network, a scratch directory removed after, and its output capped.

What "no network" means is chosen once per sandbox (`network`):
- `"namespace"` (the default): the child enters a fresh user + network namespace (unshare(2)) before the
  code runs; it sees only a loopback interface that is down, so no process it starts (curl, a subprocess,
  ctypes) reaches anything. Needs unprivileged user namespaces (`kernel.unprivileged_userns_clone`, absent
  in some containers); where the kernel refuses, building the sandbox fails and says so.
- `"socket_guard"`: Python's `socket` module refuses every socket in the child. A guard, not isolation:
  a subprocess the code starts, or `_socket`/ctypes used directly, still reaches the network.
Both install the socket guard. A timeout, a crash, a limit hit or too much output is described in the
observation the model reads (`SandboxRun.describe`); nothing raises out of a run but a broken sandbox.
"""

from __future__ import annotations

import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from recipe_gkd.envs import sandbox_child
from recipe_gkd.envs.protocol import ToolResult

NetworkIsolation = Literal["namespace", "socket_guard"]
CHILD_SCRIPT = Path(sandbox_child.__file__)
_READ_CHUNK = 65536
# After SIGKILL the kernel frees the process at once; this only bounds the wait for its exit status.
KILL_WAIT_S = 5.0
PROBE_TIMEOUT_S = 30.0
MIB = 1 << 20


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot give the isolation it was asked for on this machine."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per run: wall seconds (`tool_timeout_s`), address space, CPU seconds, output bytes, written file bytes."""

    timeout_s: float = 10.0
    memory_mib: int = 512
    cpu_s: int = 10
    max_output_bytes: int = 8192
    max_file_mib: int = 16

    def __post_init__(self) -> None:
        for key in ("timeout_s", "memory_mib", "cpu_s", "max_output_bytes", "max_file_mib"):
            if getattr(self, key) <= 0:
                raise ValueError(f"SandboxLimits.{key} must be > 0, got {getattr(self, key)}")


@dataclass(frozen=True)
class SandboxRun:
    """How one run ended: its (capped) output, exit status, and which limit stopped it, if one did."""

    output: str
    returncode: int | None  # None: killed by the sandbox (timeout or output cap)
    timed_out: bool
    output_cut: bool
    limits: SandboxLimits

    @property
    def failed(self) -> bool:
        return self.timed_out or self.output_cut or self.returncode != 0

    def describe(self) -> str:
        """The observation text: the output, then one bracketed line saying how the run ended if not cleanly."""
        notes: list[str] = []
        if self.timed_out:
            notes.append(f"timed out after {self.limits.timeout_s:g} s; the process was killed")
        if self.output_cut:
            notes.append(f"output cut at {self.limits.max_output_bytes} bytes; the process was killed")
        code = self.returncode
        if code is not None and code < 0:
            notes.append(f"killed by {_signal_name(-code)}{self._signal_cause(-code)}")
        elif code:
            cause = f"; the memory limit of {self.limits.memory_mib} MiB was hit" if self._memory_error() else ""
            notes.append(f"exit status {code}{cause}")
        text = self.output if self.output else ("" if notes else "(no output)")
        if notes:
            text = (text.rstrip("\n") + "\n" if text else "") + "[" + "; ".join(notes) + "]"
        return text

    def _memory_error(self) -> bool:
        """The program died of a MemoryError: a traceback whose last line names it."""
        last_line = self.output.rstrip().rpartition("\n")[2]
        return "Traceback (most recent call last)" in self.output and last_line.split(":")[0] == "MemoryError"

    def _signal_cause(self, number: int) -> str:
        if number == signal.SIGXCPU:
            return f"; the CPU limit of {self.limits.cpu_s} s was hit"
        if number == signal.SIGXFSZ:
            return f"; a file over {self.limits.max_file_mib} MiB was written"
        return ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name
        return f"signal {number}"


def _child_command(code_file: Path, limits: SandboxLimits, namespace: bool) -> list[str]:
    spec = {
        "memory_bytes": limits.memory_mib * MIB,
        "cpu_seconds": limits.cpu_s,
        "max_file_bytes": limits.max_file_mib * MIB,
        "network_namespace": namespace,
    }
    # -I: no user site, no PYTHON* variables, not the script's directory on sys.path; -u: output unbuffered,
    # so what was printed before a timeout is still read.
    return [sys.executable, "-I", "-u", str(CHILD_SCRIPT), json.dumps(spec), str(code_file)]


def _child_env(scratch: Path) -> dict[str, str]:
    return {
        "PATH": os.defpath,
        "HOME": str(scratch),
        "TMPDIR": str(scratch),
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
    }


@functools.cache
def namespace_available() -> bool:
    """Whether a child can enter a user + network namespace here (probed once per process)."""
    probe = [
        sys.executable,
        "-I",
        "-c",
        "import sys; sys.path.insert(0, sys.argv[1]); import sandbox_child as c; sys.exit(c.enter_network_namespace())",
        str(CHILD_SCRIPT.parent),
    ]
    done = subprocess.run(probe, capture_output=True, timeout=PROBE_TIMEOUT_S, check=False)
    return done.returncode == 0


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's whole session (it and anything it started), then reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is already gone
    proc.wait(timeout=KILL_WAIT_S)


def _read_capped(proc: subprocess.Popen[bytes], deadline: float, cap: int) -> tuple[bytes, bool, bool]:
    """The child's merged output until EOF, the deadline, or more than `cap` bytes: (output, timed_out, cut)."""
    assert proc.stdout is not None
    chunks: list[bytes] = []
    size = 0
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return b"".join(chunks), True, False
            if not selector.select(timeout=left):
                continue
            chunk = os.read(proc.stdout.fileno(), _READ_CHUNK)
            if not chunk:
                return b"".join(chunks), False, False
            chunks.append(chunk)
            size += len(chunk)
            if size > cap:
                return b"".join(chunks)[:cap], False, True


class PythonSandbox:
    """Runs code in a fresh child process per call; `network` is chosen once (see the module docstring)."""

    def __init__(self, limits: SandboxLimits | None = None, network: NetworkIsolation = "namespace") -> None:
        if network not in ("namespace", "socket_guard"):
            raise ValueError(f"network must be 'namespace' or 'socket_guard', got {network!r}")
        if network == "namespace" and not namespace_available():
            raise SandboxUnavailable(
                "the python tool cannot enter a network namespace on this machine (unprivileged user namespaces "
                "are off); set network='socket_guard' to refuse Python's sockets only (a subprocess the code "
                "starts can still reach the network)"
            )
        self.limits = limits or SandboxLimits()
        self.network: NetworkIsolation = network

    def run(self, code: str) -> SandboxRun:
        """Run `code` as `__main__` in a scratch directory that is removed afterwards, whatever happened."""
        deadline = time.monotonic() + self.limits.timeout_s  # one budget for starting, running and exiting
        scratch = Path(tempfile.mkdtemp(prefix="gkd-python-tool-"))
        try:
            code_file = scratch / "tool_code.py"
            code_file.write_text(code, encoding="utf-8")
            proc = subprocess.Popen(
                _child_command(code_file, self.limits, self.network == "namespace"),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=scratch,
                env=_child_env(scratch),
                start_new_session=True,  # its own process group: a timeout kills what it started too
            )
            try:
                raw, timed_out, cut = _read_capped(proc, deadline, self.limits.max_output_bytes)
                if not (timed_out or cut):
                    try:  # the output closed; the process may still run (it closed stdout itself)
                        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        timed_out = True
            finally:
                returncode = proc.poll()
                _kill_group(proc)
                assert proc.stdout is not None
                proc.stdout.close()
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if returncode == sandbox_child.EXIT_NO_NAMESPACE and self.network == "namespace":
            raise SandboxUnavailable(
                f"the python tool's child could not enter its network namespace: {raw.decode(errors='replace')}"
            )
        killed_by_us = timed_out or cut
        return SandboxRun(
            output=raw.decode("utf-8", errors="replace"),
            returncode=None if killed_by_us else returncode,
            timed_out=timed_out,
            output_cut=cut,
            limits=self.limits,
        )


class PythonTool:
    """`python(code)`: run a Python program in the sandbox; the observation is its output and how it ended."""

    name: ClassVar[str] = "python"
    description: ClassVar[str] = "Run a Python 3 program and return what it prints (no network, no files kept)."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program; print what you need"}},
        "required": ["code"],
    }

    def __init__(self, sandbox: PythonSandbox) -> None:
        self.sandbox = sandbox

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        code = arguments["code"]
        if not isinstance(code, str):
            return ToolResult(f"error: 'code' must be a string, got {type(code).__name__}", failed=True)
        run = self.sandbox.run(code)
        return ToolResult(run.describe(), failed=run.failed)
