"""The run's teachers as one rollout worker uses them: one client per teacher, a step's sequences
routed by their record's teacher, the groups scored concurrently and put back in order.

A run with only `teacher:` has one teacher (`default`) and every sequence goes to it. A teacher's
failure (down, timeout, a refused request, a tokenizer that does not match the student's) is
re-raised as the same error type, tagged with the teacher's name (`err.teacher`) and, with several
teachers, named in its message, so the driver's stop and exit 3 say which teacher to restart.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import numpy as np

from recipe_gkd.config import GKDConfig
from recipe_gkd.config.teachers import record_teacher, teacher_handles, teacher_views
from recipe_gkd.rollout.engine import Scorer
from recipe_gkd.rollout.prompt_join import PromptJoin
from recipe_gkd.teacher_prompt import teacher_prompt_bound
from teacher_server.wire.protocol import TeacherScores

T = TypeVar("T")


class ScoringTarget(Protocol):
    """What the rollout worker calls on the run's target kind (recipe_gkd/targets builds it; the pools hand it down):
    how a teacher is connected, what it is sent, how its reply is unpacked into the kind's payload."""

    def connect(self, view: GKDConfig, tokenizer: Any, address: str | None) -> Scorer: ...

    def teacher_inputs(
        self,
        join: PromptJoin,
        sequences: list[np.ndarray],
        score_from: list[int],
        records: list[dict[str, Any]] | None,
        where: list[str],
    ) -> tuple[list[np.ndarray], list[int], list[dict[str, Any]] | None]: ...

    def score(
        self,
        scorer: Scorer,
        sequences: list[np.ndarray],
        score_from: list[int],
        student_topk: list[np.ndarray | None],
        records: list[dict[str, Any]] | None,
    ) -> list[TeacherScores]: ...

    def payload(self, scored: TeacherScores, teacher: str) -> Any: ...


class TeacherSet:
    """Teacher name -> its scorer; routes records, scores groups concurrently, reassembles in order."""

    def __init__(
        self, cfg: GKDConfig, target: ScoringTarget, scorers: Mapping[str, Scorer], student_tokenizer: Any = None
    ) -> None:
        """`target`: the run's target kind (built once above the worker and handed down): what each request asks for
        and how its reply is unpacked, the same for every teacher."""
        self.cfg = cfg
        self.scorers = dict(scorers)
        # Each teacher's prompt per record: the student's, or its own joined to the response (privileged context).
        self.prompts = {
            name: PromptJoin(h, teacher_prompt_bound(cfg.data), student_tokenizer)
            for name, h in teacher_handles(cfg).items()
        }
        # What each teacher's errors are prefixed with (its name, in a set of several).
        self.prefixes = {name: h.error_prefix for name, h in teacher_handles(cfg).items()}
        self.target = target
        # One thread per teacher: each client is used by one thread at a time (the worker holds its teacher lock).
        self._pool = ThreadPoolExecutor(len(self.scorers), "teacher") if len(self.scorers) > 1 else None

    @classmethod
    def connect(
        cls, cfg: GKDConfig, target: ScoringTarget, tokenizer: Any, addresses: Mapping[str, str] | None
    ) -> TeacherSet:
        """A client per configured teacher (connected by the target kind), each checked against the student's
        tokenizer at connect time.

        `addresses` overrides a teacher's own address (an autostarted server's bound one).
        """
        handles = teacher_handles(cfg)
        scorers: dict[str, Any] = {}
        try:
            for name, view in teacher_views(cfg).items():
                address = (addresses or {}).get(name)
                prefix = handles[name].error_prefix
                scorers[name] = _named(name, prefix, lambda v=view, a=address: target.connect(v, tokenizer, a))
        except BaseException:
            for connected in scorers.values():  # the teachers checked before the one that failed
                connected.close()
            raise
        return cls(cfg, target, scorers, tokenizer)

    def route(self, records: list[dict[str, Any]], where: list[str]) -> list[str]:
        """The teacher of every record (`where[i]`: record i's file and index, for the error on an unknown one)."""
        return [record_teacher(self.cfg, r, w) for r, w in zip(records, where, strict=True)]

    def score(
        self,
        teachers: list[str],
        sequences: list[np.ndarray],
        score_from: list[int],
        student_topk: list[np.ndarray | None],
        records: list[dict[str, Any]] | None = None,
        where: list[str] | None = None,
    ) -> list[TeacherScores]:
        """Sequence i (the student's prompt + response ids, its response from score_from[i]) scored by teacher
        `teachers[i]` as the target kind asks, after that teacher's prompt of records[i] when it has one of its own
        (where[i]: the record, for errors); student_topk[i]: the engine's top ids of sequence i, for
        algorithm.support=union; records[i] also for algorithm.cross_tokenizer. The results in the order of
        `sequences`, one row per response token."""
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(teachers):
            groups.setdefault(name, []).append(i)

        def run(name: str, rows: list[int]) -> list[TeacherScores]:
            scorer = self.scorers[name]
            if self.cfg.debug.teacher_latency_s:  # an emulated remote teacher, on every route (cross-tokenizer too)
                time.sleep(self.cfg.debug.teacher_latency_s)

            def call() -> list[TeacherScores]:
                rows_records = None if records is None else [records[i] for i in rows]
                joined, starts, rows_records = self.target.teacher_inputs(
                    self.prompts[name],
                    [sequences[i] for i in rows],
                    [score_from[i] for i in rows],
                    rows_records,
                    [f"record {i} of this batch" for i in rows] if where is None else [where[i] for i in rows],
                )
                return self.target.score(scorer, joined, starts, [student_topk[i] for i in rows], rows_records)

            return _named(name, self.prefixes.get(name, ""), call)

        if self._pool is None or len(groups) == 1:
            results = {name: run(name, rows) for name, rows in groups.items()}
        else:
            futures = {name: self._pool.submit(run, name, rows) for name, rows in groups.items()}
            results = {name: future.result() for name, future in futures.items()}
        out: list[TeacherScores | None] = [None] * len(sequences)
        for name, rows in groups.items():
            for i, scored in zip(rows, results[name], strict=True):
                out[i] = scored
        assert all(s is not None for s in out)
        return out  # type: ignore[return-value]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for scorer in self.scorers.values():
            close = getattr(scorer, "close", None)
            if close is not None:
                close()


def _named(name: str, prefix: str, call: Callable[[], T]) -> T:
    """`call()`, its error tagged with the teacher `name` and its message prefixed with `prefix` (the teacher's
    TeacherHandle.error_prefix: its name in a set of several)."""
    try:
        return call()
    except Exception as err:
        err.teacher = name  # type: ignore[attr-defined]  # survives pickling (BaseException keeps __dict__)
        if prefix and err.args and isinstance(err.args[0], str):
            err.args = (f"{prefix}{err.args[0]}", *err.args[1:])
        raise
