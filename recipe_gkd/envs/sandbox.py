"""The python tool: the model's code in a sandbox of its own per call, with limits on the whole call, its
output capped, and nothing of it left after.

How the call is isolated is chosen once per sandbox (`tool_isolation`, the config's `rollout.tool_isolation`),
each choice a class:
- `"bwrap"` (the default, `Bubblewrap`): bubblewrap namespaces and a read-only view of the interpreter and its
  standard library only (envs/bubblewrap.py), a tmpfs scratch of a fixed size, a seccomp filter (envs/seccomp.py),
  and a cgroup of the call's own (envs/cgroups.py) capping the memory and the processes of the whole call and
  reading its CPU time. It reads,
  writes, signals and connects to nothing outside, and nothing it started outlives it. Where the machine cannot
  give all of it (no bwrap, no user namespaces, no writable cgroup), building the sandbox raises
  `SandboxUnavailable`, a ConfigError naming rollout.tool_isolation and what is missing: never a weaker mode.
- `"socket_guard"`, only when named: a plain child process whose Python `socket` module refuses every socket,
  with per-process limits. A guard, not isolation: the code can read and write what the caller can, signal its
  processes, reach the network through a subprocess or `_socket`, and leave processes behind.
Both set the per-process limits (sandbox_child.py). A timeout, a crash, a limit hit or too
much output is described in the observation the model reads (`SandboxRun.describe`); nothing raises out of a
run but a broken sandbox.
"""

from __future__ import annotations

import contextlib
import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from recipe_gkd.envs import sandbox_child
from recipe_gkd.envs.bubblewrap import CODE_PATH, bwrap_command, interpreter_view
from recipe_gkd.envs.cgroups import CallCgroup, CgroupTree, CgroupUnavailable, find_cgroup_tree
from recipe_gkd.envs.protocol import ToolResult
from recipe_gkd.envs.seccomp import UnsupportedArchitecture, filter_program
from teacher_server.config.errors import ConfigError

TOOL_ISOLATIONS: tuple[str, ...] = ("bwrap", "socket_guard")
ISOLATION_KEY = "rollout.tool_isolation"
CHILD_SCRIPT = Path(sandbox_child.__file__)
_READ_CHUNK = 65536
# After SIGKILL the kernel frees the process at once; this only bounds the wait for its exit status.
KILL_WAIT_S = 5.0
MIB = 1 << 20
# Processes of a bwrap call that are the sandbox's, not the program's: bwrap outside and its init (PID 1) inside.
SANDBOX_TASKS = 2
# How often the whole call's CPU time is read; a call is killed once all its processes together used cpu_s plus
# this slack, so that a single process's own RLIMIT_CPU (exact, at cpu_s) ends it first and says so.
CPU_POLL_S = 0.1
WHOLE_CALL_CPU_SLACK_S = 0.5
# bwrap exits 128 + N when the program died of signal N (a shell's convention).
SIGNAL_EXIT_BASE = 128
_MAX_SIGNAL = 64
PROBE_CODE = "print('ok')"


class SandboxUnavailable(ConfigError):
    """The isolation asked for (rollout.tool_isolation) cannot be given on this machine; says what is missing."""

    def __init__(self, message: str) -> None:
        super().__init__(ISOLATION_KEY, message)

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return type(self), (self.message,)


@dataclass(frozen=True)
class SandboxLimits:
    """Per call: wall seconds (`tool_timeout_s`), memory, CPU seconds, output bytes, the size of one written file,
    processes and threads, the scratch size. With bwrap the memory, CPU and process limits hold for the whole call
    (all its processes together); each process also gets `memory_mib` of address space and `cpu_s` of CPU."""

    timeout_s: float = 10.0
    memory_mib: int = 512
    cpu_s: int = 10
    max_output_bytes: int = 8192
    max_file_mib: int = 16
    max_processes: int = 16
    scratch_mib: int = 64

    def __post_init__(self) -> None:
        for key in (
            "timeout_s",
            "memory_mib",
            "cpu_s",
            "max_output_bytes",
            "max_file_mib",
            "max_processes",
            "scratch_mib",
        ):
            if getattr(self, key) <= 0:
                raise ValueError(f"SandboxLimits.{key} must be > 0, got {getattr(self, key)}")


@dataclass(frozen=True)
class CallUsage:
    """What the call's cgroup saw (all zero without one: socket_guard)."""

    oom_kills: int = 0
    forks_refused: int = 0
    peak_memory_bytes: int = 0


@dataclass(frozen=True)
class SandboxRun:
    """How one run ended: its (capped) output, exit status, and which limit stopped it, if one did."""

    output: str
    returncode: int | None  # None: killed by the sandbox (timeout, output cap, the whole call's CPU)
    timed_out: bool
    output_cut: bool
    limits: SandboxLimits
    cpu_killed: bool = False
    usage: CallUsage = CallUsage()

    @property
    def failed(self) -> bool:
        return self.timed_out or self.output_cut or self.cpu_killed or self.returncode != 0

    def describe(self) -> str:
        """The observation text: the output, then one bracketed line saying how the run ended if not cleanly."""
        notes: list[str] = []
        if self.timed_out:
            notes.append(f"timed out after {self.limits.timeout_s:g} s; the process was killed")
        if self.output_cut:
            notes.append(f"output cut at {self.limits.max_output_bytes} bytes; the process was killed")
        if self.cpu_killed:
            notes.append(f"the CPU limit of {self.limits.cpu_s} s for all its processes was hit; they were killed")
        code = self.returncode
        memory_note = f"the memory limit of {self.limits.memory_mib} MiB was hit"
        if code is not None and code < 0:
            oom = -code == signal.SIGKILL and self.usage.oom_kills
            notes.append(
                f"killed by {_signal_name(-code)}" + (f"; {memory_note}" if oom else self._signal_cause(-code))
            )
        elif code:
            notes.append(f"exit status {code}" + (f"; {memory_note}" if self._memory_error() else ""))
        if self.usage.oom_kills and not (code is not None and -code == signal.SIGKILL):
            notes.append(f"{self.usage.oom_kills} of its processes killed: {memory_note}")
        if self.usage.forks_refused:
            notes.append(f"the limit of {self.limits.max_processes} processes and threads was hit")
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


def _child_args(limits: SandboxLimits, socket_guard: bool, code_file: str) -> list[str]:
    """sandbox_child.py's arguments (its `main`)."""
    values = (limits.memory_mib * MIB, limits.cpu_s, limits.max_file_mib * MIB, int(socket_guard))
    return [*map(str, values), code_file]


@dataclass
class Launch:
    """One call's process as the isolation prepared it, and what its cgroup (if any) can tell about it."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    pass_fds: tuple[int, ...] = ()
    cgroup: CallCgroup | None = None

    def cpu_seconds(self) -> float | None:
        return None if self.cgroup is None else self.cgroup.cpu_seconds()

    def usage(self) -> CallUsage:
        if self.cgroup is None:
            return CallUsage()
        return CallUsage(self.cgroup.oom_kills(), self.cgroup.forks_refused(), self.cgroup.peak_memory_bytes())


class Isolation(Protocol):
    """How a call is isolated: prepares its process and removes all of it after (`launch` is a context manager)."""

    name: str

    def launch(self, code: str, limits: SandboxLimits) -> contextlib.AbstractContextManager[Launch]: ...

    def program_returncode(self, status: int) -> int:
        """The program's exit status (negative: its signal) from the launched process's."""
        ...


class SocketGuard:
    """A plain child (`python -I -u`, the caller's interpreter and packages) in a scratch directory it may leave."""

    name = "socket_guard"

    @contextlib.contextmanager
    def launch(self, code: str, limits: SandboxLimits) -> Iterator[Launch]:
        scratch = Path(tempfile.mkdtemp(prefix="gkd-python-tool-"))
        try:
            code_file = scratch / "tool_code.py"
            code_file.write_text(code, encoding="utf-8")
            env = {
                "PATH": os.defpath,
                "HOME": str(scratch),
                "TMPDIR": str(scratch),
                "LANG": "C.UTF-8",
                "OMP_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1",
            }
            # -I: no user site, no PYTHON* variables, not the script's directory on sys.path; -u: unbuffered.
            argv = [sys.executable, "-I", "-u", str(CHILD_SCRIPT), *_child_args(limits, True, str(code_file))]
            yield Launch(argv, str(scratch), env)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def program_returncode(self, status: int) -> int:
        return status


class Bubblewrap:
    """bubblewrap namespaces and view (envs/bubblewrap.py) in a cgroup of the call's own (envs/cgroups.py)."""

    name = "bwrap"

    def __init__(self, bwrap: str, shell: str, tree: CgroupTree, seccomp_program: bytes) -> None:
        self.bwrap = bwrap
        self.shell = shell
        self.tree = tree
        self.seccomp_program = seccomp_program

    @contextlib.contextmanager
    def launch(self, code: str, limits: SandboxLimits) -> Iterator[Launch]:
        cgroup: CallCgroup | None = None
        with contextlib.ExitStack() as fds:
            # The model's code reaches the sandbox as a read-only file copied from a memfd: nothing of it on the host.
            code_fd = _memfd("gkd-python-tool-code", code.encode("utf-8"), fds)
            seccomp_fd = _memfd("gkd-python-tool-seccomp", self.seccomp_program, fds)
            try:
                cgroup = self.tree.create(limits.memory_mib * MIB, limits.max_processes + SANDBOX_TASKS)
                child_args = _child_args(limits, False, CODE_PATH)
                inner = bwrap_command(
                    self.bwrap,
                    interpreter_view(),
                    CHILD_SCRIPT,
                    code_fd,
                    seccomp_fd,
                    child_args,
                    limits.scratch_mib * MIB,
                )
                # The shell joins the call's cgroup, then becomes bwrap: everything the call starts is counted.
                argv = [self.shell, "-c", cgroup.join_script() + ' && exec "$@"', "sh", *inner]
                yield Launch(argv, "/", {"PATH": os.defpath}, pass_fds=(code_fd, seccomp_fd), cgroup=cgroup)
            finally:
                if cgroup is not None:
                    cgroup.remove()

    def program_returncode(self, status: int) -> int:
        if SIGNAL_EXIT_BASE < status <= SIGNAL_EXIT_BASE + _MAX_SIGNAL:
            # A program's own exit(129..192) reads as a signal too: the convention cannot tell them apart.
            return -(status - SIGNAL_EXIT_BASE)
        return status


def _memfd(name: str, data: bytes, closing: contextlib.ExitStack) -> int:
    """A memfd holding `data`, read from its start by bwrap; closed with `closing`."""
    fd = os.memfd_create(name)
    closing.callback(os.close, fd)
    with open(fd, "wb", closefd=False) as f:
        f.write(data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the launched process's whole group (bwrap and its init; socket_guard: the child and its group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is already gone
    proc.wait(timeout=KILL_WAIT_S)


@dataclass
class _Read:
    output: bytes
    timed_out: bool = False
    cut: bool = False
    cpu_killed: bool = False


def _read_capped(
    proc: subprocess.Popen[bytes], deadline: float, limits: SandboxLimits, cpu_seconds: Callable[[], float | None]
) -> _Read:
    """The merged output until EOF, the deadline, more than the cap, or the whole call's CPU over its limit."""
    assert proc.stdout is not None
    chunks: list[bytes] = []
    size = 0
    cap = limits.max_output_bytes
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return _Read(b"".join(chunks), timed_out=True)
            used = cpu_seconds()
            if used is not None and used > limits.cpu_s + WHOLE_CALL_CPU_SLACK_S:
                return _Read(b"".join(chunks), cpu_killed=True)
            if not selector.select(timeout=min(left, CPU_POLL_S)):
                continue
            chunk = os.read(proc.stdout.fileno(), _READ_CHUNK)
            if not chunk:
                return _Read(b"".join(chunks))
            chunks.append(chunk)
            size += len(chunk)
            if size > cap:
                return _Read(b"".join(chunks)[:cap], cut=True)


def _wait_for_exit(proc: subprocess.Popen[bytes], deadline: float, limits: SandboxLimits, launch: Launch) -> _Read:
    """The output closed; the process may still run (it closed stdout itself): wait within the same budget."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return _Read(b"", timed_out=True)
        used = launch.cpu_seconds()
        if used is not None and used > limits.cpu_s + WHOLE_CALL_CPU_SLACK_S:
            return _Read(b"", cpu_killed=True)
        try:
            proc.wait(timeout=min(left, CPU_POLL_S))
            return _Read(b"")
        except subprocess.TimeoutExpired:
            continue


def execute(isolation: Isolation, code: str, limits: SandboxLimits) -> SandboxRun:
    """Run `code` once under `isolation`; whatever happened, nothing of the call is left when this returns."""
    deadline = time.monotonic() + limits.timeout_s  # one budget for starting, running and exiting
    with isolation.launch(code, limits) as launch:
        proc = subprocess.Popen(
            launch.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=launch.cwd,
            env=launch.env,
            pass_fds=launch.pass_fds,
            start_new_session=True,  # its own process group: a kill reaches what it started in that group too
        )
        try:
            read = _read_capped(proc, deadline, limits, launch.cpu_seconds)
            if not (read.timed_out or read.cut or read.cpu_killed):
                ended = _wait_for_exit(proc, deadline, limits, launch)
                read.timed_out, read.cpu_killed = ended.timed_out, ended.cpu_killed
        finally:
            status = proc.poll()
            _kill_group(proc)
            assert proc.stdout is not None
            proc.stdout.close()
        usage = launch.usage()
    killed_by_us = read.timed_out or read.cut or read.cpu_killed
    return SandboxRun(
        output=read.output.decode("utf-8", errors="replace"),
        returncode=None if killed_by_us or status is None else isolation.program_returncode(status),
        timed_out=read.timed_out,
        output_cut=read.cut,
        limits=limits,
        cpu_killed=read.cpu_killed,
        usage=usage,
    )


INSTALL_HINT = (
    "install it: `apt-get install bubblewrap` (Debian, Ubuntu; `make setup` does it when run as root), "
    "`dnf install bubblewrap` (Fedora, RHEL)"
)


@functools.cache
def bubblewrap_isolation() -> Bubblewrap | str:
    """The bwrap isolation, checked once per process by running an empty call through all of it; or what is
    missing on this machine."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return f"bubblewrap is not installed (no `bwrap` on PATH): {INSTALL_HINT}"
    shell = shutil.which("sh")
    if shell is None:
        return "no `sh` on PATH (the launcher that joins a call's cgroup before it becomes bwrap)"
    try:
        tree = find_cgroup_tree()
    except CgroupUnavailable as err:
        return f"no cgroup can hold a whole call's memory and process limits here: {err}"
    try:
        program = filter_program()
    except UnsupportedArchitecture as err:
        return str(err)
    tree.remove_stale()
    isolation = Bubblewrap(bwrap, shell, tree, program)
    run = execute(isolation, PROBE_CODE, SandboxLimits(timeout_s=30.0))
    if run.output != "ok\n" or run.returncode != 0:
        return (
            f"an empty call through {bwrap} failed ({' '.join(run.describe().split())}); it needs unprivileged user "
            "namespaces (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0; in a container, a "
            "seccomp and AppArmor profile that allow them)"
        )
    if run.usage.peak_memory_bytes <= 0:
        return f"an empty call ran outside its {tree.kind} cgroup (it recorded no memory)"
    return isolation


def build_isolation(tool_isolation: str) -> Isolation:
    """The isolation named `tool_isolation`; SandboxUnavailable (a ConfigError) where this machine cannot give it."""
    if tool_isolation == "socket_guard":
        return SocketGuard()
    if tool_isolation != "bwrap":
        raise SandboxUnavailable(f"must be one of {TOOL_ISOLATIONS}, got {tool_isolation!r}")
    found = bubblewrap_isolation()
    if isinstance(found, str):
        raise SandboxUnavailable(
            f"the python tool's isolation `bwrap` is unavailable on this machine: {found}. Only where the model's "
            "code is trusted, set rollout.tool_isolation=socket_guard (the python environment's tool_isolation "
            "option): Python's sockets refused and nothing else, the code reads, writes and signals what this "
            "process can"
        )
    return found


class PythonSandbox:
    """Runs code in a sandbox of its own per call; `tool_isolation` is chosen once (see the module docstring)."""

    def __init__(self, limits: SandboxLimits | None = None, tool_isolation: str = "bwrap") -> None:
        self.isolation = build_isolation(tool_isolation)
        self.limits = limits or SandboxLimits()

    def run(self, code: str) -> SandboxRun:
        """Run `code` as `__main__`; nothing of the call (files, processes) is left when this returns."""
        return execute(self.isolation, code, self.limits)


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
