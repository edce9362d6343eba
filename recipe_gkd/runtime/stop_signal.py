"""SIGTERM (what slurm's scancel and a plain `kill` send) stops a run through its normal cleanup.

`ray.init` takes SIGTERM from the driver: Ray 2.60.0's python/ray/_private/worker.py `init` sets
`sys.exit(signum)` as the handler, then the core worker it connects installs its C++ failure-signal handler
(src/ray/util/logging.cc, `RayLog::InstallFailureSignalHandler`, on by `install_failure_signal_handler`), which
prints "SIGTERM received" with a stack and ends the process with 15, past every `finally` of the run.
`stop_on_sigterm()` puts the Python handler back (signal.signal replaces the process-wide handler): it raises
RunTerminated in the main thread, which unwinds through the run's `with` blocks (the pools, Ray, the autostarted
teacher) like any error; the driver then says so in one line and exits EXIT_TERMINATED.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

Handler = Callable[[int, FrameType | None], Any] | int | None

# 128 + SIGTERM: what a shell reports for a process ended by SIGTERM, and what slurm records.
EXIT_TERMINATED = 128 + signal.SIGTERM


class RunTerminated(BaseException):
    """SIGTERM reached the driver. A BaseException, as KeyboardInterrupt: no `except Exception` of the run's
    recovery paths (a teacher retry, a report that tolerates a failure) may swallow it."""


_terminating = threading.Event()


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    # A second SIGTERM (slurm repeats it, a user presses twice) must not cut the cleanup of the first short;
    # what stops a hung cleanup is SIGKILL (slurm sends it after KillWait).
    _terminating.set()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise RunTerminated


def stop_on_sigterm() -> None:
    """From now on SIGTERM raises RunTerminated in the main thread. Call it at the start of a run and again
    right after ray.init (which installs its own handlers). Only the main thread may set a handler (as Ray's own
    `init` does, it is left alone elsewhere: a run driven from another thread keeps the handler it had)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


def current_sigterm_handler() -> Handler:
    """The SIGTERM handler Python knows now, to put back with restore_sigterm once the run's Ray is shut down."""
    return signal.getsignal(signal.SIGTERM)


def restore_sigterm(handler: Handler) -> None:
    """Put back `handler` (from current_sigterm_handler); None (set outside Python) is left as it is, and so is the
    ignored SIGTERM of a run already stopping (the rest of its cleanup runs to the end)."""
    if _terminating.is_set():
        return
    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
