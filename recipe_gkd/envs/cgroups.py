"""Limits on a whole python tool call, not per process: a cgroup of the call's own for all its processes.

It caps their memory together (their pages, their tmpfs files, the kernel's inodes for them) and their number
(processes and threads), reads their CPU time, and finds and kills whatever of the call is left.

Two layouts, chosen once per process by `find_cgroup_tree` (the machine decides, never a fallback inside a run):
- cgroup v2 with the memory and pids controllers enabled for the children of this process's parent cgroup: each
  call is a sibling of this process's own cgroup (a cgroup holding processes cannot enable controllers for its
  children, the "no internal processes" rule);
- cgroup v1 (a hybrid layout, as on the project's CPU machines and CI): the memory, pids and cpuacct hierarchies,
  each call a child of this process's own cgroup in each, so the caller's own limits still cover it. Needs root.
A process joins the call's cgroup itself, before it executes the sandbox (`join_script`): no fork can slip out.
"""

from __future__ import annotations

import os
import shlex
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

MIB = 1 << 20
CALL_PREFIX = "gkd-python-tool-"
# After SIGKILL the kernel tears a process down in milliseconds; this bounds the wait for the cgroup to empty.
EMPTY_WAIT_S = 5.0
_POLL_S = 0.01


class CgroupUnavailable(RuntimeError):
    """No cgroup layout on this machine can hold a call's limits; the message says what is missing."""


class CallCgroup(Protocol):
    """One call's cgroup(s): created with its limits, joined by the call's first process, removed after."""

    def join_script(self) -> str:
        """A shell line moving the shell itself (`$$`) into the call's cgroup(s); then it executes the sandbox."""
        ...

    def oom_kills(self) -> int:
        """Processes of the call the kernel killed at the memory limit."""
        ...

    def forks_refused(self) -> int:
        """Forks (or threads) refused at the process limit."""
        ...

    def cpu_seconds(self) -> float:
        """CPU seconds used by every process the call ran, together."""
        ...

    def peak_memory_bytes(self) -> int:
        """The most memory the call held at once (0: nothing ever ran in it)."""
        ...

    def remove(self) -> None:
        """SIGKILL whatever of the call is left, wait until the cgroup is empty, remove it."""
        ...


class CgroupTree(Protocol):
    """Where calls' cgroups are made on this machine."""

    kind: str

    def create(self, memory_bytes: int, max_tasks: int) -> CallCgroup: ...

    def remove_stale(self) -> None:
        """Remove the empty cgroups of calls whose process died before it could remove them (a kill -9)."""
        ...


@dataclass(frozen=True)
class _Membership:
    """A line of /proc/self/cgroup: the hierarchy's id, its controllers, this process's path in it."""

    hierarchy: str
    controllers: tuple[str, ...]
    path: str


def _memberships() -> list[_Membership]:
    found = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        found.append(_Membership(hierarchy, tuple(c for c in controllers.split(",") if c), path))
    return found


def _mounts() -> Iterator[tuple[str, str, str, set[str]]]:
    """(root, mount point, fs type, super options) of each cgroup mount in /proc/self/mountinfo."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, tail = line.partition(" - ")
        parts, tail_parts = fields.split(), tail.split()
        if tail_parts and tail_parts[0] in ("cgroup", "cgroup2"):
            yield parts[3], parts[4], tail_parts[0], set(tail_parts[2].split(",")) if len(tail_parts) > 2 else set()


def _own_dir(mount_root: str, mount_point: str, path: str) -> Path:
    """This process's cgroup directory in a hierarchy mounted at `mount_point` (its `mount_root` in the tree)."""
    relative = os.path.relpath(path, mount_root) if mount_root != "/" else path.lstrip("/")
    if relative.startswith(".."):
        raise CgroupUnavailable(f"this process's cgroup {path} lies outside the mount of {mount_point} ({mount_root})")
    return Path(mount_point) / ("" if relative == "." else relative)


def _read_key(path: Path, key: str) -> int:
    """The value of `key` in a flat keyed cgroup file (`key value` lines)."""
    for line in path.read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    raise RuntimeError(f"{path} has no {key!r} line")


def _kill_until_empty(procs_files: list[Path], what: str) -> None:
    """SIGKILL every process listed in the cgroups until none is left; raise if some outlive EMPTY_WAIT_S."""
    deadline = time.monotonic() + EMPTY_WAIT_S
    while True:
        pids = {int(pid) for f in procs_files for pid in f.read_text().split()}
        if not pids:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the python tool's call cgroup {what} still holds processes {sorted(pids)}")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it exited between the read and the kill
        time.sleep(_POLL_S)


def _rmdir_when_empty(directory: Path) -> None:
    """rmdir a cgroup whose processes were killed; the kernel may still be releasing them for a moment."""
    deadline = time.monotonic() + EMPTY_WAIT_S
    while True:
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY: a dying process is still charged to it
            if time.monotonic() > deadline:
                raise
            time.sleep(_POLL_S)


def _call_name() -> str:
    return f"{CALL_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _owner_alive(name: str) -> bool:
    """Whether the process that made the call cgroup `name` (gkd-python-tool-PID-...) still runs."""
    pid = int(name[len(CALL_PREFIX) :].split("-", 1)[0])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive, and not ours to clean
    return True


def _remove_stale_in(parent: Path) -> None:
    for entry in parent.glob(CALL_PREFIX + "*"):
        if entry.is_dir() and not _owner_alive(entry.name):
            try:
                entry.rmdir()
            except OSError:
                pass  # not empty: a process of it still runs (ours to leave alone: its owner is another pid ns)


@dataclass
class _V1Call:
    memory: Path
    pids: Path
    cpuacct: Path

    @property
    def dirs(self) -> tuple[Path, Path, Path]:
        return self.memory, self.pids, self.cpuacct

    def join_script(self) -> str:
        return " && ".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}" for d in self.dirs)

    def oom_kills(self) -> int:
        return _read_key(self.memory / "memory.oom_control", "oom_kill")

    def forks_refused(self) -> int:
        return _read_key(self.pids / "pids.events", "max")

    def cpu_seconds(self) -> float:
        return int((self.cpuacct / "cpuacct.usage").read_text()) / 1e9

    def peak_memory_bytes(self) -> int:
        return int((self.memory / "memory.max_usage_in_bytes").read_text())

    def remove(self) -> None:
        _kill_until_empty([d / "cgroup.procs" for d in self.dirs], self.memory.name)
        for d in self.dirs:
            _rmdir_when_empty(d)


@dataclass(frozen=True)
class CgroupV1Tree:
    """Calls as children of this process's own cgroups in the v1 memory, pids and cpuacct hierarchies."""

    memory: Path
    pids: Path
    cpuacct: Path
    kind: str = "cgroup v1 (memory, pids, cpuacct)"

    def create(self, memory_bytes: int, max_tasks: int) -> CallCgroup:
        name = _call_name()
        call = _V1Call(self.memory / name, self.pids / name, self.cpuacct / name)
        made: list[Path] = []
        try:
            for d in call.dirs:
                d.mkdir()
                made.append(d)
            (call.memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
            swap = call.memory / "memory.memsw.limit_in_bytes"
            if swap.exists():  # memory + swap: with swap accounting on, a call cannot spill into swap either
                swap.write_text(str(memory_bytes))
            (call.pids / "pids.max").write_text(str(max_tasks))
        except OSError:
            for d in made:
                d.rmdir()
            raise
        return call

    def remove_stale(self) -> None:
        for parent in (self.memory, self.pids, self.cpuacct):
            _remove_stale_in(parent)


@dataclass
class _V2Call:
    directory: Path

    def join_script(self) -> str:
        return f"echo $$ > {shlex.quote(str(self.directory / 'cgroup.procs'))}"

    def oom_kills(self) -> int:
        return _read_key(self.directory / "memory.events", "oom_kill")

    def forks_refused(self) -> int:
        return _read_key(self.directory / "pids.events", "max")

    def cpu_seconds(self) -> float:
        return _read_key(self.directory / "cpu.stat", "usage_usec") / 1e6

    def peak_memory_bytes(self) -> int:
        peak = self.directory / "memory.peak"  # Linux 5.19+; before it, what it holds now
        return int((peak if peak.exists() else self.directory / "memory.current").read_text())

    def remove(self) -> None:
        kill = self.directory / "cgroup.kill"
        if kill.exists():  # Linux 5.14+: the kernel kills every member at once, forks in flight included
            kill.write_text("1")
        _kill_until_empty([self.directory / "cgroup.procs"], self.directory.name)
        _rmdir_when_empty(self.directory)


@dataclass(frozen=True)
class CgroupV2Tree:
    """Calls as siblings of this process's own cgroup, under a parent that enables memory and pids for them."""

    parent: Path
    kind: str = "cgroup v2 (memory, pids)"

    def create(self, memory_bytes: int, max_tasks: int) -> CallCgroup:
        call = _V2Call(self.parent / _call_name())
        call.directory.mkdir()
        try:
            (call.directory / "memory.max").write_text(str(memory_bytes))
            swap = call.directory / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
            (call.directory / "pids.max").write_text(str(max_tasks))
        except OSError:
            call.directory.rmdir()
            raise
        return call

    def remove_stale(self) -> None:
        _remove_stale_in(self.parent)


V1_CONTROLLERS = ("memory", "pids", "cpuacct")
V2_CONTROLLERS = ("memory", "pids")


def _v2_tree(mounts: list[tuple[str, str, str, set[str]]], memberships: list[_Membership]) -> CgroupV2Tree | str:
    unified = [m for m in mounts if m[2] == "cgroup2"]
    own = [m for m in memberships if m.hierarchy == "0"]
    if not unified or not own:
        return "no cgroup v2 hierarchy is mounted"
    root, point, _, _ = unified[0]
    own_dir = _own_dir(root, point, own[0].path)
    parent = own_dir.parent
    if own_dir == Path(point) or not parent.is_relative_to(point):
        return f"cgroup v2: this process sits in the root of {point}, with no parent cgroup to make calls beside it"
    enabled = (parent / "cgroup.subtree_control").read_text().split()
    missing = [c for c in V2_CONTROLLERS if c not in enabled]
    if missing:
        return f"cgroup v2: {parent}/cgroup.subtree_control does not enable {', '.join(missing)} for its children"
    if not os.access(parent, os.W_OK):
        return f"cgroup v2: {parent} is not writable by this process (uid {os.getuid()})"
    return CgroupV2Tree(parent)


def _v1_tree(mounts: list[tuple[str, str, str, set[str]]], memberships: list[_Membership]) -> CgroupV1Tree | str:
    dirs: dict[str, Path] = {}
    for controller in V1_CONTROLLERS:
        mount = next((m for m in mounts if m[2] == "cgroup" and controller in m[3]), None)
        member = next((m for m in memberships if controller in m.controllers), None)
        if mount is None or member is None:
            return f"cgroup v1: no {controller} hierarchy is mounted"
        directory = _own_dir(mount[0], mount[1], member.path)
        if not os.access(directory, os.W_OK):
            return f"cgroup v1: {directory} is not writable by this process (uid {os.getuid()}; it takes root)"
        dirs[controller] = directory
    return CgroupV1Tree(dirs["memory"], dirs["pids"], dirs["cpuacct"])


def find_cgroup_tree() -> CgroupTree:
    """Where this machine lets the calls' cgroups be made: v2 first, then v1; CgroupUnavailable says why neither."""
    mounts, memberships = list(_mounts()), _memberships()
    v2 = _v2_tree(mounts, memberships)
    if not isinstance(v2, str):
        return v2
    v1 = _v1_tree(mounts, memberships)
    if not isinstance(v1, str):
        return v1
    raise CgroupUnavailable(f"{v2}; {v1}")
