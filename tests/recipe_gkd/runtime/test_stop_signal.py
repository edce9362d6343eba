"""SIGTERM in the driver: RunTerminated in the main thread, once; the handler a caller had comes back."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from recipe_gkd.runtime import stop_signal
from recipe_gkd.runtime.stop_signal import (
    EXIT_TERMINATED,
    RunTerminated,
    current_sigterm_handler,
    restore_sigterm,
    stop_on_sigterm,
)


@pytest.fixture()
def own_handler(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """This test's SIGTERM handler, put back afterwards; the module's `terminating` flag fresh."""
    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(stop_signal, "_terminating", type(stop_signal._terminating)())
    seen: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    yield seen
    signal.signal(signal.SIGTERM, before)


def _deliver_sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # the handler runs in the main thread at the next bytecode boundary


def test_sigterm_raises_once_and_a_second_is_ignored_during_cleanup(own_handler: list[int]) -> None:
    assert EXIT_TERMINATED == 143
    saved = current_sigterm_handler()
    stop_on_sigterm()
    with pytest.raises(RunTerminated):
        _deliver_sigterm()
    _deliver_sigterm()  # the cleanup's second SIGTERM: ignored, nothing raised
    restore_sigterm(saved)  # a run already stopping keeps SIGTERM ignored
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN and own_handler == []


def test_a_run_that_ends_normally_gives_back_the_callers_handler(own_handler: list[int]) -> None:
    saved = current_sigterm_handler()
    stop_on_sigterm()
    restore_sigterm(saved)
    _deliver_sigterm()
    assert own_handler == [signal.SIGTERM]


def test_run_terminated_is_not_caught_by_except_exception() -> None:
    assert not issubclass(RunTerminated, Exception) and issubclass(RunTerminated, BaseException)
