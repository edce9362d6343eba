"""Hang watchdog: when a phase exceeds its time, every worker's Python stack goes to disk.

The pools' waits (recipe_gkd/runtime/ray_pools.py `wait` / `wait_done`) are the driver's only blocking
calls on workers: each has a timeout and a phase name; a timeout raises `phase_timeout(...)`, a
PhaseTimeoutError naming the phase and the key to raise, after the installed watchdog (`install`,
for the running launch) has dumped every worker's stack.

At launch each worker registers `faulthandler` on SIGUSR1 (the Ray pool calls
`register_stack_dump` inside each worker, so the worker classes stay plain). faulthandler's handler is C code: it dumps every thread even while
the worker's main thread is blocked inside a C call (a collective, a socket read), where a
Python-level signal handler would never run. On a timeout the driver signals every worker, adds
`py-spy dump` output when py-spy is installed, and writes one file per worker (and the driver's
own stack) into <run_dir>/hang_<phase>_<time>/. A worker whose stack is inside this project's
code is reported as stuck, with its innermost frame.

Workers on other nodes than the driver's write their dumps to that node's temp directory (the
run directory need not be shared); on a timeout the watchdog's `collect_remote` (a Ray task
pinned to each such node) signals them, reads the dumps there and returns the text, so every
stack still lands in the driver's run directory. The driver never signals a pid of another node (it could be a local process).
"""

from __future__ import annotations

import faulthandler
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

DUMP_SIGNAL = signal.SIGUSR1
STACKS_DIR = ".stacks"
# How long the driver waits for every worker's dump to land (they are written synchronously).
DUMP_WAIT_S = 3.0
PY_SPY_TIMEOUT_S = 20.0
# A node's dump task gets this long beyond its own waits before the node is reported unreachable.
REMOTE_SLACK_S = 15.0
OUR_CODE = re.compile(r'File "([^"]*/(?:recipe_gkd|teacher_server)/[^"]+)", line (\d+) in (\S+)')

# The worker keeps its dump file open: faulthandler writes to the descriptor from the signal handler.
_dump_file: TextIO | None = None


def register_stack_dump(name: str, run_dir: str, on_driver_node: bool) -> tuple[int, str]:
    """In a worker: dump all threads' stacks to a file on DUMP_SIGNAL.

    The file is <run_dir>/.stacks/<name>.txt on the driver's node, else in this node's temp
    directory. Returns (pid, file).
    """
    global _dump_file
    if on_driver_node:
        directory = Path(run_dir) / STACKS_DIR
    else:
        directory = Path(tempfile.gettempdir()) / "recipe_gkd_stacks" / re.sub(r"[^A-Za-z0-9]+", "_", run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.txt"
    if _dump_file is not None:
        _dump_file.close()
    # Not a `with`: the file must stay open for the life of the process.
    _dump_file = path.open("w")
    faulthandler.register(DUMP_SIGNAL, file=_dump_file, all_threads=True)
    return os.getpid(), str(path)


@dataclass(frozen=True)
class WorkerProcess:
    pid: int
    node: str  # Ray node id
    stack_file: str  # on that node


def collect_stacks(workers: dict[str, WorkerProcess]) -> dict[str, str]:
    """On the workers' node: signal each, wait for its dump, return what it wrote (+ py-spy's view)."""
    before = {n: _size(w.stack_file) for n, w in workers.items()}
    texts: dict[str, str] = {}
    for name, worker in workers.items():
        try:
            os.kill(worker.pid, DUMP_SIGNAL)
        except (ProcessLookupError, PermissionError) as err:
            texts[name] = f"process {worker.pid} could not be signalled: {type(err).__name__}\n"
    deadline = time.monotonic() + DUMP_WAIT_S
    waiting = set(workers) - set(texts)
    while waiting and time.monotonic() < deadline:
        waiting = {n for n in waiting if _size(workers[n].stack_file) <= before[n]}
        time.sleep(0.1)
    time.sleep(0.2)  # a dump in progress finishes writing
    for name, worker in workers.items():
        text = texts.get(name) or _read_from(worker.stack_file, before[name])
        texts[name] = text + _py_spy(worker.pid)
    return texts


def _size(path: str) -> int:
    return os.path.getsize(path) if os.path.isfile(path) else 0


def _read_from(path: str, offset: int) -> str:
    if not os.path.isfile(path):
        return "no stack file: the worker never registered its dump handler\n"
    with open(path) as f:
        f.seek(offset)
        return f.read() or f"no stack written within {DUMP_WAIT_S}s of {DUMP_SIGNAL.name}\n"


@dataclass
class Watchdog:
    """The driver's view: each worker's process, node and dump file."""

    run_dir: Path
    driver_node: str = ""
    workers: dict[str, WorkerProcess] = field(default_factory=dict)
    # collect_stacks run on another node (node id, its workers) -> texts; never raises.
    collect_remote: Callable[[str, dict[str, WorkerProcess]], dict[str, str]] | None = None

    def dump(self, phase: str) -> tuple[Path, dict[str, str]]:
        """Every worker's stack into hang_<phase>_<time>/; returns the directory and the stuck workers.

        A worker is stuck when its stack is inside recipe_gkd / teacher_server code; the value
        names its innermost such frame.
        """
        slug = re.sub(r"[^A-Za-z0-9]+", "_", phase).strip("_")
        out = self.run_dir / f"hang_{slug}_{time.strftime('%Y%m%d_%H%M%S')}"
        out.mkdir(parents=True, exist_ok=True)
        by_node: dict[str, dict[str, WorkerProcess]] = {}
        for name, worker in self.workers.items():
            by_node.setdefault(worker.node, {})[name] = worker
        texts = collect_stacks(by_node.pop(self.driver_node, {}))
        for node, workers in by_node.items():
            if self.collect_remote is None:
                texts.update(dict.fromkeys(workers, f"stacks of node {node} not collected: no collector\n"))
            else:
                texts.update(self.collect_remote(node, workers))
        stuck: dict[str, str] = {}
        for name in self.workers:
            (out / f"{name}.txt").write_text(texts[name])
            frame = _innermost_own_frame(texts[name])
            if frame:
                stuck[name] = frame
        with (out / "driver.txt").open("w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        return out, stuck


def install(watchdog: Watchdog) -> Watchdog:
    """The running launch's watchdog: phase timeouts dump its workers' stacks."""
    global _installed
    _installed = watchdog
    return watchdog


def uninstall() -> None:
    """The launch is over: a later timeout has no workers to dump."""
    global _installed
    _installed = None


# ----------------------------------------------------------------------------- phase timeouts

# The running launch's watchdog (driver process only): phase timeouts dump the workers' stacks.
_installed: Watchdog | None = None


# The bounds: a phase of a step, and the workers' set-up (model loading, engine start, the weight-sync group).
HANG_KEY = "debug.hang_timeout_s"
SETUP_KEY = "debug.setup_timeout_s"


class PhaseTimeoutError(TimeoutError):
    """A phase did not finish within its bound (debug.hang_timeout_s, or debug.setup_timeout_s for set-up)."""


def phase_timeout(phase: str, timeout_s: float, key: str = HANG_KEY) -> PhaseTimeoutError:
    """The error for a phase over its time (`key`: the bound's config key); first every worker's stack is dumped
    (one line message)."""
    what = "the set-up is" if key == SETUP_KEY else "the step is"
    return PhaseTimeoutError(
        f"phase '{phase}' did not finish within {key}={timeout_s}s{dump_stacks(phase)}; raise {key} if {what} "
        "legitimately this slow"
    )


def dump_stacks(phase: str) -> str:
    """Every worker's stack into the run directory (when workers are running); the message suffix saying where."""
    if _installed is None:
        return ""
    out, stuck = _installed.dump(phase)
    where = ", ".join(f"{name} at {frame}" for name, frame in stuck.items()) or "no worker in project code"
    return f"; stuck: {where}; every worker's stack is in {out}"


def _innermost_own_frame(text: str) -> str:
    """The first (innermost) project frame of the first thread that has one, as 'file:line in function'."""
    match = OUR_CODE.search(text)
    if not match:
        return ""
    path, line, function = match.groups()
    short = path.split("/recipe_gkd/")[-1] if "/recipe_gkd/" in path else path.split("/teacher_server/")[-1]
    return f"{short}:{line} in {function}"


def _py_spy(pid: int) -> str:
    exe = shutil.which("py-spy")
    if exe is None:
        return ""
    try:
        proc = subprocess.run(
            [exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return "\n--- py-spy dump timed out\n"
    return f"\n--- py-spy dump (rc {proc.returncode})\n{proc.stdout}{proc.stderr}"
