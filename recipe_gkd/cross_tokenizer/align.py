"""Student tokens and teacher tokens grouped into the smallest spans that cover the same response bytes.

Both sides' response tokens are laid on the UTF-8 bytes of the response text (each token's bytes from
its own vocabulary, teacher_server/wire/conversation.py `token_byte_table`). Walking both lists by their end
offsets, a span closes wherever both tokenizations have a boundary at the same byte: the smallest groups
with equal byte ranges (TRL's GOLD trainer walks them the same way, trl/experimental/gold/gold_trainer.py
`ULDLoss._align_by_byte_offsets`; it works on byte offsets for the reason we do: a byte-level BPE token
may hold part of a UTF-8 character). Special handling:

- the student's control tokens (its special / template tokens) have no text: they are left unaligned,
  even where one sits between two tokens of a span (the span's rows then hold it, marked unaligned),
  except a final EOS, which is aligned one-to-one with the teacher's end of turn (the server scores that
  token after the response, conversation.py);
- a response whose bytes do not decode as UTF-8 (a truncated multi-byte character at the end, or
  invalid bytes the student sampled) is sent up to its last whole token that ends on valid text: a
  byte-level piece may complete text and start a character (" \xe2\x80", a space and the start of "—"),
  and that piece's text bytes are not sent either, so both sides cover the same bytes; the tokens past
  that point are unaligned.

Unaligned student tokens get no loss (they are counted in the step's alignment metrics).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from teacher_server.wire.conversation import byte_offsets


@dataclass(frozen=True)
class StudentText:
    """A student response as text: the text the teacher scores, and per student token its byte range
    in it (aligned[j] False: a control token, or past the last whole token ending on valid UTF-8)."""

    text: str
    offsets: np.ndarray  # int32 [n, 2]
    aligned: np.ndarray  # bool [n]
    ends_with_eos: bool

    @property
    def end_of_turn(self) -> bool:
        """The response ended with EOS after valid text: the teacher scores its end of turn there."""
        return self.ends_with_eos and bool(self.aligned[-1])


@dataclass(frozen=True)
class Span:
    """Student rows [s_lo, s_hi) and teacher tokens [t_lo, t_hi) covering the same bytes (a student control token
    between two of the span's tokens lies in its rows but is not aligned: StudentText.aligned is False there)."""

    s_lo: int
    s_hi: int
    t_lo: int
    t_hi: int

    @property
    def one_to_one(self) -> bool:
        return self.s_hi - self.s_lo == 1 and self.t_hi - self.t_lo == 1


def student_text(
    response_ids: np.ndarray, table: list[bytes | None], end_ids: int | Collection[int] | None
) -> StudentText:
    """The response's text and each token's byte range (see the module doc for what stays unaligned).

    `end_ids`: the ids that end the student's turn (its stop set: EOS, generation_config.json's, the template's turn
    end); a response ending with one ends its turn."""
    ids = [int(i) for i in response_ids]
    ends = {end_ids} if isinstance(end_ids, int) else set(end_ids or ())
    ends_with_eos = bool(ids) and ids[-1] in ends
    body = ids[:-1] if ends_with_eos else ids
    offsets = byte_offsets(body, table)
    raw = b"".join(table[i] or b"" for i in body if i < len(table))
    valid = _whole_token_prefix(raw, offsets[:, 1])
    text = raw[:valid].decode("utf-8")
    width = offsets[:, 1] - offsets[:, 0]
    aligned = (width > 0) & (offsets[:, 1] <= valid)
    if ends_with_eos:
        end = len(raw)
        offsets = np.concatenate([offsets, np.asarray([[end, end]], dtype=np.int32)])
        # The EOS stands for the end of turn only when everything before it is text the teacher saw.
        aligned = np.concatenate([aligned, [valid == len(raw)]])
    return StudentText(text, offsets.astype(np.int32), aligned.astype(bool), ends_with_eos)


def _whole_token_prefix(raw: bytes, token_ends: np.ndarray) -> int:
    """The longest prefix of `raw` that decodes as UTF-8 and ends where a token ends (0 when none does)."""
    try:
        raw.decode("utf-8")
        return len(raw)
    except UnicodeDecodeError as err:
        utf8_valid = err.start
    # Token ends within the valid bytes, latest first; one inside a character (a piece holding its first byte) is
    # skipped: rare, and at most a character's 3 bytes back.
    for end in sorted({int(e) for e in token_ends if e <= utf8_valid}, reverse=True):
        if end == utf8_valid or (raw[end] & 0xC0) != 0x80:
            return end
    return 0


def align_spans(student: StudentText, teacher_offsets: np.ndarray) -> list[Span]:
    """The smallest spans of equal byte ranges between the student's aligned tokens and the teacher's tokens.

    teacher_offsets [m, 2]: the teacher's scored tokens' byte ranges (conversation.py), ending with the
    zero-width end of turn when the student's response ended with EOS. Student tokens that are not aligned
    are skipped (they belong to no span). Raises ValueError when the two sides do not cover the same bytes.
    """
    s_idx = [j for j in range(len(student.aligned)) if student.aligned[j]]
    has_eot = student.end_of_turn
    if has_eot:
        s_idx = s_idx[:-1]  # the EOS pairs with the teacher's end of turn, below
    t_count = len(teacher_offsets) - (1 if has_eot else 0)
    s_end = [int(student.offsets[j, 1]) for j in s_idx]
    t_end = [int(teacher_offsets[t, 1]) for t in range(t_count)]
    if (s_end[-1] if s_end else 0) != (t_end[-1] if t_end else 0):
        raise ValueError(
            f"student and teacher tokens cover {s_end[-1] if s_end else 0} and {t_end[-1] if t_end else 0} bytes of "
            "the response: the teacher scored another text"
        )
    spans: list[Span] = []
    s = t = 0
    s_lo, t_lo = 0, 0
    while s < len(s_idx) and t < t_count:
        if s_end[s] < t_end[t]:
            s += 1
        elif s_end[s] > t_end[t]:
            t += 1
        else:
            s += 1
            t += 1
            # The span's rows run from its first to its last aligned student token; a control token between them
            # (zero-width, sampled inside one teacher piece) lies in them, unaligned. Tokens past the text never do.
            spans.append(Span(s_idx[s_lo], s_idx[s - 1] + 1, t_lo, t))
            s_lo, t_lo = s, t
    if has_eot:
        spans.append(Span(len(student.aligned) - 1, len(student.aligned), t_count, t_count + 1))
    return spans
