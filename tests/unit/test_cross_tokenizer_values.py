"""The cross-tokenizer path (algorithm.cross_tokenizer) on real-shaped byte-level BPE pairs: control tokens inside a
span, a response cut after a piece that starts a character, and every loss against an independent float64 reference."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from cross_tokenizer_pairs import build_pair, piece_bytes

from recipe_gkd.cross_tokenizer.align import align_spans, student_text
from recipe_gkd.cross_tokenizer.targets import aligned_scores, vocabulary_map
from recipe_gkd.losses import cross_tokenizer_loss_sum, span_advantages
from recipe_gkd.metrics import alignment_columns
from recipe_gkd.tiny_models import build_char_tokenizer, build_llama3_bpe_tokenizer
from teacher_server.conversation import Conversation, Renderer, token_byte_table
from teacher_server.protocol import TeacherTopK


@pytest.fixture(scope="module")
def demo_pair(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The demo across tokenizers: the char student, the Llama-3-shaped BPE teacher."""
    root = tmp_path_factory.mktemp("demo_pair")
    return {"student": build_char_tokenizer(root / "s"), "teacher": build_llama3_bpe_tokenizer(root / "t")}


@pytest.fixture(scope="module")
def bpe_pair(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """ChatML-shaped student and Llama-3-shaped teacher, byte-level BPEs holding pieces like " \\xe2\\x80"."""
    return build_pair(tmp_path_factory.mktemp("bpe_pair"))


def _reply(logprobs_NV: np.ndarray, token_ids: np.ndarray, offsets: np.ndarray, top_k: int) -> TeacherTopK:
    """What the server sends for scored positions of full log-probabilities (float64 in, the wire's float32 out)."""
    order_NK = np.argsort(-logprobs_NV, axis=-1, kind="stable")[:, :top_k]
    values_NK = np.take_along_axis(logprobs_NV, order_NK, axis=-1)
    rest_NV = logprobs_NV.copy()
    np.put_along_axis(rest_NV, order_NK, -np.inf, axis=-1)
    tail_N = np.logaddexp.reduce(rest_NV, axis=-1)
    sampled_N = logprobs_NV[np.arange(len(token_ids)), token_ids]
    return TeacherTopK(
        values_NK.astype(np.float32),
        order_NK.astype(np.int32),
        sampled_N.astype(np.float32),
        tail_N.astype(np.float32),
        token_ids=token_ids.astype(np.int32),
        byte_offsets=offsets.astype(np.int32),
    )


def test_a_control_token_inside_one_teacher_piece_gets_no_loss_and_counts_unaligned(demo_pair: dict) -> None:
    """Student `c <user> h <eos>` against teacher `ch <|eot_id|>`: `<user>` lies inside the span of "ch" and gets
    no loss, no gradient, no advantage, and counts as unaligned."""
    student, teacher = demo_pair["student"], demo_pair["teacher"]
    ids = np.asarray(student.convert_tokens_to_ids(["c", "<user>", "h", "<eos>"]))
    text = student_text(ids, token_byte_table(student, "model.student_path")[0], student.eos_token_id)
    assert text.text == "ch" and text.end_of_turn
    rendered = Renderer(teacher).render(Conversation([{"role": "user", "content": "rev:hc"}], "", "ch", True))
    t_ids = rendered.ids[rendered.score_from :]
    assert teacher.convert_ids_to_tokens(t_ids.tolist()) == ["ch", "<|eot_id|>"]
    gen = np.random.default_rng(0)
    t_logprobs = torch.log_softmax(torch.tensor(gen.normal(size=(2, len(teacher))) * 2), -1).numpy()
    reply = _reply(t_logprobs, t_ids, rendered.byte_offsets, 4)
    mapping = vocabulary_map(
        token_byte_table(student, "s")[0], token_byte_table(teacher, "t")[0], student.eos_token_id, teacher.eos_token_id
    )
    scored = aligned_scores(text, align_spans(text, rendered.byte_offsets), reply, mapping, 4)
    assert scored.span_len.tolist() == [3, -1, 0, 1]
    columns = alignment_columns([types.SimpleNamespace(alignment=scored.counts)])
    assert columns["align_unaligned_frac"] == pytest.approx(1 / 4) and columns["align_span_len"] == pytest.approx(1.5)
    # Forward KL on the span {"ch", rest}: the gradient reaches "c" and "h" only.
    logits = torch.tensor(gen.normal(size=(1, 4, len(student))), requires_grad=True)
    loss, _ = cross_tokenizer_loss_sum(
        logits,
        torch.from_numpy(ids)[None],
        torch.from_numpy(scored.topk_logprobs)[None].double(),
        torch.from_numpy(scored.topk_ids)[None].long(),
        torch.from_numpy(scored.tail_logmass)[None].double(),
        torch.from_numpy(scored.sampled_logprob)[None].double(),
        torch.from_numpy(scored.span_len)[None].long(),
        torch.ones(1, 4, dtype=torch.bool),
        objective="span",
        divergence="forward_kl",
    )
    (grad,) = torch.autograd.grad(loss, logits)
    assert grad[0, 1].abs().max() == 0 and grad[0, 0].abs().max() > 0 and grad[0, 2].abs().max() > 0
    # The span's log-probability is that of "c" and "h": the control token is not in it.
    token_lp = torch.log_softmax(logits.detach(), -1)[0, torch.arange(4), torch.from_numpy(ids)]
    rollout = token_lp[None]
    advantage, use, kept = span_advantages(
        torch.from_numpy(scored.sampled_logprob)[None].double(),
        rollout,
        torch.from_numpy(scored.span_len)[None].long(),
        torch.ones(1, 4, dtype=torch.bool),
    )
    assert kept.tolist() == [[True, False, True, True]] and use.tolist() == [[True, False, True, False]]
    expected = float(t_logprobs[0, t_ids[0]]) - float(token_lp[0] + token_lp[2])
    assert advantage[0, 0].item() == pytest.approx(expected, abs=1e-6) == advantage[0, 2].item()


@pytest.mark.parametrize("end", ["cut", "eos"])
def test_a_response_cut_after_a_piece_that_starts_a_character_aligns(bpe_pair: dict, end: str) -> None:
    """A response cut right after " \\xe2\\x80" (a space and the first two bytes of "—"): the text sent ends at the
    last whole token ("... world", without that space), the piece is unaligned, and both sides cover the same bytes.
    With an EOS after it (the student sampled EOS there) the EOS is unaligned too: the text before it is not whole."""
    student, teacher = bpe_pair["student"], bpe_pair["teacher"]
    table = token_byte_table(student, "model.student_path")[0]
    dash_start = [i for i in range(len(student)) if piece_bytes(student, i) == b" \xe2\x80"]
    assert dash_start and student.decode(student("a —")["input_ids"]) == "a —"
    body = student("the answer is hello world", add_special_tokens=False)["input_ids"]
    ids = [*body, dash_start[0]] + ([student.eos_token_id] if end == "eos" else [])
    text = student_text(np.asarray(ids), table, student.eos_token_id)
    assert text.text == "the answer is hello world" and not text.end_of_turn
    assert text.aligned.tolist() == [True] * len(body) + [False] * (len(ids) - len(body))
    rendered = Renderer(teacher).render(Conversation([{"role": "user", "content": "hi"}], "", text.text, False))
    spans = align_spans(text, rendered.byte_offsets)
    assert spans[-1].s_hi == len(body) and spans[-1].t_hi == len(rendered.byte_offsets)
    assert int(text.offsets[spans[-1].s_hi - 1, 1]) == int(rendered.byte_offsets[-1, 1]) == len(text.text)
