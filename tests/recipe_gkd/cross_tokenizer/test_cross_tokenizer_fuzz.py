"""The alignment of algorithm.cross_tokenizer on random responses: random unicode text (combining marks, emoji, CJK,
invalid bytes, literal special-token names) as a sampler emits it (odd segmentations, split characters, control
tokens, random pieces), cut at random points, through two real-shaped byte-level BPEs both ways round."""

from __future__ import annotations

import numpy as np
import pytest
from cross_tokenizer_pairs import build_pair

from recipe_gkd.cross_tokenizer.align import align_spans, student_text
from recipe_gkd.cross_tokenizer.span_scores import aligned_scores, vocabulary_map
from teacher_server.wire.conversation import Conversation, Renderer, token_byte_table
from teacher_server.wire.protocol import TeacherScores

SEED = 4545
CASES = 800  # per direction: under a second each
TOP_K = 3
ALPHABET = [
    *"abcdefghijklmnopqrstuvwxyz      .,!?:0123456789\n\t",
    *"éïöüçñßÅ",
    "\u0301",  # combining acute
    "\u0308",  # combining diaeresis
    "—",
    "“",
    "”",
    "’",
    "…",
    *"日本語中文東京",
    "🙂",
    "👍🏽",
    "👨\u200d👩\u200d👧",
    "🎉",
    "<|im_end|>",
    "<|im_start|>",
    "<|eot_id|>",
    "<|begin_of_text|>",
    "<|endoftext|>",
]


# Words both vocabularies merge, differently (" which": one piece and three).
WORDS = [" the", " answer", " which", " each", " hello", " world", " there", " these", " would", " question"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return build_pair(tmp_path_factory.mktemp("fuzz_pair"))


def _random_response(tok, table: list[bytes | None], rng: np.random.Generator) -> list[int]:
    """Ids as a sampler may emit them: random text in random segments, each tokenized alone, character by character
    or byte by byte (split characters), now and then any piece of the vocabulary (invalid UTF-8 follows) or a control
    token between two tokens; cut at a random point, then EOS or not."""
    text_ids = [i for i, piece in enumerate(table) if piece is not None]
    controls = [i for i, piece in enumerate(table) if piece is None]
    single = {piece: i for i, piece in enumerate(table) if piece is not None and len(piece) == 1}
    chars = list("".join(rng.choice(ALPHABET + WORDS, size=int(rng.integers(0, 14)))))
    ids: list[int] = []
    while chars:
        size = int(rng.integers(1, 9))
        segment, chars = "".join(chars[:size]), chars[size:]
        mode = rng.random()
        if mode < 0.5:
            pieces = tok(segment, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        elif mode < 0.75:
            pieces = [
                i for c in segment for i in tok(c, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            ]
        else:
            pieces = [single[bytes([b])] for b in segment.encode()]
        for piece in pieces:
            ids.append(piece)
            if rng.random() < 0.06:
                ids.append(int(rng.choice(controls)))
        if rng.random() < 0.1:
            ids.append(int(rng.choice(text_ids)))
    ids = ids[: int(rng.integers(0, len(ids) + 1))]
    return [*ids, tok.eos_token_id] if rng.random() < 0.5 else ids


def _reply(n: int, vocab: int, rng: np.random.Generator) -> TeacherScores:
    """Any reply of the right shape: the alignment does not depend on its values."""
    return TeacherScores(
        -rng.uniform(0, 5, size=(n, TOP_K)).astype(np.float32),
        rng.integers(0, vocab, size=(n, TOP_K)).astype(np.int32),
        -rng.uniform(0, 5, size=n).astype(np.float32),
        np.full(n, -3.0, np.float32),
    )


@pytest.mark.parametrize("direction", ["chatml_to_llama3", "llama3_to_chatml"])
def test_alignment_never_raises_and_covers_the_same_bytes(pair: dict, direction: str) -> None:
    student, teacher = (pair["student"], pair["teacher"])[:: 1 if direction == "chatml_to_llama3" else -1]
    s_table = token_byte_table(student, "model.student_path")[0]
    t_table = token_byte_table(teacher, "teacher.model_path")[0]
    mapping = vocabulary_map(s_table, t_table, student.eos_token_id, teacher.eos_token_id)
    renderer = Renderer(teacher)
    rng = np.random.default_rng(SEED)
    seen = {"cut": 0, "control inside a span": 0, "end of turn": 0, "multi-token spans": 0}
    for case in range(CASES):
        ids = _random_response(student, s_table, rng)
        text = student_text(np.asarray(ids, dtype=np.int64), s_table, student.eos_token_id)
        raw = b"".join(s_table[i] or b"" for i in (ids[:-1] if text.ends_with_eos else ids))
        sent = text.text.encode()
        assert raw.startswith(sent), case
        rendered = renderer.render(Conversation([{"role": "user", "content": "x"}], "", text.text, text.end_of_turn))
        spans = align_spans(text, rendered.byte_offsets)
        scored = aligned_scores(text, spans, _reply(len(rendered.byte_offsets), len(teacher), rng), mapping, TOP_K)
        t_ids = rendered.ids[rendered.score_from :]
        # Every row: in exactly one span (and aligned), or unaligned with no loss.
        owners = np.zeros(len(ids), dtype=np.int64)
        for span in spans:
            owners[span.s_lo : span.s_hi] += text.aligned[span.s_lo : span.s_hi]
        assert np.array_equal(owners, text.aligned.astype(np.int64)), case
        assert np.array_equal(scored.span_len >= 0, text.aligned), case
        # The spans tile the teacher's tokens and the text; each covers the same bytes on both sides.
        bounds = [0, *(s.t_hi for s in spans)]
        assert [s.t_lo for s in spans] == bounds[:-1] and bounds[-1] == len(t_ids), case
        covered = b""
        for span in spans:
            rows = [j for j in range(span.s_lo, span.s_hi) if text.aligned[j]]
            s_bytes = b"".join(s_table[ids[j]] or b"" for j in rows)
            t_bytes = b"".join(t_table[int(t)] or b"" for t in t_ids[span.t_lo : span.t_hi])
            assert s_bytes == t_bytes, case
            covered += s_bytes
        assert covered == sent, case
        # The EOS is aligned (with the teacher's end of turn) exactly when all the text before it was sent.
        assert text.end_of_turn == (text.ends_with_eos and raw == sent), case
        seen["cut"] += raw != sent
        seen["control inside a span"] += any(not text.aligned[s.s_lo : s.s_hi].all() for s in spans)
        seen["end of turn"] += text.end_of_turn
        seen["multi-token spans"] += any(s.s_hi - s.s_lo > 1 and s.t_hi - s.t_lo > 1 for s in spans)
    assert min(seen.values()) >= 10, seen  # the cases reach what they are meant to
