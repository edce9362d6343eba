"""Where a call's cgroup is made: the layout read from /proc/self/{cgroup,mountinfo} (here: fabricated ones over a
directory tree), what each layout lacks said in words, stale cgroups of dead callers removed. The kernel's side
(limits that bite, kills that empty a cgroup) is tested through real calls in test_envs_sandbox_escapes.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipe_gkd.envs import cgroups
from recipe_gkd.envs.cgroups import CALL_PREFIX, CgroupV1Tree, CgroupV2Tree, _Membership


def v2_layout(tmp_path: Path, enabled: str) -> tuple[list[tuple[str, str, str, set[str]]], list[_Membership], Path]:
    """A cgroup2 mount at tmp_path with this process in /workers/me, whose parent enables `enabled`."""
    parent = tmp_path / "workers"
    (parent / "me").mkdir(parents=True)
    (parent / "cgroup.subtree_control").write_text(enabled + "\n")
    return [("/", str(tmp_path), "cgroup2", set())], [_Membership("0", (), "/workers/me")], parent


def test_v2_calls_are_siblings_of_the_callers_cgroup(tmp_path: Path) -> None:
    mounts, memberships, parent = v2_layout(tmp_path, "cpu memory pids")
    tree = cgroups._v2_tree(mounts, memberships)
    assert tree == CgroupV2Tree(parent)
    call = tree.create(memory_bytes=128 << 20, max_tasks=18)
    directory = call.directory  # type: ignore[attr-defined]
    assert directory.parent == parent and directory.name.startswith(f"{CALL_PREFIX}{os.getpid()}-")
    assert (directory / "memory.max").read_text() == str(128 << 20) and (directory / "pids.max").read_text() == "18"
    assert call.join_script() == f"echo $$ > {directory / 'cgroup.procs'}"


def test_v2_says_what_it_lacks(tmp_path: Path) -> None:
    mounts, memberships, parent = v2_layout(tmp_path, "cpu memory")
    assert cgroups._v2_tree(mounts, memberships) == (
        f"cgroup v2: {parent}/cgroup.subtree_control does not enable pids for its children"
    )
    at_root = [_Membership("0", (), "/")]
    assert "sits in the root" in str(cgroups._v2_tree(mounts, at_root))
    assert cgroups._v2_tree([], memberships) == "no cgroup v2 hierarchy is mounted"


def test_v1_calls_are_children_in_each_hierarchy(tmp_path: Path) -> None:
    mounts, memberships = [], []
    for i, controller in enumerate(("memory", "pids", "cpu,cpuacct")):
        point = tmp_path / controller
        (point / "session").mkdir(parents=True)
        mounts.append(("/", str(point), "cgroup", {"rw", *controller.split(",")}))
        memberships.append(_Membership(str(i + 1), tuple(controller.split(",")), "/session"))
    tree = cgroups._v1_tree(mounts, memberships)
    assert tree == CgroupV1Tree(
        tmp_path / "memory/session", tmp_path / "pids/session", tmp_path / "cpu,cpuacct/session"
    )
    call = tree.create(memory_bytes=64 << 20, max_tasks=10)
    assert (call.memory / "memory.limit_in_bytes").read_text() == str(64 << 20)  # type: ignore[attr-defined]
    assert call.join_script().count("echo $$ > ") == 3
    assert cgroups._v1_tree(mounts[:2], memberships[:2]) == "cgroup v1: no cpuacct hierarchy is mounted"


def test_own_directory_inside_a_cgroup_namespace() -> None:
    # A mount whose root is the namespace's: this process's path is read relative to it.
    assert cgroups._own_dir("/", "/sys/fs/cgroup/memory", "/a/b") == Path("/sys/fs/cgroup/memory/a/b")
    assert cgroups._own_dir("/a", "/sys/fs/cgroup/memory", "/a/b") == Path("/sys/fs/cgroup/memory/b")
    with pytest.raises(cgroups.CgroupUnavailable, match="outside the mount"):
        cgroups._own_dir("/a", "/sys/fs/cgroup/memory", "/c")


def test_stale_calls_of_dead_callers_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{CALL_PREFIX}{int(dead.stdout)}-0123456789ab"
    live = tmp_path / f"{CALL_PREFIX}{os.getpid()}-0123456789ab"
    stale.mkdir()
    live.mkdir()
    CgroupV2Tree(tmp_path).remove_stale()
    assert not stale.exists() and live.exists()
