"""The teacher's reply in its own tokens, mapped onto the student's response tokens span by span.

Per student response token j (the arrays of recipe_gkd.batch.ScoredSequence, one row per response token):

- ``span_len[j]``: > 0 at the first student token of a span (the rows the span runs over), 0 at the span's
  other tokens, -1 at an unaligned token (no loss), a control token the student sampled inside the span too
  (the span's sums skip it: losses/cross_tokenizer.py `span_sums` of masked values, `span_advantages`);
- ``teacher_sampled_logprob[j]``: at a span's first token, the teacher's log-probability of the span's
  text (the sum of its token logprobs over the span; 0 at the span's other tokens), so the sums over a
  response are the teacher's logprob of the whole aligned text;
- a **shared** span (one student token, one teacher token, and at least one of the teacher's top-k
  pieces is also a student piece, the same bytes): the teacher's top-k with each id mapped to the
  student's id of the same piece, a piece the student does not have mapped to ``folded_id`` (>= the
  student's vocabulary: the loss folds its mass into the tail bucket, losses/topk.py), and the server's
  exact tail. This is GOLD's per-token term over the shared vocabulary (trl/experimental/gold,
  `ULDLoss._compute_hybrid_uld_loss`), as an exact divergence over the shared pieces + one bucket;
- any other span: the teacher's top-k log-probabilities at the span's first teacher token, times the
  probabilities of its later tokens (GOLD's "observed" merge, `_merge_probabilities_with_alignment_groups`),
  ids EXCLUDED_ID: values for ULD's sorted comparison (arXiv 2402.12030), whatever the vocabularies.

With identical tokenizers every span is shared and one token long, and these are exactly the
same-tokenizer arrays (tests/recipe_gkd/losses/test_cross_tokenizer_loss.py checks the loss is then equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from recipe_gkd.batch import EXCLUDED_ID, FOLDED_BASE
from recipe_gkd.cross_tokenizer.align import Span, StudentText
from teacher_server.wire.conversation import Conversation
from teacher_server.wire.protocol import TeacherScores


@dataclass(frozen=True)
class AlignedScores(TeacherScores):
    """TeacherScores in the student's response positions (see the module doc), with the span structure."""

    span_len: np.ndarray | None = None  # int32 [n]
    # one_to_one_tokens, shared_spans, spans, aligned_tokens, response_tokens (this sequence's counts)
    counts: dict[str, float] = field(default_factory=dict)


ALIGN_COUNTS = ("one_to_one_tokens", "shared_spans", "spans", "aligned_tokens", "response_tokens")


def vocabulary_map(
    student_table: list[bytes | None],
    teacher_table: list[bytes | None],
    student_end: int | None,
    teacher_eos: int | None,
    student_controls: dict[str, int] | None = None,
    teacher_controls: dict[str, int] | None = None,
) -> np.ndarray:
    """teacher id -> the student id of the same piece (same bytes), FOLDED_BASE where the student has none;
    a control (special) token -> the student's control token of the same name; the teacher's end of turn
    maps to `student_end`, the id the student closes a turn with (its stop set's closing id)."""
    by_bytes: dict[bytes, int] = {}
    for i, piece in enumerate(student_table):
        if piece is not None:
            by_bytes.setdefault(piece, i)
    mapping = np.full(len(teacher_table), FOLDED_BASE, dtype=np.int64)
    for t_id, piece in enumerate(teacher_table):
        if piece is not None and piece in by_bytes:
            mapping[t_id] = by_bytes[piece]
    for name, t_id in (teacher_controls or {}).items():
        if name in (student_controls or {}) and t_id < len(mapping):
            mapping[t_id] = (student_controls or {})[name]
    if student_end is not None and teacher_eos is not None and teacher_eos < len(mapping):
        mapping[teacher_eos] = student_end
    return mapping


def conversation_of(record: dict[str, Any], data: Any, text: StudentText) -> Conversation:
    """What the teacher renders: the record's prompt (messages through its template, or plain text) + the response."""
    from recipe_gkd.data import prompt_messages

    prompt = record[data.prompt_key]
    if isinstance(prompt, list):
        messages = prompt_messages(prompt, data.prompt_key)
    elif data.apply_chat_template:
        messages = [{"role": "user", "content": str(prompt)}]
    else:
        return Conversation([], str(prompt), text.text, text.end_of_turn)
    return Conversation(messages, "", text.text, text.end_of_turn)


def aligned_scores(
    text: StudentText, spans: list[Span], reply: TeacherScores, mapping: np.ndarray, top_k: int
) -> AlignedScores:
    """The arrays of the module doc for one response of `len(text.aligned)` student tokens."""
    n = len(text.aligned)
    logprobs = np.zeros((n, top_k), dtype=np.float32)
    ids = np.full((n, top_k), EXCLUDED_ID, dtype=np.int32)
    tail = np.zeros(n, dtype=np.float32)
    sampled = np.zeros(n, dtype=np.float32)
    span_len = np.full(n, -1, dtype=np.int32)
    teacher_sampled = reply.sampled_logprob.astype(np.float64)
    shared_spans = one_to_one_tokens = 0
    for span in spans:
        # A control token inside the span stays unaligned: no log-prob in the span's sums, no advantage.
        span_len[span.s_lo : span.s_hi] = np.where(text.aligned[span.s_lo : span.s_hi], 0, -1)
        span_len[span.s_lo] = span.s_hi - span.s_lo
        sampled[span.s_lo] = teacher_sampled[span.t_lo : span.t_hi].sum()
        one_to_one_tokens += span.one_to_one
        if not top_k:
            continue
        mapped = _student_columns(mapping[reply.topk_ids[span.t_lo].astype(np.int64)])
        if span.one_to_one and np.any(mapped < FOLDED_BASE):
            shared_spans += 1
            logprobs[span.s_lo] = reply.topk_logprobs[span.t_lo]
            ids[span.s_lo] = mapped
            tail[span.s_lo] = reply.tail_logmass[span.t_lo]
        else:
            later = teacher_sampled[span.t_lo + 1 : span.t_hi].sum()
            logprobs[span.s_lo] = reply.topk_logprobs[span.t_lo] + later
    aligned_tokens = int((span_len >= 0).sum())
    counts = {
        "one_to_one_tokens": float(one_to_one_tokens),
        "shared_spans": float(shared_spans),
        "spans": float(len(spans)),
        "aligned_tokens": float(aligned_tokens),
        "response_tokens": float(n),
    }
    return AlignedScores(logprobs, ids, sampled, tail, span_len=span_len, counts=counts)


def _student_columns(mapped_K: np.ndarray) -> np.ndarray:
    """Distinct student ids per column: a missing piece, or a student id an earlier column holds already, becomes
    FOLDED_BASE + its column (its teacher mass goes to the tail bucket)."""
    columns_K = np.arange(mapped_K.size)
    _, first = np.unique(mapped_K, return_index=True)
    repeated_K = np.ones(mapped_K.size, dtype=bool)
    repeated_K[first] = False
    return np.where((mapped_K >= FOLDED_BASE) | repeated_K, FOLDED_BASE + columns_K, mapped_K)
