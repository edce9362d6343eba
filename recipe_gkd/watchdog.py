"""Hang watchdog: when a phase exceeds debug.hang_timeout_s, every worker's Python stack goes to disk.

At launch each worker registers `faulthandler` on SIGUSR1 (through Ray's `__ray_call__`, so the
worker classes stay plain). faulthandler's handler is C code: it dumps every thread even while
the worker's main thread is blocked inside a C call (a collective, a socket read), where a
Python-level signal handler would never run. On a timeout the driver signals every worker, adds
`py-spy dump` output when py-spy is installed, and writes one file per worker (and the driver's
own stack) into <run_dir>/hang_<phase>_<time>/. A worker whose stack is inside this project's
code is reported as stuck, with its innermost frame.
"""

from __future__ import annotations

import faulthandler
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

DUMP_SIGNAL = signal.SIGUSR1
STACKS_DIR = ".stacks"
# How long the driver waits for every worker's dump to land (they are written synchronously).
DUMP_WAIT_S = 3.0
PY_SPY_TIMEOUT_S = 20.0
OUR_CODE = re.compile(r'File "([^"]*/(?:recipe_gkd|teacher_server)/[^"]+)", line (\d+) in (\S+)')

# The worker keeps its dump file open: faulthandler writes to the descriptor from the signal handler.
_dump_file: TextIO | None = None


def register_stack_dump(_worker: Any, path: str) -> int:
    """In a worker (via `__ray_call__`): dump all threads' stacks to `path` on DUMP_SIGNAL. Returns the pid."""
    global _dump_file
    if _dump_file is not None:
        _dump_file.close()
    # Not a `with`: the file must stay open for the life of the process.
    _dump_file = open(path, "w")
    faulthandler.register(DUMP_SIGNAL, file=_dump_file, all_threads=True)
    return os.getpid()


@dataclass
class Watchdog:
    """The driver's view: where stacks go and which process each worker is."""

    run_dir: Path
    pids: dict[str, int] = field(default_factory=dict)  # worker name -> pid

    def stack_file(self, name: str) -> Path:
        return self.run_dir / STACKS_DIR / f"{name}.txt"

    def dump(self, phase: str) -> tuple[Path, dict[str, str]]:
        """Every worker's stack into hang_<phase>_<time>/; returns the directory and the stuck workers.

        A worker is stuck when its stack is inside recipe_gkd / teacher_server code; the value
        names its innermost such frame.
        """
        slug = re.sub(r"[^A-Za-z0-9]+", "_", phase).strip("_")
        out = self.run_dir / f"hang_{slug}_{time.strftime('%Y%m%d_%H%M%S')}"
        out.mkdir(parents=True, exist_ok=True)
        before = {n: self._size(n) for n in self.pids}
        missing = {}
        for name, pid in self.pids.items():
            try:
                os.kill(pid, DUMP_SIGNAL)
            except (ProcessLookupError, PermissionError) as err:
                # Gone, or on another node (the driver signals local processes only).
                missing[name] = f"process {pid} not reachable from the driver: {type(err).__name__}"
        self._wait_for_dumps(before, set(missing))
        stuck: dict[str, str] = {}
        for name in self.pids:
            text = missing.get(name) or self._read_from(name, before[name])
            text += _py_spy(self.pids[name])
            (out / f"{name}.txt").write_text(text)
            frame = _innermost_own_frame(text)
            if frame:
                stuck[name] = frame
        with (out / "driver.txt").open("w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        return out, stuck

    def _size(self, name: str) -> int:
        path = self.stack_file(name)
        return path.stat().st_size if path.is_file() else 0

    def _wait_for_dumps(self, before: dict[str, int], skip: set[str]) -> None:
        deadline = time.monotonic() + DUMP_WAIT_S
        waiting = set(before) - skip
        while waiting and time.monotonic() < deadline:
            waiting = {n for n in waiting if self._size(n) <= before[n]}
            time.sleep(0.1)
        time.sleep(0.2)  # a dump in progress finishes writing

    def _read_from(self, name: str, offset: int) -> str:
        path = self.stack_file(name)
        if not path.is_file():
            return "no stack file: the worker never registered its dump handler\n"
        with path.open() as f:
            f.seek(offset)
            return f.read() or f"no stack written within {DUMP_WAIT_S}s of {DUMP_SIGNAL.name}\n"


def install(handles: dict[str, Any], run_dir: str | Path, timeout_s: float) -> Watchdog:
    """Register the stack dump in every worker (`handles`: name -> Ray actor handle)."""
    import ray

    watchdog = Watchdog(Path(run_dir).resolve())
    (watchdog.run_dir / STACKS_DIR).mkdir(parents=True, exist_ok=True)
    names = list(handles)
    calls = [handles[n].__ray_call__.remote(register_stack_dump, str(watchdog.stack_file(n))) for n in names]
    watchdog.pids = dict(zip(names, ray.get(calls, timeout=timeout_s), strict=True))
    return watchdog


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
