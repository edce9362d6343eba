"""One thread of its own for every call into an in-process engine.

A rollout worker serves two calls at once (ray_pools: `max_concurrency=2`, so two_step_off scores
batch t+1 beside generating t+2), each on a thread of Ray's. torch's current CUDA stream is per
thread, and vLLM's model runner takes streams when it is built and at run time (its async output
copies); an engine driven from two threads could race its sampled-token copies across streams.
Everything that touches the engine (its construction included) runs on one thread, one call at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class EngineThread:
    """A single worker thread: `run(fn, ...)` calls fn there and returns its result (or raises its error)."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.ident = self._pool.submit(threading.get_ident).result()

    def run(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        if threading.get_ident() == self.ident:  # a call made from the engine's own thread (a callback)
            return fn(*args, **kwargs)
        return self._pool.submit(fn, *args, **kwargs).result()
