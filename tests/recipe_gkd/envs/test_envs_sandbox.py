"""The python tool's sandbox: each limit hit on purpose in a real call, in both isolations, and what the model reads;
the bwrap isolation refused, naming the key, where the machine cannot give it. (The escapes: test_envs_sandbox_escapes.py.)"""

from __future__ import annotations

import pickle
import socket
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from recipe_gkd.envs import sandbox
from recipe_gkd.envs.cgroups import CgroupUnavailable
from recipe_gkd.envs.sandbox import PythonSandbox, PythonTool, SandboxLimits, SandboxUnavailable, bubblewrap_isolation

# Runs that end by themselves get a generous wall timeout (a child starting Python on a loaded 2-core machine can
# take seconds); the runs meant to time out get a short one, which they wait for in full.
LIMITS = SandboxLimits(timeout_s=60.0, memory_mib=256, cpu_s=20, max_output_bytes=1000)
SHORT = SandboxLimits(timeout_s=4.0, memory_mib=256, cpu_s=2, max_output_bytes=1000)
START_SLACK_S = 5.0
BWRAP_PROBLEM = bubblewrap_isolation()
needs_bwrap = pytest.mark.skipif(
    isinstance(BWRAP_PROBLEM, str), reason=f"the bwrap isolation is unavailable here: {BWRAP_PROBLEM}"
)
ISOLATIONS = [pytest.param("bwrap", marks=needs_bwrap), "socket_guard"]


def gone(pid: int) -> bool:
    """The process no longer runs (reaped, or a zombie waiting for its parent: it executes nothing)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def running_with(marker: str) -> list[int]:
    """Host pids of the live processes whose command line holds `marker`."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if marker in " ".join(proc.info["cmdline"] or ()) and not gone(proc.pid):
            found.append(proc.pid)
    return found


@pytest.fixture(params=ISOLATIONS)
def box(request: pytest.FixtureRequest) -> PythonSandbox:
    return PythonSandbox(LIMITS, tool_isolation=request.param)


@pytest.fixture(params=ISOLATIONS)
def short_box(request: pytest.FixtureRequest) -> PythonSandbox:
    return PythonSandbox(SHORT, tool_isolation=request.param)


@pytest.fixture
def guard_box() -> PythonSandbox:
    return PythonSandbox(LIMITS, tool_isolation="socket_guard")


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP port on this machine's loopback that accepts connections (the network the child must not reach)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server.getsockname()[1]
    server.close()


def test_output_and_exit_status(box: PythonSandbox) -> None:
    run = box.run("print(6 * 7)\nprint('é 数')")
    assert (run.output, run.returncode, run.failed) == ("42\né 数\n", 0, False)
    assert run.describe() == "42\né 数\n"
    crashed = box.run("def f():\n    raise ValueError('bad input')\nf()")
    assert crashed.returncode == 1 and crashed.failed
    text = crashed.describe()
    # The traceback names the model's own code, not the sandbox's files.
    assert (
        'File "<tool_code>", line 2, in f' in text and "ValueError: bad input" in text and "sandbox_child" not in text
    )
    assert text.endswith("[exit status 1]")
    assert box.run("import sys; sys.exit(3)").describe() == "[exit status 3]"
    assert box.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)").describe() == "[killed by SIGSEGV]"
    assert box.run("import os\nos.kill(os.getpid(), 40)").describe() == "[killed by signal 40]"
    # Printing the word is not hitting the limit.
    assert box.run("print('MemoryError')\nraise SystemExit(2)").describe() == "MemoryError\n[exit status 2]"
    assert box.run("pass").describe() == "(no output)"


def test_timeout_kills_the_process_and_what_it_started(short_box: PythonSandbox) -> None:
    marker = f"gkd-test-{uuid.uuid4().hex}"
    code = textwrap.dedent(
        f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "{marker}"])
        print("started", flush=True)
        time.sleep(600)
        """
    )
    start = time.monotonic()
    try:
        run = short_box.run(code)
        elapsed = time.monotonic() - start
        assert run.timed_out and run.returncode is None and run.failed and run.output == "started\n"
        assert run.describe().endswith(f"[timed out after {SHORT.timeout_s:g} s; the process was killed]")
        assert SHORT.timeout_s <= elapsed < SHORT.timeout_s + START_SLACK_S
        # The process it started got the SIGKILL too; the kernel tears it down moments later.
        deadline = time.monotonic() + sandbox.KILL_WAIT_S
        while running_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running_with(marker)
    finally:
        for pid in running_with(marker):
            psutil.Process(pid).kill()


def test_one_wall_budget_when_the_code_closes_its_output() -> None:
    timeout_s = 5.0
    box = PythonSandbox(SandboxLimits(timeout_s=timeout_s), tool_isolation="socket_guard")
    start = time.monotonic()
    run = box.run("import os, time\nprint('bye', flush=True)\ntime.sleep(2)\nos.close(1)\nos.close(2)\ntime.sleep(600)")
    elapsed = time.monotonic() - start
    assert run.timed_out and run.output == "bye\n"
    # Reading the output and waiting for the exit share the one timeout: a second full timeout after the
    # output closed (at 2 s and more) would end past timeout_s + 2 s. The 1.5 s covers the kill and clean-up.
    assert timeout_s <= elapsed < timeout_s + 1.5


def test_memory_limit(box: PythonSandbox) -> None:
    limit = LIMITS.memory_mib << 20
    assert box.run(f"x = bytearray({limit // 4}); print(len(x))").output == f"{limit // 4}\n"
    run = box.run(f"x = bytearray({limit})\nprint('allocated')")
    assert "allocated" not in run.output and "MemoryError" in run.output
    assert run.describe().endswith(f"[exit status 1; the memory limit of {LIMITS.memory_mib} MiB was hit]")
    # The program's objects are dropped before the traceback is printed: a MemoryError with most of the memory
    # still held is reported as well.
    held = box.run(f"held = []\nwhile True:\n    held.append(bytearray({limit // 64}))")
    assert held.describe().endswith(f"[exit status 1; the memory limit of {LIMITS.memory_mib} MiB was hit]")


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_cpu_limit(isolation: str) -> None:
    box = PythonSandbox(SandboxLimits(timeout_s=30.0, cpu_s=1), tool_isolation=isolation)
    run = box.run("while True:\n    pass")
    # One process: its own RLIMIT_CPU ends it (the whole call's check waits WHOLE_CALL_CPU_SLACK_S longer).
    assert not run.timed_out and run.describe() == "[killed by SIGXCPU; the CPU limit of 1 s was hit]"


def test_output_cap(short_box: PythonSandbox) -> None:
    start = time.monotonic()
    run = short_box.run("while True:\n    print('x' * 99)")
    assert run.output_cut and not run.timed_out and len(run.output) == SHORT.max_output_bytes
    assert run.describe().endswith(f"\n[output cut at {SHORT.max_output_bytes} bytes; the process was killed]")
    assert time.monotonic() - start < SHORT.timeout_s  # stopped by the cap, not the clock


def test_file_size_limit(box: PythonSandbox) -> None:
    over = (SandboxLimits().max_file_mib + 1) << 20
    run = box.run(f"open('big.bin', 'wb').write(bytes({over}))\nprint('written')")
    assert "written" not in run.output and "OSError: [Errno 27] File too large" in run.output


def test_socket_guard_scratch_directory_is_removed(guard_box: PythonSandbox) -> None:
    code = (
        "import os, pathlib\npathlib.Path('notes.txt').write_text('kept?')\nprint(os.getcwd())\nprint(os.listdir('.'))"
    )
    run = guard_box.run(code)
    scratch = Path(run.output.splitlines()[0])
    assert "notes.txt" in run.output and scratch.name.startswith("gkd-python-tool-") and not scratch.exists()
    # Also when the run is killed.
    killed = PythonSandbox(SHORT, tool_isolation="socket_guard").run(
        "import os, time\nprint(os.getcwd(), flush=True)\ntime.sleep(600)"
    )
    assert killed.timed_out and not Path(killed.output.split()[0]).exists()


@needs_bwrap
def test_bwrap_keeps_no_file_between_calls() -> None:
    box = PythonSandbox(LIMITS)
    first = box.run("import os\nopen('notes.txt', 'w').write('kept?')\nprint(os.getcwd(), sorted(os.listdir('.')))")
    assert first.output == "/tmp ['notes.txt']\n"
    assert box.run("import os\nprint(sorted(os.listdir('.')), sorted(os.listdir('/dev/shm')))").output == "[] []\n"


@needs_bwrap
def test_calls_side_by_side_each_have_their_own_sandbox() -> None:
    # The rollout runs its conversations' tool calls on threads side by side: each call has its own namespaces,
    # scratch and cgroup. Four programs of 48 MiB under a 64 MiB limit: it is each call's, not one they share.
    from concurrent.futures import ThreadPoolExecutor

    box = PythonSandbox(SandboxLimits(timeout_s=60.0, memory_mib=64))
    code = "import os, time\nopen('mine', 'w').write(str(os.getpid()))\nblock = b'x' * (48 << 20)\ntime.sleep(1)\nprint(os.listdir('.'))"
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(box.run, [code] * 4))
    assert [(run.output, run.returncode) for run in runs] == [("['mine']\n", 0)] * 4


def test_socket_guard_refuses_python_sockets(guard_box: PythonSandbox, listener: int) -> None:
    run = guard_box.run(
        f"import socket\nsocket.create_connection(('127.0.0.1', {listener}), timeout=2)\nprint('connected')"
    )
    assert "connected" not in run.output and "PermissionError: network access is disabled" in run.output
    run = guard_box.run(f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {listener}))\nprint('connected')")
    assert "connected" not in run.output and "PermissionError" in run.output


CONNECT_FROM_SUBPROCESS = """
import subprocess, sys
probe = "import _socket; s = _socket.socket(); s.settimeout(2); s.connect(('127.0.0.1', {port})); print('connected')"
done = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True)
print(done.stdout.strip() or done.stderr.strip().splitlines()[-1])
"""


def test_socket_guard_is_not_isolation(guard_box: PythonSandbox, listener: int) -> None:
    # The documented limit of the guard: a subprocess the code starts still reaches the network.
    assert guard_box.run(CONNECT_FROM_SUBPROCESS.format(port=listener)).output == "connected\n"


@needs_bwrap
def test_bwrap_has_no_network(listener: int) -> None:
    box = PythonSandbox(LIMITS)
    # The call's 127.0.0.1 is its own network namespace's loopback, where nothing listens; no other address exists.
    run = box.run(CONNECT_FROM_SUBPROCESS.format(port=listener))
    assert run.output == "ConnectionRefusedError: [Errno 111] Connection refused\n", run.output
    run = box.run("import socket\nsocket.create_connection(('192.0.2.1', 80), timeout=2)")
    assert "OSError: [Errno 101] Network is unreachable" in run.output, run.output


@needs_bwrap
def test_bwrap_runs_the_standard_library() -> None:
    code = textwrap.dedent(
        """
        import ctypes, decimal, hashlib, json, multiprocessing, sqlite3, ssl, subprocess, sys
        with multiprocessing.Pool(2) as pool:
            squares = pool.map(abs, [-1, -2])
        again = subprocess.run(["python3", "-c", "print(2 ** 10)"], capture_output=True, text=True).stdout
        print(sys.executable, squares, again.strip(), sqlite3.connect(":memory:").execute("select 6 * 7").fetchone())
        """
    )
    binary = f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert PythonSandbox(LIMITS).run(code).output == f"/python/bin/{binary} [1, 2] 1024 (42,)\n"


def refusal() -> SandboxUnavailable:
    """The error building a bwrap sandbox raises once the test broke the machine (the probe runs again)."""
    sandbox.bubblewrap_isolation.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable) as info:
            PythonSandbox(SHORT)
    finally:
        sandbox.bubblewrap_isolation.cache_clear()  # the next sandbox probes the real machine again
    return info.value


def test_bwrap_refused_without_bubblewrap(monkeypatch: pytest.MonkeyPatch) -> None:
    from recipe_gkd.exit_codes import EXIT_BAD_CONFIG, exit_code_for
    from teacher_server.config.errors import ConfigError

    real_which = sandbox.shutil.which
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None if name == "bwrap" else real_which(name))
    err = refusal()
    assert isinstance(err, ConfigError) and err.key == "rollout.tool_isolation"
    assert "bubblewrap is not installed" in str(err) and "apt-get install bubblewrap" in str(err)
    assert "rollout.tool_isolation=socket_guard" in str(err)
    assert exit_code_for(err) == EXIT_BAD_CONFIG  # a run stops with exit 2, from a rollout worker too
    assert str(pickle.loads(pickle.dumps(err))) == str(err)  # it crosses Ray's process boundary whole


def test_bwrap_refused_without_a_cgroup(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_tree() -> None:
        raise CgroupUnavailable("cgroup v1: /sys/fs/cgroup/memory is not writable by this process")

    monkeypatch.setattr(sandbox.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(sandbox, "find_cgroup_tree", no_tree)
    err = refusal()
    assert err.key == "rollout.tool_isolation" and "no cgroup can hold a whole call's memory" in str(err)
    assert "/sys/fs/cgroup/memory is not writable" in str(err)


@needs_bwrap
def test_bwrap_refused_where_namespaces_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    # A kernel refusing the namespaces makes the probe's empty call fail: bwrap's own message is in the error.
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: "/bin/false" if name == "bwrap" else f"/bin/{name}")
    err = refusal()
    assert "an empty call through /bin/false failed" in str(err) and "user namespaces" in str(err)


def test_an_unknown_isolation_is_refused() -> None:
    with pytest.raises(SandboxUnavailable, match="must be one of"):
        PythonSandbox(SHORT, tool_isolation="namespace")


def test_tool_reports_failures(guard_box: PythonSandbox) -> None:
    tool = PythonTool(guard_box)
    ok = tool({"code": "print(sum(range(10)))"})
    assert (ok.content, ok.failed) == ("45\n", False)
    assert tool({"code": "1/0"}).failed
    bad = tool({"code": ["print(1)"]})
    assert bad.failed and "must be a string" in bad.content
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="max_processes"):
        SandboxLimits(max_processes=0)
