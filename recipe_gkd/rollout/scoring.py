"""The scoring plan: what the rollout worker asks the teacher for, chosen once from the config.

- ``teacher_topk`` (algorithm.support): the teacher's top-k, its exact tail and the sampled
  token's logprob, one request per step as always.
- ``union``: the request also names, at every scored position, the student's own top-k_s ids
  (rollout.student_top_k, returned by the rollout engine with the sample). The server answers
  from the same forward with the teacher's logprobs at those ids and the log of its mass outside
  the top-k and those ids together. The plan merges both into K + k_s columns (a student id the
  teacher's top-k already holds becomes EXCLUDED_ID at -inf) whose tail is that exact rest, so
  the loss compares the two distributions over a partition of the vocabulary: the teacher's ids,
  the student's ids, and one bucket for everything else (the actor computes the student's from
  its full logits).

- ``teacher.output=hidden``: the client asks for each scored position's final hidden state (and no
  top-k; see TeacherClient.from_config); the plan checks every reply carries them. The actor turns
  them into the teacher's whole distribution with the teacher's output head (recipe_gkd/losses/hidden.py).

- ``algorithm.cross_tokenizer`` (span / uld): every teacher is scored in its own tokens. The scorer is a
  CrossTokenizerScorer (recipe_gkd/cross_tokenizer/route.py, chosen by TeacherSet.connect): it sends each
  record's prompt and the decoded response as text and maps the reply onto the student's tokens by spans.

The loop does not see the difference: it gets one scored Sequence per response either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from recipe_gkd.batch import EXCLUDED_ID
from recipe_gkd.config import CrossTokenizer, GKDConfig, Support, TeacherOutput
from recipe_gkd.rollout.engine import Scorer
from teacher_server.protocol import TeacherTopK
from teacher_server.scores import repeated_named


@dataclass(frozen=True)
class ScoringPlan:
    """Which request the worker sends and how it unpacks the reply (see the module doc)."""

    support: Support
    student_top_k: int
    output: TeacherOutput = TeacherOutput.topk
    cross_tokenizer: CrossTokenizer = CrossTokenizer.none

    @staticmethod
    def from_config(cfg: GKDConfig) -> ScoringPlan:
        a = cfg.algorithm
        return ScoringPlan(a.support, cfg.rollout.student_top_k, cfg.teacher.output, a.cross_tokenizer)

    def score(
        self,
        scorer: Scorer,
        sequences: list[np.ndarray],
        score_from: list[int],
        student_topk: list[np.ndarray | None],
        records: list[dict[str, Any]] | None = None,
    ) -> list[TeacherTopK]:
        """The teacher's scores of every sequence from score_from on, in this plan's columns.

        student_topk: per sequence the engine's [n_scored, k_s] top ids (None: not sampled by the student).
        records: the sequences' data records (their prompts, for a teacher scored in its own tokens).
        """
        if self.cross_tokenizer != CrossTokenizer.none:
            if records is None or not hasattr(scorer, "score_records"):
                raise ValueError("algorithm.cross_tokenizer needs a CrossTokenizerScorer and each sequence's record")
            return scorer.score_records(sequences, score_from, records)  # type: ignore[attr-defined, no-any-return]
        if self.output == TeacherOutput.hidden:
            return [_with_hidden(reply) for reply in scorer.score(sequences, score_from)]
        if self.support == Support.teacher_topk:
            return scorer.score(sequences, score_from)
        named = [
            self._named_ids(seq, start, ids)
            for seq, start, ids in zip(sequences, score_from, student_topk, strict=True)
        ]
        replies = scorer.score(sequences, score_from, named_ids=named)
        return [union_scores(reply, ids) for reply, ids in zip(replies, named, strict=True)]

    def _named_ids(self, sequence: np.ndarray, start: int, student_ids: np.ndarray | None) -> np.ndarray:
        expected = (len(sequence) - start, self.student_top_k)
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


def _with_hidden(reply: TeacherTopK) -> TeacherTopK:
    if reply.hidden_states is None:
        raise ValueError("teacher.output=hidden but the teacher's reply carries no hidden states")
    return reply


def union_scores(reply: TeacherTopK, named_ids_NS: np.ndarray) -> TeacherTopK:
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
    return TeacherTopK(logprobs, ids, reply.sampled_logprob, reply.other_logmass)
