"""algorithm.support=union: the teacher's top-k and the student's own top-k_s ids, one set of K + k_s columns.

The request also names, at every scored position, the student's own top-k_s ids (rollout.student_top_k, returned
by the rollout engine with the sample). The server answers from the same forward with the teacher's logprobs at
those ids and the log of its mass outside the top-k and those ids together. `union_scores` merges both into
K + k_s columns (a student id the teacher's top-k already holds becomes EXCLUDED_ID at -inf) whose tail is that
exact rest, so the loss compares the two distributions over a partition of the vocabulary: the teacher's ids, the
student's ids, and one bucket for everything else (the actor computes the student's from its full logits). The
actor's loss is the top-k one over those columns.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from recipe_gkd.batch import EXCLUDED_ID
from recipe_gkd.rollout.engine import Scorer
from recipe_gkd.targets.topk import TopK
from teacher_server.wire.protocol import TeacherScores
from teacher_server.wire.scores import repeated_named


class UnionSupport(TopK):
    """The teacher's top-k together with the student's top-k_s ids (algorithm.support=union)."""

    name: ClassVar[str] = "union"

    def score(
        self,
        scorer: Scorer,
        sequences: list[np.ndarray],
        score_from: list[int],
        student_topk: list[np.ndarray | None],
        records: list[dict[str, Any]] | None,
    ) -> list[TeacherScores]:
        named = [
            self._named_ids(seq, start, ids)
            for seq, start, ids in zip(sequences, score_from, student_topk, strict=True)
        ]
        replies = scorer.score(sequences, score_from, named_ids=named)
        return [union_scores(reply, ids) for reply, ids in zip(replies, named, strict=True)]

    def _named_ids(self, sequence: np.ndarray, start: int, student_ids: np.ndarray | None) -> np.ndarray:
        expected = (len(sequence) - start, self.cfg.rollout.student_top_k)
        if student_ids is None:
            raise ValueError(
                "algorithm.support=union needs the student's top-k at every response position; a response without "
                "them was not sampled by the student (algorithm.lmbda must be 1)"
            )
        if student_ids.shape != expected:
            raise ValueError(
                f"the rollout engine returned student top-k ids of shape {student_ids.shape}, expected {expected} "
                "(response tokens x rollout.student_top_k)"
            )
        return np.ascontiguousarray(student_ids, dtype=np.int32)


def union_scores(reply: TeacherScores, named_ids_NS: np.ndarray) -> TeacherScores:
    """The teacher's top-k and the named (student) ids as one set of K + k_s columns.

    A named id the top-k (or an earlier named column) already holds becomes EXCLUDED_ID at -inf:
    each id is one outcome. The tail is the server's mass outside all of them.
    """
    if reply.named_logprobs is None or reply.other_logmass is None:
        raise ValueError("the teacher's reply carries no logprobs at the named ids (a server without the feature?)")
    named_NS = named_ids_NS.astype(np.int64)
    repeated_NS = repeated_named(reply.topk_ids.astype(np.int64), named_NS)
    ids = np.concatenate([reply.topk_ids, np.where(repeated_NS, EXCLUDED_ID, named_NS).astype(np.int32)], axis=1)
    logprobs = np.concatenate(
        [reply.topk_logprobs, np.where(repeated_NS, -np.inf, reply.named_logprobs).astype(reply.named_logprobs.dtype)],
        axis=1,
    )
    return TeacherScores(logprobs, ids, reply.sampled_logprob, reply.other_logmass)
