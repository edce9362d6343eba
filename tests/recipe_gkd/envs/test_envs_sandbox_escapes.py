"""The python tool tried as an attacker would (issue 57): each escape sent as the student sends it, one hermes tool
call through `build_environment("python")` with its defaults, and refused or contained. Each of these ran against
the sandbox before bubblewrap (user + network namespace, rlimits per process) and failed there, except the ptrace
one, which the user namespace alone already refused."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from repo_paths import REPO_ROOT

from recipe_gkd.envs import build_environment
from recipe_gkd.envs import sandbox as sandbox_module

BWRAP = sandbox_module.bubblewrap_isolation() if hasattr(sandbox_module, "bubblewrap_isolation") else None
pytestmark = pytest.mark.skipif(
    isinstance(BWRAP, str), reason=f"the python tool's default isolation is unavailable here: {BWRAP}"
)
# Calls that end by themselves: a wall time they never reach on a loaded 2-core machine.
TIMEOUT_S = 30.0
CHILD_SCRIPT = Path(sandbox_module.__file__).with_name("sandbox_child.py")
# How long the kernel may take to tear down a killed process the test looks for.
TEARDOWN_S = 5.0


def tool_call(code: str) -> dict[str, str]:
    """The assistant turn calling the python tool, as Qwen's chat template writes it (hermes)."""
    body = json.dumps({"name": "python", "arguments": {"code": code}})
    return {"role": "assistant", "content": f"<tool_call>\n{body}\n</tool_call>"}


def observe(code: str, **options: Any) -> tuple[str, bool]:
    """(the tool message the student reads, whether the call counted as failed) for one call of `code`."""
    env = build_environment("python", tool_timeout_s=TIMEOUT_S, **options)
    env.reset({"prompt": "probe", "answer": "0"})
    step = env.step(tool_call(code))
    return step.observations[0]["content"], step.tool_failures == 1


def running_with(marker: str) -> list[psutil.Process]:
    """The live processes (zombies excluded) whose command line holds `marker`, anywhere on the machine."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if marker in " ".join(proc.info["cmdline"] or ()) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


@pytest.fixture
def marker() -> Iterator[str]:
    """A unique word in the command line of every sleeper a test's code starts; the fixture kills any left."""
    word = f"gkd-escape-{uuid.uuid4().hex}"
    yield word
    for proc in running_with(word):
        proc.kill()


def sleeper(marker: str) -> str:
    """The argv (as Python source) of a process that sleeps a minute and carries `marker`."""
    return f'[sys.executable, "-c", "import time; time.sleep(60)", "{marker}"]'


def test_reads_nothing_outside(tmp_path: Path) -> None:
    secret = tmp_path / "teacher_secret"  # as a teacher's secret_file would be, by its path
    secret.write_text("s3cret")
    code = textwrap.dedent(
        f"""
        import os
        for path in ("/etc/passwd", {str(Path(__file__).resolve())!r}, {str(secret)!r}, {str(Path.home())!r}, "/work"):
            try:
                print(os.listdir(path) if os.path.isdir(path) else open(path).read()[:20])
            except OSError as err:
                print(type(err).__name__)
        try:
            import recipe_gkd
            print("imported the repository")
        except ImportError as err:
            print(type(err).__name__)
        """
    )
    text, _ = observe(code)
    assert text.split("\n")[:6] == ["FileNotFoundError"] * 5 + ["ModuleNotFoundError"], text


def test_writes_nothing_outside_its_scratch(tmp_path: Path) -> None:
    planted = tmp_path / "planted"
    before = hashlib.sha256(CHILD_SCRIPT.read_bytes()).hexdigest()
    # Opened for appending and closed: an existing file is never changed, even where the open succeeds. The names
    # are the test's own, removed after: a sandbox that fails this test leaves nothing on the host either.
    word = uuid.uuid4().hex
    host_roots = [f"/planted-{word}", f"/dev/planted-{word}"]
    targets = [str(CHILD_SCRIPT), "/sandbox/child.py", str(planted), *host_roots, f"/python/planted-{word}"]
    code = textwrap.dedent(
        f"""
        import os
        for path in {targets!r}:
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
                print("writable", path)
            except OSError as err:
                print(type(err).__name__)
        """
    )
    try:
        text, _ = observe(code)
    finally:
        for path in host_roots:
            Path(path).unlink(missing_ok=True)
    assert "writable" not in text, text
    assert not planted.exists() and hashlib.sha256(CHILD_SCRIPT.read_bytes()).hexdigest() == before


def test_the_scratch_has_a_size() -> None:
    # 1 MiB blocks, then 1-byte files (each takes a page): both stop at the scratch's size (64 MiB by default).
    code = textwrap.dedent(
        """
        import os
        for size, count in ((1 << 20, 200), (1, 40000)):
            n = 0
            try:
                while n < count:
                    with open(f"f{size}-{n}", "wb") as f:
                        f.write(bytes(size))
                    n += 1
                print("all", n, "written")
            except OSError as err:
                print(err.strerror, "after", n)
            for name in os.listdir("."):
                os.remove(name)
        """
    )
    text, _ = observe(code)
    lines = text.splitlines()
    assert lines[0].startswith("No space left on device after 6") and int(lines[0].split()[-1]) <= 64, text
    assert lines[1].startswith("No space left on device after") and int(lines[1].split()[-1]) <= 16384, text


def test_a_huge_number_of_empty_files_is_bounded_by_the_calls_memory() -> None:
    # Empty files take no page of the scratch, but an inode and a dentry each: kernel memory, charged to the call.
    code = textwrap.dedent(
        """
        import os
        n = 0
        while n < 300_000:
            os.close(os.open(f"e{n}", os.O_CREAT | os.O_WRONLY))
            n += 1
        print("made", n)
        """
    )
    text, failed = observe(code, memory_mib=96)
    assert failed and text == "[killed by SIGKILL; the memory limit of 96 MiB was hit]", text


def test_nothing_outlives_the_call(marker: str) -> None:
    # A double-forked daemon in its own session, a Popen in a new session, then the program closes its output and
    # exits 0: the call returns cleanly, and nothing of it is left when it does.
    code = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, {sleeper(marker)})
            os._exit(0)
        os.wait()
        subprocess.Popen({sleeper(marker)}, start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        def sleepers():
            found = 0
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    found += b"{marker}" in open(f"/proc/{{pid}}/cmdline", "rb").read()
                except OSError:
                    pass
            return found
        while sleepers() < 2:
            time.sleep(0.01)
        print("both sleeping", flush=True)
        os.close(1)
        os.close(2)
        """
    )
    text, failed = observe(code)
    assert (text, failed) == ("both sleeping\n", False)
    assert running_with(marker) == []  # gone when the call returned, not moments later


def test_memory_is_limited_for_the_whole_call() -> None:
    # Three processes of 60 MiB each: every one is under the 128 MiB a process may map, together they are not.
    code = textwrap.dedent(
        """
        import os
        read_end, write_end = os.pipe()
        children = []
        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                os.close(write_end)
                block = b"x" * (60 << 20)  # written, so resident
                os.read(read_end, 1)  # held until the parent has its own block too
                os._exit(0)
            children.append(pid)
        block = b"x" * (60 << 20)
        os.close(write_end)
        statuses = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
        print("all held" if statuses == [0, 0] else f"children ended {statuses}")
        """
    )
    text, _ = observe(code, memory_mib=128)
    assert "all held" not in text and "the memory limit of 128 MiB was hit" in text, text


def test_processes_are_limited_for_the_whole_call() -> None:
    code = textwrap.dedent(
        """
        import os
        read_end, write_end = os.pipe()
        n = 0
        try:
            while n < 50:
                if os.fork() == 0:
                    os.close(write_end)
                    os.read(read_end, 1)  # alive until the parent exits
                    os._exit(0)
                n += 1
            print("forked", n)
        except OSError as err:
            print("refused after", n, type(err).__name__)
        """
    )
    text, _ = observe(code)
    assert text.startswith("refused after ") and "BlockingIOError" in text, text
    assert int(text.split()[2]) < 16 and text.endswith("[the limit of 16 processes and threads was hit]"), text


def test_cpu_is_limited_for_the_whole_call() -> None:
    # Three processes of 0.9 CPU seconds each: every one is under its own 1 s, together they are not.
    code = textwrap.dedent(
        """
        import os, time
        children = []
        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                while time.process_time() < 0.9:
                    pass
                os._exit(0)
            children.append(pid)
        while time.process_time() < 0.9:
            pass
        for pid in children:
            os.waitpid(pid, 0)
        print("all burned")
        """
    )
    text, failed = observe(code, cpu_s=1)
    assert failed and text == "[the CPU limit of 1 s for all its processes was hit; they were killed]", text


@pytest.fixture
def unix_listeners() -> Iterator[tuple[str, str]]:
    """A filesystem unix socket under the host's /tmp (as Ray's session sockets are) and an abstract one."""
    directory = tempfile.mkdtemp(prefix="gkd-sock-")  # short: a socket path has 107 bytes at most
    path, abstract = os.path.join(directory, "s"), f"\0gkd-escape-{uuid.uuid4().hex}"
    servers = []
    for address in (path, abstract):
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(address)
        server.listen(4)
        servers.append(server)
    yield path, abstract
    for server in servers:
        server.close()
    os.remove(path)
    os.rmdir(directory)


def test_no_unix_socket_outside_is_reachable(unix_listeners: tuple[str, str]) -> None:
    code = textwrap.dedent(
        f"""
        import _socket  # below the socket guard, as a determined program would go
        for address in {list(unix_listeners)!r}:
            s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            try:
                s.connect(address)
                print("connected")
            except OSError as err:
                print(type(err).__name__)
        """
    )
    text, _ = observe(code)
    assert text.splitlines() == ["FileNotFoundError", "ConnectionRefusedError"], text


CALLER = """
import json, os, sys
from recipe_gkd.envs import build_environment
env = build_environment("python", tool_timeout_s=float(sys.argv[1]))
env.reset({"prompt": "probe", "answer": "0"})
code = sys.stdin.read().replace("CALLER_PID", str(os.getpid()))
body = json.dumps({"name": "python", "arguments": {"code": code}})
step = env.step({"role": "assistant", "content": "<tool_call>\\n" + body + "\\n</tool_call>"})
print(json.dumps(step.observations[0]["content"]), flush=True)
"""


def caller(code: str, timeout_s: float = TIMEOUT_S) -> subprocess.Popen[str]:
    """A process that plays the rollout worker: it builds the python environment and sends `code` in one call
    (CALLER_PID in it is replaced by the caller's pid); it prints the observation as JSON. The code goes through
    its stdin: in its command line, a marker in the code would make the caller look like the call's sleeper."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CALLER, str(timeout_s)],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None
    proc.stdin.write(code)
    proc.stdin.close()
    return proc


def test_the_caller_cannot_be_signalled() -> None:
    code = textwrap.dedent(
        """
        import os, signal
        for pid in (os.getppid(), CALLER_PID):
            try:
                os.kill(pid, signal.SIGKILL)
                print("sent")
            except OSError as err:
                print(type(err).__name__)
        """
    )
    proc = caller(code)
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.wait(timeout=TIMEOUT_S + 30)
    # The program's parent is the sandbox's own init (which ignores it); the caller's pid names nothing in there.
    assert proc.returncode == 0 and json.loads(out) == "sent\nProcessLookupError\n", (proc.returncode, out)


def test_a_killed_caller_leaves_nothing(marker: str) -> None:
    code = textwrap.dedent(
        f"""
        import subprocess, sys, time
        open("{marker}", "w").write("scratch")
        subprocess.Popen({sleeper(marker)})
        time.sleep(30)
        """
    )
    proc = caller(code)
    deadline = time.monotonic() + TIMEOUT_S
    while not running_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running_with(marker), "the call's sleeper never started"
    proc.send_signal(signal.SIGKILL)  # the rollout worker dies mid-call
    proc.wait(timeout=TEARDOWN_S)
    assert proc.stdout is not None
    proc.stdout.close()
    deadline = time.monotonic() + TEARDOWN_S
    while running_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running_with(marker) == []
    assert list(Path(tempfile.gettempdir()).glob(f"gkd-python-tool-*/{marker}")) == []  # no scratch on the host
    # The call's cgroup outlived its caller (empty); the next process to build a sandbox removes it.
    from recipe_gkd.envs.cgroups import CALL_PREFIX, find_cgroup_tree

    tree = find_cgroup_tree()
    tree.remove_stale()
    parents = [getattr(tree, name) for name in ("memory", "pids", "cpuacct", "parent") if hasattr(tree, name)]
    assert [p for parent in parents for p in parent.glob(f"{CALL_PREFIX}{proc.pid}-*")] == []


def test_other_processes_are_invisible() -> None:
    code = textwrap.dedent(
        f"""
        import os
        pids = [pid for pid in os.listdir("/proc") if pid.isdigit()]
        lines = []
        for pid in pids:
            try:
                lines.append(open(f"/proc/{{pid}}/cmdline", "rb").read())
            except OSError:
                pass
        print(len(pids), any(b"pytest" in line for line in lines))
        try:
            print(open("/proc/{os.getpid()}/environ", "rb").read()[:20])
        except OSError as err:
            print(type(err).__name__)
        """
    )
    text, _ = observe(code)
    count, saw_pytest = text.splitlines()[0].split()
    assert int(count) <= 3 and saw_pytest == "False" and text.splitlines()[1] == "FileNotFoundError", text


def test_ptrace_reaches_no_process_outside() -> None:
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        code = textwrap.dedent(
            f"""
            import ctypes, os
            libc = ctypes.CDLL(None, use_errno=True)
            PTRACE_ATTACH = 16
            print(libc.ptrace(PTRACE_ATTACH, {target.pid}, None, None), os.strerror(ctypes.get_errno()))
            try:
                open("/proc/{target.pid}/mem", "rb")
                print("opened its memory")
            except OSError as err:
                print(type(err).__name__)
            """
        )
        text, _ = observe(code)
        assert text.startswith("-1 ") and "opened" not in text, text
        assert psutil.Process(target.pid).status() != psutil.STATUS_TRACING_STOP
    finally:
        target.kill()
        target.wait()


def test_symlinks_lead_nowhere_outside(tmp_path: Path) -> None:
    secret = tmp_path / "teacher_secret"
    secret.write_text("s3cret")
    targets = ["/etc/passwd", str(Path(__file__).resolve()), str(secret), "/proc/1/root/etc/passwd", "../../etc/hosts"]
    code = textwrap.dedent(
        f"""
        import os
        for target in {targets!r}:
            os.symlink(target, "link")
            try:
                print(open("link").read()[:20])
            except OSError as err:
                print(type(err).__name__)
            os.remove("link")
        """
    )
    text, _ = observe(code)
    assert all(line.endswith("Error") for line in text.splitlines()) and len(text.splitlines()) == 5, text


def test_kernel_keyrings_are_out_of_reach() -> None:
    # The keyrings are not namespaced: the call would hold its caller's session keyring and, as a root caller's uid,
    # read root's keys by id. The seccomp filter refuses the key system calls.
    keyctl = {"x86_64": 250, "aarch64": 219}[os.uname().machine]
    code = textwrap.dedent(
        f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING = 0, -3, -4
        for keyring in (KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING):
            found = libc.syscall({keyctl}, KEYCTL_GET_KEYRING_ID, keyring, 0)
            print(found if found >= 0 else os.strerror(ctypes.get_errno()))
        """
    )
    text, _ = observe(code)
    assert text.splitlines() == ["Operation not permitted"] * 2, text
