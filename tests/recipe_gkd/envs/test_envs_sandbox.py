"""The python tool's sandbox: each limit hit on purpose in a real child process, and what the model reads."""

from __future__ import annotations

import socket
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from recipe_gkd.envs import sandbox
from recipe_gkd.envs.sandbox import PythonSandbox, PythonTool, SandboxLimits, SandboxUnavailable, namespace_available

# Runs that end by themselves get a generous wall timeout (a child starting Python twice on a loaded 2-core
# machine can take seconds); the runs meant to time out get a short one, which they wait for in full.
LIMITS = SandboxLimits(timeout_s=60.0, memory_mib=256, cpu_s=20, max_output_bytes=1000)
SHORT = SandboxLimits(timeout_s=4.0, memory_mib=256, cpu_s=2, max_output_bytes=1000)
START_SLACK_S = 5.0
needs_namespace = pytest.mark.skipif(not namespace_available(), reason="no unprivileged user namespaces here")


def gone(pid: int) -> bool:
    """The process no longer runs (reaped, or a zombie waiting for its parent: it executes nothing)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def guard_box() -> PythonSandbox:
    return PythonSandbox(LIMITS, network="socket_guard")


@pytest.fixture
def short_box() -> PythonSandbox:
    return PythonSandbox(SHORT, network="socket_guard")


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP port on this machine's loopback that accepts connections (the network the child must not reach)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server.getsockname()[1]
    server.close()


def test_output_and_exit_status(guard_box: PythonSandbox) -> None:
    run = guard_box.run("print(6 * 7)\nprint('é 数')")
    assert (run.output, run.returncode, run.failed) == ("42\né 数\n", 0, False)
    assert run.describe() == "42\né 数\n"
    crashed = guard_box.run("def f():\n    raise ValueError('bad input')\nf()")
    assert crashed.returncode == 1 and crashed.failed
    text = crashed.describe()
    # The traceback names the model's own code, not the sandbox's files.
    assert (
        'File "<tool_code>", line 2, in f' in text and "ValueError: bad input" in text and "sandbox_child" not in text
    )
    assert text.endswith("[exit status 1]")
    assert guard_box.run("import sys; sys.exit(3)").describe() == "[exit status 3]"
    assert guard_box.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)").describe() == "[killed by SIGSEGV]"
    assert guard_box.run("import os\nos.kill(os.getpid(), 40)").describe() == "[killed by signal 40]"
    # Printing the word is not hitting the limit.
    assert guard_box.run("print('MemoryError')\nraise SystemExit(2)").describe() == "MemoryError\n[exit status 2]"


def test_timeout_kills_the_process_and_what_it_started(short_box: PythonSandbox) -> None:
    code = textwrap.dedent(
        """
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(os.getpid(), child.pid, flush=True)
        time.sleep(600)
        """
    )
    start = time.monotonic()
    run = short_box.run(code)
    elapsed = time.monotonic() - start
    assert run.timed_out and run.returncode is None and run.failed
    assert run.describe().endswith(f"[timed out after {SHORT.timeout_s:g} s; the process was killed]")
    assert SHORT.timeout_s <= elapsed < SHORT.timeout_s + START_SLACK_S
    main_pid, started_pid = (int(pid) for pid in run.output.split())
    assert gone(main_pid)  # reaped before run() returned
    # The process it started got the same SIGKILL (its session's); the kernel tears it down moments later.
    deadline = time.monotonic() + sandbox.KILL_WAIT_S
    while not gone(started_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(started_pid)


def test_one_wall_budget_when_the_code_closes_its_output() -> None:
    timeout_s = 5.0
    box = PythonSandbox(SandboxLimits(timeout_s=timeout_s), network="socket_guard")
    start = time.monotonic()
    run = box.run("import os, time\nprint('bye', flush=True)\ntime.sleep(2)\nos.close(1)\nos.close(2)\ntime.sleep(600)")
    elapsed = time.monotonic() - start
    assert run.timed_out and run.output == "bye\n"
    # Reading the output and waiting for the exit share the one timeout: a second full timeout after the
    # output closed (at 2 s and more) would end past timeout_s + 2 s. The 1.5 s covers the kill and clean-up.
    assert timeout_s <= elapsed < timeout_s + 1.5


def test_memory_limit(guard_box: PythonSandbox) -> None:
    limit = LIMITS.memory_mib << 20
    assert guard_box.run(f"x = bytearray({limit // 4}); print(len(x))").output == f"{limit // 4}\n"
    run = guard_box.run(f"x = bytearray({limit})\nprint('allocated')")
    assert "allocated" not in run.output and "MemoryError" in run.output
    assert run.describe().endswith(f"[exit status 1; the memory limit of {LIMITS.memory_mib} MiB was hit]")


def test_cpu_limit() -> None:
    box = PythonSandbox(SandboxLimits(timeout_s=30.0, cpu_s=1), network="socket_guard")
    run = box.run("while True:\n    pass")
    assert not run.timed_out and run.describe() == "[killed by SIGXCPU; the CPU limit of 1 s was hit]"


def test_output_cap(short_box: PythonSandbox) -> None:
    start = time.monotonic()
    run = short_box.run("while True:\n    print('x' * 99)")
    assert run.output_cut and not run.timed_out and len(run.output) == SHORT.max_output_bytes
    assert run.describe().endswith(f"\n[output cut at {SHORT.max_output_bytes} bytes; the process was killed]")
    assert time.monotonic() - start < SHORT.timeout_s  # stopped by the cap, not the clock


def test_file_size_limit(guard_box: PythonSandbox) -> None:
    over = (SandboxLimits().max_file_mib + 1) << 20
    run = guard_box.run(f"open('big.bin', 'wb').write(bytes({over}))\nprint('written')")
    assert "written" not in run.output and "OSError: [Errno 27] File too large" in run.output


def test_scratch_directory_is_removed(guard_box: PythonSandbox, short_box: PythonSandbox) -> None:
    code = (
        "import os, pathlib\npathlib.Path('notes.txt').write_text('kept?')\nprint(os.getcwd())\nprint(os.listdir('.'))"
    )
    run = guard_box.run(code)
    scratch = Path(run.output.splitlines()[0])
    assert "notes.txt" in run.output and scratch.name.startswith("gkd-python-tool-") and not scratch.exists()
    # Also when the run is killed.
    killed = short_box.run("import os, time\nprint(os.getcwd(), flush=True)\ntime.sleep(600)")
    assert killed.timed_out and not Path(killed.output.split()[0]).exists()


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


@needs_namespace
def test_network_namespace_isolates_subprocesses_too(listener: int) -> None:
    box = PythonSandbox(LIMITS, network="namespace")
    run = box.run(CONNECT_FROM_SUBPROCESS.format(port=listener))
    assert "connected" not in run.output and "Network is unreachable" in run.output, run.output
    assert "PermissionError" in box.run("import socket\nsocket.socket()").output  # the guard is on as well


def test_namespace_required_but_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "namespace_available", lambda: False)
    with pytest.raises(SandboxUnavailable, match="network='socket_guard'"):
        PythonSandbox(SHORT, network="namespace")
    with pytest.raises(ValueError, match="network must be"):
        PythonSandbox(SHORT, network="none")  # type: ignore[arg-type]


def test_tool_reports_failures(guard_box: PythonSandbox) -> None:
    tool = PythonTool(guard_box)
    ok = tool({"code": "print(sum(range(10)))"})
    assert (ok.content, ok.failed) == ("45\n", False)
    assert tool({"code": "1/0"}).failed
    bad = tool({"code": ["print(1)"]})
    assert bad.failed and "must be a string" in bad.content
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=0)
