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
from types import FrameType

# 128 + SIGTERM: what a shell reports for a process ended by SIGTERM, and what slurm records.
EXIT_TERMINATED = 128 + signal.SIGTERM


class RunTerminated(BaseException):
    """SIGTERM reached the driver. A BaseException, as KeyboardInterrupt: no `except Exception` of the run's
    recovery paths (a teacher retry, a report that tolerates a failure) may swallow it."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    # A second SIGTERM (slurm repeats it, a user presses twice) must not cut the cleanup of the first short;
    # what stops a hung cleanup is SIGKILL (slurm sends it after KillWait).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise RunTerminated


def stop_on_sigterm() -> None:
    """From now on SIGTERM raises RunTerminated in the main thread. Call it at the start of a run and again
    right after ray.init (which installs its own handlers)."""
    signal.signal(signal.SIGTERM, _raise_terminated)
