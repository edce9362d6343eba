"""recipe_gkd/rollout/engine_thread.py: calls from several threads run on the engine's one thread, one at a time."""

from __future__ import annotations

import threading
import time

import pytest

from recipe_gkd.rollout.engine_thread import EngineThread


def test_calls_from_two_threads_run_on_one_thread_one_at_a_time() -> None:
    engine = EngineThread("test-engine")
    seen: list[int] = []
    inside = [0]
    overlap = [False]

    def call() -> int:
        inside[0] += 1
        overlap[0] |= inside[0] > 1
        time.sleep(0.05)
        seen.append(threading.get_ident())
        inside[0] -= 1
        return threading.get_ident()

    callers = [threading.Thread(target=lambda: [engine.run(call) for _ in range(3)]) for _ in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=10)
    assert set(seen) == {engine.ident} and len(seen) == 6 and not overlap[0]
    assert engine.ident not in {t.ident for t in callers} | {threading.get_ident()}
    # A call made on the engine's own thread (a callback) runs there directly instead of waiting on itself.
    assert engine.run(lambda: engine.run(threading.get_ident)) == engine.ident


def test_an_error_reaches_the_caller() -> None:
    def fail() -> None:
        raise ValueError("from the engine thread")

    with pytest.raises(ValueError, match="from the engine thread"):
        EngineThread("test-engine").run(fail)
