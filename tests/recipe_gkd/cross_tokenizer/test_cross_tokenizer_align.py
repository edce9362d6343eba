"""Alignment of two real-shaped byte-level BPE tokenizations (different vocabularies and merges) and the
teacher's rendering of a conversation in its own template (algorithm.cross_tokenizer)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from recipe_gkd.batch import FOLDED_BASE
from recipe_gkd.cross_tokenizer.align import Span, align_spans, student_text
from recipe_gkd.cross_tokenizer.span_scores import vocabulary_map
from recipe_gkd.offline_models import (
    CHATML_DEFAULT_SYSTEM,
    build_char_tokenizer,
    build_chatml_bpe_tokenizer,
    build_llama3_bpe_tokenizer,
)
from teacher_server.wire.conversation import Conversation, Renderer, RenderError, byte_offsets, token_byte_table

TEXTS = [
    "Hello wörld, the answer is 42 — naïve 日本 🙂!",
    "rev:abcdefg gfedcba sum:12345",
    "  two  spaces\n\nand a newline\tand a tab ",
    "Ünïcödé at the start, then plain ascii words that merge differently",
    "",
]


@pytest.fixture(scope="module")
def toks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("toks")
    return {
        "chatml": build_chatml_bpe_tokenizer(root / "chatml"),
        "llama3": build_llama3_bpe_tokenizer(root / "llama3"),
        "char": build_char_tokenizer(root / "char"),
    }


def _table(tok) -> list[bytes | None]:
    return token_byte_table(tok, "model.student_path")[0]


def _check_spans(spans: list[Span], s_offsets: np.ndarray, t_offsets: np.ndarray, n_teacher: int) -> None:
    """Spans tile both sides in order, cover equal bytes, and are minimal (no shared boundary inside)."""
    assert [s.t_lo for s in spans] == [0] + [s.t_hi for s in spans[:-1]]
    assert (spans[-1].t_hi if spans else 0) == n_teacher
    for a, b in itertools.pairwise(spans):
        assert a.s_hi == b.s_lo
    for span in spans:
        s_lo, s_hi = s_offsets[span.s_lo, 0], s_offsets[span.s_hi - 1, 1]
        t_lo, t_hi = t_offsets[span.t_lo, 0], t_offsets[span.t_hi - 1, 1]
        assert (s_lo, s_hi) == (t_lo, t_hi)
        inner_s = {int(e) for e in s_offsets[span.s_lo : span.s_hi - 1, 1]}
        inner_t = {int(e) for e in t_offsets[span.t_lo : span.t_hi - 1, 1]}
        assert not inner_s & inner_t, "a span that could be split"


@pytest.mark.parametrize("text", TEXTS)
def test_spans_of_two_bpe_tokenizers_cover_equal_bytes_and_are_minimal(toks: dict, text: str) -> None:
    student, teacher = toks["chatml"], toks["llama3"]
    s_ids = student(text, add_special_tokens=False)["input_ids"]
    t_ids = teacher(text, add_special_tokens=False)["input_ids"]
    assert s_ids != t_ids or not text  # the two vocabularies really tokenize differently
    st = student_text(np.asarray(s_ids), _table(student), student.eos_token_id)
    assert st.text == text and st.aligned.all() and not st.end_of_turn
    t_offsets = byte_offsets(t_ids, _table(teacher))
    spans = align_spans(st, t_offsets)
    if text:
        _check_spans(spans, st.offsets, t_offsets, len(t_ids))
        if text in (TEXTS[0], TEXTS[3]):  # merges that straddle the other side's boundaries
            assert any(not s.one_to_one for s in spans) and any(s.one_to_one for s in spans)
    else:
        assert spans == []


def test_identical_tokenizers_align_one_to_one(toks: dict) -> None:
    tok = toks["chatml"]
    ids = tok(TEXTS[0], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    st = student_text(np.asarray(ids), _table(tok), tok.eos_token_id)
    t_offsets = np.concatenate([byte_offsets(ids[:-1], _table(tok)), [[st.offsets[-1, 0]] * 2]]).astype(np.int32)
    spans = align_spans(st, t_offsets)
    assert len(spans) == len(ids) and all(s.one_to_one for s in spans)


def test_eos_aligns_with_the_teachers_end_of_turn(toks: dict) -> None:
    student, teacher = toks["char"], toks["llama3"]
    text = "gfedcba"
    s_ids = student(text, add_special_tokens=False)["input_ids"] + [student.eos_token_id]
    st = student_text(np.asarray(s_ids), _table(student), student.eos_token_id)
    assert st.end_of_turn and st.text == text
    rendered = Renderer(teacher).render(Conversation([{"role": "user", "content": "rev:abcdefg"}], "", text, True))
    assert rendered.ids[-1] == teacher.convert_tokens_to_ids("<|eot_id|>")
    spans = align_spans(st, rendered.byte_offsets)
    assert spans[-1] == Span(len(s_ids) - 1, len(s_ids), len(rendered.byte_offsets) - 1, len(rendered.byte_offsets))
    _check_spans(spans[:-1], st.offsets, rendered.byte_offsets, len(rendered.byte_offsets) - 1)
    mapping = vocabulary_map(_table(student), _table(teacher), student.eos_token_id, teacher.eos_token_id)
    assert mapping[teacher.eos_token_id] == student.eos_token_id
    a_id = teacher.convert_tokens_to_ids("a")
    assert mapping[a_id] == student.convert_tokens_to_ids("a")
    assert mapping[teacher.convert_tokens_to_ids("<|start_header_id|>")] == FOLDED_BASE


def test_a_truncated_multibyte_character_and_special_tokens_stay_unaligned(toks: dict) -> None:
    tok = toks["chatml"]
    table = _table(tok)
    ids = tok("ab 日本", add_special_tokens=False)["input_ids"]
    # Byte-level pieces of the last character, cut after its first byte (generation stopped mid-character).
    last = "本".encode()
    byte_ids = [i for i, piece in enumerate(table) if piece == last[:1]]
    prefix = tok("ab 日", add_special_tokens=False)["input_ids"]
    assert byte_ids and ids[: len(prefix)] == prefix
    truncated = [*prefix, tok.convert_tokens_to_ids("<|im_start|>"), byte_ids[0]]
    st = student_text(np.asarray(truncated), table, tok.eos_token_id)
    assert st.text == "ab 日"
    assert st.aligned.tolist() == [True] * len(prefix) + [False, False]
    t_offsets = byte_offsets(toks["llama3"]("ab 日", add_special_tokens=False)["input_ids"], _table(toks["llama3"]))
    spans = align_spans(st, t_offsets)
    assert spans[-1].s_hi == len(prefix)


def test_teacher_renders_with_its_own_template_and_system_prompt(toks: dict) -> None:
    teacher = toks["chatml"]
    rendered = Renderer(teacher).render(Conversation([{"role": "user", "content": "rev:abc"}], "", "cba", True))
    text = teacher.decode(rendered.ids[: rendered.score_from])
    assert CHATML_DEFAULT_SYSTEM in text and text.endswith("<|im_start|>assistant\n")
    assert teacher.decode(rendered.ids[rendered.score_from :]) == "cba<|im_end|>"
    assert rendered.byte_offsets[-1].tolist() == [3, 3]
    plain = Renderer(toks["char"]).render(Conversation([], "rev:abc", "cba", False))
    assert toks["char"].decode(plain.ids[: plain.score_from]) == "rev:abc"  # as data.encode_prompt tokenizes it
    assert plain.byte_offsets.tolist() == [[0, 1], [1, 2], [2, 3]]


def test_a_teacher_that_cannot_render_names_the_key(toks: dict) -> None:
    teacher = toks["llama3"]
    with pytest.raises(RenderError, match=r"teacher\.chat_template"):
        Renderer(teacher).render(Conversation([{"role": "tool", "content": "x"}], "", "y", False))
    bare = toks["chatml"]
    template, bare.chat_template = bare.chat_template, None
    try:
        with pytest.raises(RenderError, match=r"teacher\.chat_template"):
            Renderer(bare).render(Conversation([{"role": "user", "content": "x"}], "", "y", False))
        # teacher.chat_template supplies one.
        rendered = Renderer(bare, template).render(Conversation([{"role": "user", "content": "x"}], "", "y", False))
        assert bare.decode(rendered.ids[rendered.score_from :]) == "y"
    finally:
        bare.chat_template = template


def test_a_tokenizer_that_is_not_byte_level_is_refused_naming_the_key() -> None:
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    core.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")
    with pytest.raises(ValueError, match=r"teacher\.model_path"):
        token_byte_table(tok, "teacher.model_path")
