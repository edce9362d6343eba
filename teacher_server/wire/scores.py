"""What a score request returns, as numpy arrays: one sequence (TeacherScores) or several (TopKBatch).

The wire (protocol.py) and every backend produce these. Named ids: a request may name, per
scored position, ids whose teacher logprobs it wants (the student's own top-k); the result then
also holds those logprobs and the log of the mass outside the top-k and the named ids together
(`other_logmass`), computed by the server from its full distribution where it has one.

Hidden states (teacher.output=hidden): a request may instead ask for each scored position's final
hidden state (after the teacher's final norm, the input of its output head), rounded to bf16 or fp16
on the server; the actor computes the teacher's full distribution from them (recipe_gkd/losses/hidden.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TeacherScores:
    """The teacher's scores for one sequence, from its first response position to its end.

    Row j is position p = score_from + j of the sequence and holds the teacher's distribution
    of the token at p given the tokens before it (the logits at p-1), at the request's
    temperature. Rows are sorted by logprob, descending; equal logprobs by ascending id.

    topk_logprobs    [n_scored, K] float32  log p of the K most likely tokens
    topk_ids         [n_scored, K] int32    their token ids
    sampled_logprob  [n_scored]    float32  log p of the token actually at p (NaN in a hidden-state reply with
                     top_k 0: the server skips the log-softmax, teacher.output=hidden)
    tail_logmass     [n_scored]    float32  log of the mass outside the top-k (-inf when K = V)
    named_logprobs   [n_scored, k_s] float32 or None: log p at the ids the request named, in its order
    other_logmass    [n_scored]    float32 or None: log of the mass outside the top-k and the named ids
    hidden_states    [n_scored, H] float32 or None: the final hidden state that predicts position p
                     (at p-1), holding bf16 or fp16 values (the wire's precision)
    token_ids        [n_scored]    int32 or None: a text request's token at p (teacher_server/wire/conversation.py)
    byte_offsets     [n_scored, 2] int32 or None: its byte range within the response text
    """

    topk_logprobs: np.ndarray
    topk_ids: np.ndarray
    sampled_logprob: np.ndarray
    tail_logmass: np.ndarray
    named_logprobs: np.ndarray | None = None
    other_logmass: np.ndarray | None = None
    hidden_states: np.ndarray | None = None
    token_ids: np.ndarray | None = None
    byte_offsets: np.ndarray | None = None

    @property
    def n_scored(self) -> int:
        return int(self.topk_ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.topk_ids.shape[1])


@dataclass(frozen=True)
class TopKBatch:
    """Scores of several sequences, concatenated along positions (the wire and backend layout).

    n_scored [B] int64; the other arrays are TeacherScores's with N = n_scored.sum() rows.
    """

    n_scored: np.ndarray
    topk_logprobs: np.ndarray
    topk_ids: np.ndarray
    sampled_logprob: np.ndarray
    tail_logmass: np.ndarray
    named_logprobs: np.ndarray | None = None
    other_logmass: np.ndarray | None = None
    hidden_states: np.ndarray | None = None
    token_ids: np.ndarray | None = None
    byte_offsets: np.ndarray | None = None

    def _arrays(self) -> list[np.ndarray | None]:
        return [
            self.topk_logprobs,
            self.topk_ids,
            self.sampled_logprob,
            self.tail_logmass,
            self.named_logprobs,
            self.other_logmass,
            self.hidden_states,
            self.token_ids,
            self.byte_offsets,
        ]

    def split(self) -> list[TeacherScores]:
        """One TeacherScores per sequence (views, no copies)."""
        bounds = np.cumsum(self.n_scored)[:-1]
        columns = [[None] * len(self.n_scored) if a is None else np.split(a, bounds) for a in self._arrays()]
        return [TeacherScores(*row) for row in zip(*columns, strict=True)]

    @staticmethod
    def from_sequences(parts: Sequence[TeacherScores]) -> TopKBatch:
        """Pack per-sequence scores (the inverse of split)."""
        return TopKBatch(
            np.asarray([p.n_scored for p in parts], dtype=np.int64),
            np.concatenate([p.topk_logprobs for p in parts]),
            np.concatenate([p.topk_ids for p in parts]),
            np.concatenate([p.sampled_logprob for p in parts]),
            np.concatenate([p.tail_logmass for p in parts]),
            _concat_optional([p.named_logprobs for p in parts]),
            _concat_optional([p.other_logmass for p in parts]),
            _concat_optional([p.hidden_states for p in parts]),
            _concat_optional([p.token_ids for p in parts]),
            _concat_optional([p.byte_offsets for p in parts]),
        )

    @staticmethod
    def concat(batches: Sequence[TopKBatch]) -> TopKBatch:
        return TopKBatch(
            np.concatenate([b.n_scored for b in batches]),
            np.concatenate([b.topk_logprobs for b in batches]),
            np.concatenate([b.topk_ids for b in batches]),
            np.concatenate([b.sampled_logprob for b in batches]),
            np.concatenate([b.tail_logmass for b in batches]),
            _concat_optional([b.named_logprobs for b in batches]),
            _concat_optional([b.other_logmass for b in batches]),
            _concat_optional([b.hidden_states for b in batches]),
            _concat_optional([b.token_ids for b in batches]),
            _concat_optional([b.byte_offsets for b in batches]),
        )


def _concat_optional(arrays: list[np.ndarray | None]) -> np.ndarray | None:
    present = [a is not None for a in arrays]
    if not any(present):
        return None
    if not all(present):
        raise ValueError("some scores carry an optional array (named-id logprobs, hidden states) and some do not")
    return np.concatenate(arrays)  # type: ignore[arg-type]


def canonical_order(logprobs_NK: np.ndarray, ids_NK: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows sorted by logprob descending, ties by ascending id: one order on both ends of the wire."""
    order_NK = np.lexsort((ids_NK, -logprobs_NK), axis=-1)
    return np.take_along_axis(logprobs_NK, order_NK, axis=1), np.take_along_axis(ids_NK, order_NK, axis=1)


def log1mexp_of_logsumexp(logprobs_NK: np.ndarray) -> np.ndarray:
    """log(1 - sum exp(row)) per row, as log1mexp(logsumexp) in float64; 0 for an empty row.

    For backends that do not expose the full distribution (vllm); -inf when the row already
    holds all the mass. log1mexp(x) = log(-expm1(x)) for x > -ln 2, else log1p(-exp(x)) (Maechler 2012).
    """
    if logprobs_NK.shape[1] == 0:
        return np.zeros(logprobs_NK.shape[0], dtype=np.float32)
    lse_N = np.minimum(np.logaddexp.reduce(logprobs_NK.astype(np.float64), axis=1), 0.0)
    with np.errstate(divide="ignore"):
        near_one = np.log(-np.expm1(lse_N))
        far = np.log1p(-np.exp(lse_N))
    return np.where(lse_N > -math.log(2), near_one, far).astype(np.float32)


def tail_from_topk(logprobs_NK: np.ndarray) -> np.ndarray:
    """log(1 - sum exp(top-k)) per row from the top-k alone (see log1mexp_of_logsumexp)."""
    return log1mexp_of_logsumexp(logprobs_NK)


def repeated_named(topk_ids_NK: np.ndarray, named_ids_NS: np.ndarray) -> np.ndarray:
    """[N, k_s] bool: the named id is in the row's top-k or repeats an earlier named column (count it once)."""
    repeated_NS = (named_ids_NS[:, :, None] == topk_ids_NK[:, None, :]).any(-1)
    k_s = named_ids_NS.shape[1]
    # [N, k_s, k_s]: column j equals an earlier column i < j.
    earlier_NSS = (named_ids_NS[:, :, None] == named_ids_NS[:, None, :]) & np.tri(k_s, k_s, -1, dtype=bool)[None]
    return repeated_NS | earlier_NSS.any(-1)


def other_from_union(
    topk_logprobs_NK: np.ndarray, topk_ids_NK: np.ndarray, named_logprobs_NS: np.ndarray, named_ids_NS: np.ndarray
) -> np.ndarray:
    """log of the mass outside the top-k and the named ids, from their values alone (each id counted once)."""
    unique_named_NS = np.where(repeated_named(topk_ids_NK, named_ids_NS), -np.inf, named_logprobs_NS)
    return log1mexp_of_logsumexp(np.concatenate([topk_logprobs_NK, unique_named_NS], axis=1))


def scores_from_logprobs(
    logprobs_NV: np.ndarray, next_ids_N: np.ndarray, top_k: int, named_ids_NS: np.ndarray | None = None
) -> TeacherScores:
    """Exact TeacherScores of N positions from their full-vocabulary log-probs (a reference scorer).

    Row n is the distribution of token next_ids_N[n]; the tail (and the mass outside the top-k and
    `named_ids_NS`) is computed in float64 from the whole distribution, as a backend that sees
    every logit does.
    """
    logprobs_NV = np.asarray(logprobs_NV, dtype=np.float64)
    top_NK = np.argsort(-logprobs_NV, axis=-1, kind="stable")[:, :top_k]
    values_NK = np.take_along_axis(logprobs_NV, top_NK, axis=-1)
    rest_NV = logprobs_NV.copy()
    np.put_along_axis(rest_NV, top_NK, -np.inf, axis=-1)
    with np.errstate(divide="ignore"):
        tail_N = np.logaddexp.reduce(rest_NV, axis=-1)
    sampled_N = np.take_along_axis(logprobs_NV, np.asarray(next_ids_N, dtype=np.int64)[:, None], axis=-1)[:, 0]
    logprobs, ids = canonical_order(values_NK.astype(np.float32), top_NK.astype(np.int32))
    named = other = None
    if named_ids_NS is not None:
        named_NS = np.asarray(named_ids_NS, dtype=np.int64)
        named = np.take_along_axis(logprobs_NV, named_NS, axis=-1).astype(np.float32)
        np.put_along_axis(rest_NV, named_NS, -np.inf, axis=-1)
        with np.errstate(divide="ignore"):
            other = np.logaddexp.reduce(rest_NV, axis=-1).astype(np.float32)
    return TeacherScores(logprobs, ids, sampled_N.astype(np.float32), tail_N.astype(np.float32), named, other)
