"""The cross-tokenizer path (algorithm.cross_tokenizer) on real-shaped byte-level BPE pairs: control tokens inside a
span, a response cut after a piece that starts a character, and every loss against an independent float64 reference."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from cross_tokenizer_pairs import build_pair, piece_bytes

from recipe_gkd.cross_tokenizer.align import align_spans, student_text
from recipe_gkd.cross_tokenizer.span_scores import aligned_scores, vocabulary_map
from recipe_gkd.losses import cross_tokenizer_loss_sum, span_advantages
from recipe_gkd.observe.metrics import alignment_columns
from recipe_gkd.offline_models import build_char_tokenizer, build_llama3_bpe_tokenizer
from teacher_server.wire.conversation import Conversation, Renderer, token_byte_table
from teacher_server.wire.protocol import TeacherScores


@pytest.fixture(scope="module")
def demo_pair(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The demo across tokenizers: the char student, the Llama-3-shaped BPE teacher."""
    root = tmp_path_factory.mktemp("demo_pair")
    return {"student": build_char_tokenizer(root / "s"), "teacher": build_llama3_bpe_tokenizer(root / "t")}


@pytest.fixture(scope="module")
def bpe_pair(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """ChatML-shaped student and Llama-3-shaped teacher, byte-level BPEs holding pieces like " \\xe2\\x80"."""
    return build_pair(tmp_path_factory.mktemp("bpe_pair"))


def _reply(logprobs_NV: np.ndarray, token_ids: np.ndarray, offsets: np.ndarray, top_k: int) -> TeacherScores:
    """What the server sends for scored positions of full log-probabilities (float64 in, the wire's float32 out)."""
    order_NK = np.argsort(-logprobs_NV, axis=-1, kind="stable")[:, :top_k]
    values_NK = np.take_along_axis(logprobs_NV, order_NK, axis=-1)
    rest_NV = logprobs_NV.copy()
    np.put_along_axis(rest_NV, order_NK, -np.inf, axis=-1)
    tail_N = np.logaddexp.reduce(rest_NV, axis=-1)
    sampled_N = logprobs_NV[np.arange(len(token_ids)), token_ids]
    return TeacherScores(
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


# ---- Every loss of the path against an independent float64 reference ----------------------------------------------
#
# The path: the rollout worker's CrossTokenizerScorer (student_text, the teacher's Renderer, align_spans,
# aligned_scores) with an in-process teacher, then the actor's losses. The reference below calls none of these: it
# reads each token's bytes from the vocabulary strings (cross_tokenizer_pairs.piece_bytes), finds the valid text as
# the longest whole-token prefix that decodes, tokenizes it with the teacher's tokenizer itself, groups the tokens of
# both sides by the byte offsets they share (a token joins the group of the first shared offset at or after its end:
# the same groups as TRL GOLD's walk, found another way), and evaluates every span's terms from the two models' full
# log-probabilities in float64 (GOLD's "observed" merge for ULD: the span's first-token distribution times the
# probability of its later tokens).

TOP_K = 6
JSD_BETA = 0.3
PROMPT = "rev:hello"
# Wire values are float32 (relative rounding 2^-24 each); a loss is a sum of span terms, each a smooth function of
# its wire values with derivatives of order 1 in log-space: relative 1e-6 on the sums holds with a wide margin
# (measured: 3e-9; per span at most 7e-8 absolute), while every mutation of the mapping changes them by more than 1e-3.
LOSS_RTOL = 1e-6
F32_EPS = 2.0**-24
# One span's term, of order 0.01-1: float32 wire values of order 10 carry ~1e-6 absolute rounding.
SPAN_ATOL = 1e-6


class Bigram:
    """Full log-probabilities of a random bigram-and-position model over one vocabulary, float64, confident on the
    response it scores as a trained model is (a bonus of random size on each next token): spans of several tokens
    then carry probabilities of order 0.1-1, where every term of the losses is sensitive to the mapping."""

    def __init__(self, vocab: int, seed: int) -> None:
        gen = np.random.default_rng(seed)
        self.next_VV = gen.normal(size=(vocab, vocab)) * 1.5
        self.position_PV = gen.normal(size=(5, vocab)) * 0.5
        self.bonus_P = gen.uniform(4.0, 10.0, size=7)

    def logprobs(self, ids: list[int] | np.ndarray) -> np.ndarray:
        """[L - 1, V]: row p - 1 is the distribution of ids[p] given ids[:p] (and the bonus on ids[p])."""
        ids = np.asarray(ids)
        positions = np.arange(1, len(ids))
        logits = self.next_VV[ids[:-1]] + self.position_PV[positions % 5]
        logits[positions - 1, ids[1:]] += self.bonus_P[positions % 7]
        return logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)


class InProcessTeacher:
    """The server's text path in this process: the replica's Renderer, then the top-k of the teacher's model."""

    def __init__(self, tokenizer, model: Bigram) -> None:
        self.renderer, self.model = Renderer(tokenizer), model

    def score_conversations(self, conversations) -> list[TeacherScores]:
        out = []
        for conversation in conversations:
            r = self.renderer.render(conversation)
            logprobs = self.model.logprobs(r.ids)[r.score_from - 1 :]
            out.append(_reply(logprobs, r.ids[r.score_from :], r.byte_offsets, TOP_K))
        return out


def _special(tok, token_id: int) -> bool:
    added = tok.added_tokens_decoder.get(token_id)
    return token_id in tok.all_special_ids or bool(added is not None and added.special)


def _bytes_of(tok, token_id: int) -> bytes | None:
    return None if _special(tok, token_id) else piece_bytes(tok, token_id)


def _sampled(tok, pieces: list, rng: np.random.Generator) -> list[int]:
    """Student ids as a sampler might emit them: text in random segments (each tokenized alone: not the canonical
    tokenization, so spans of several tokens on both sides), some segments as single bytes (characters split
    across tokens), control tokens (by id), raw bytes (bytes objects) and segments (a tuple of strings) where given."""
    single = {piece_bytes(tok, i): i for i in range(len(tok)) if not _special(tok, i)}
    ids: list[int] = []
    for piece in pieces:
        if isinstance(piece, int):
            ids.append(piece)
        elif isinstance(piece, bytes):
            ids += [single[piece[k : k + 1]] for k in range(len(piece))]
        elif isinstance(piece, tuple):
            ids += [i for part in piece for i in tok(part, add_special_tokens=False)["input_ids"]]
        else:
            cuts = sorted(rng.choice(np.arange(1, len(piece)), size=len(piece) // 6, replace=False))
            for segment in np.split(np.asarray(list(piece), dtype=object), cuts):
                part = "".join(segment)
                if rng.random() < 0.25:
                    ids += [single[bytes([b])] for b in part.encode()]
                else:
                    ids += tok(part, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids


def _responses(student) -> list[list[int]]:
    rng = np.random.default_rng(45)
    eos, control = student.eos_token_id, student.convert_tokens_to_ids("<|im_start|>")
    dash_start = next(i for i in range(len(student)) if _bytes_of(student, i) == b" \xe2\x80")
    return [
        # multi-byte text in odd segments, a control token sampled inside it, EOS
        [*_sampled(student, ["the answer is — “ok” 日本語 🙂 wh", control, "ich each hello world"], rng), eos],
        # literal special-token names of both sides inside the text, combining marks, EOS
        [*_sampled(student, ["said <|eot_id|> and <|im_end|> — e\u0301 café a\u0308"], rng), eos],
        # cut after a piece that completes text and starts a character (max_new_tokens)
        [*_sampled(student, [("hel", "lo", " ", "ther", "e"), " wörld 東京 the"], rng), dash_start],
        # an invalid byte, more text, then EOS: the EOS follows text the teacher never saw
        [*_sampled(student, ["naïve 日本", b"\x80", "ok sum"], rng), eos],
        # a character split after its first byte, then the response cut: its first byte is left out
        _sampled(student, ["résumé 👍🏽 it’s ", "東".encode()[:1]], rng),
        # the canonical tokenization, EOS
        [*student("we’re “quoted” 中文 🎉 yes", add_special_tokens=False)["input_ids"], eos],
    ]


def _student_rows(student, ids: list[int]) -> tuple[str, list[int], list[int], bool]:
    """(text sent, aligned text rows, their byte ends, EOS aligned), from the vocabulary strings alone."""
    eos = student.eos_token_id
    body = ids[:-1] if ids and ids[-1] == eos else ids
    pieces = [_bytes_of(student, i) or b"" for i in body]
    longest = 0
    for k in range(len(body) + 1):  # the longest whole-token prefix that is valid UTF-8
        try:
            b"".join(pieces[:k]).decode("utf-8")
            longest = k
        except UnicodeDecodeError:
            continue
    rows = [j for j in range(longest) if pieces[j]]
    ends = [len(b"".join(pieces[: j + 1])) for j in rows]
    eos_aligned = len(body) < len(ids) and longest == len(body)
    return b"".join(pieces[:longest]).decode(), rows, ends, eos_aligned


def _teacher_ids(teacher, text: str, eos_aligned: bool) -> tuple[list[int], list[int]]:
    messages = [{"role": "user", "content": PROMPT}]
    prompt = teacher(
        teacher.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )["input_ids"]
    response = teacher(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return prompt, response + ([teacher.eos_token_id] if eos_aligned else [])


def _groups(s_rows: list[int], s_ends: list[int], t_ends: list[int]) -> list[tuple[list[int], list[int]]]:
    """Per shared byte offset, the student rows and teacher positions whose tokens end after the previous one."""
    shared = sorted(set(s_ends) & set(t_ends))
    groups = []
    for lo, hi in zip([0, *shared[:-1]], shared, strict=True):
        rows = [r for r, e in zip(s_rows, s_ends, strict=True) if lo < e <= hi]
        positions = [p for p, e in enumerate(t_ends) if lo < e <= hi]
        groups.append((rows, positions))
    return groups


def _is_utf8(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    return float(np.sum(np.where(p > 0, p * (np.log(np.where(p > 0, p, 1)) - np.log(q)), 0.0)))


def _divergence(t: np.ndarray, s: np.ndarray, divergence: str) -> float:
    if divergence == "forward_kl":
        return _kl(t, s)
    m = JSD_BETA * t + (1 - JSD_BETA) * s
    return JSD_BETA * _kl(t, m) + (1 - JSD_BETA) * _kl(s, m)


class Reference:
    """One response's spans and every loss term, from the full log-probabilities (float64)."""

    def __init__(self, student, teacher, models: dict, ids: list[int], prompt_ids: list[int]) -> None:
        self.ids = ids
        text, s_rows, s_ends, eos_aligned = _student_rows(student, ids)
        t_prompt, t_ids = _teacher_ids(teacher, text, eos_aligned)
        t_pieces = [_bytes_of(teacher, i) or b"" for i in t_ids]
        assert b"".join(t_pieces) == text.encode()
        t_ends = [len(b"".join(t_pieces[: p + 1])) for p in range(len(t_ids) - eos_aligned)]
        self.groups = _groups(s_rows, s_ends, t_ends) if text else []
        if eos_aligned:
            self.groups.append(([len(ids) - 1], [len(t_ids) - 1]))
        self.text, self.eos_aligned, self.t_ids = text, eos_aligned, t_ids
        self.t_lp = models["teacher"].logprobs(t_prompt + t_ids)[len(t_prompt) - 1 :]  # [m, V_t]
        self.s_lp = models["student"].logprobs(prompt_ids + ids)[len(prompt_ids) - 1 :]  # [n, V_s]
        self.old_lp = models["old"].logprobs(prompt_ids + ids)[len(prompt_ids) - 1 :]
        self.student_of = self._student_ids(student, teacher)

    @staticmethod
    def _student_ids(student, teacher) -> dict[int, int]:
        """teacher id -> the student id of the same bytes; the teacher's EOS -> the student's EOS."""
        by_bytes = {}
        for i in range(len(student)):
            b = _bytes_of(student, i)
            if b is not None:
                by_bytes.setdefault(b, i)
        out = {t: by_bytes[b] for t in range(len(teacher)) if (b := _bytes_of(teacher, t)) in by_bytes}
        out[teacher.eos_token_id] = student.eos_token_id
        return out

    def span_len(self) -> list[int]:
        out = [-1] * len(self.ids)
        for rows, _ in self.groups:
            for r in rows[1:]:
                out[r] = 0
            out[rows[0]] = rows[-1] - rows[0] + 1
        return out

    def token_lp(self, lp: np.ndarray, row: int) -> float:
        return float(lp[row, self.ids[row]])

    def teacher_span(self, positions: list[int]) -> float:
        return float(sum(self.t_lp[p, self.t_ids[p]] for p in positions))

    def shared(self, rows: list[int], positions: list[int]) -> list[tuple[int, int]] | None:
        """(teacher id, student id) of the teacher's top-k pieces the student has, for a one-to-one span."""
        if len(rows) != 1 or len(positions) != 1:
            return None
        top = np.argsort(-self.t_lp[positions[0]], kind="stable")[:TOP_K]
        pairs = [(int(t), self.student_of[int(t)]) for t in top if int(t) in self.student_of]
        assert len({s for _, s in pairs}) == len(pairs)
        return pairs or None

    def loss(self, objective: str, divergence: str) -> list[float]:
        """Per span (self.groups' order) its term of the loss."""
        terms = []
        for rows, positions in self.groups:
            total = 0.0
            pairs = self.shared(rows, positions)
            if pairs:
                t = np.exp([self.t_lp[positions[0], a] for a, _ in pairs])
                s = np.exp([self.s_lp[rows[0], b] for _, b in pairs])
                total = _divergence(np.append(t, 1 - t.sum()), np.append(s, 1 - s.sum()), divergence)
            elif objective == "span":
                t_span = np.exp(self.teacher_span(positions))
                s_span = np.exp(sum(self.token_lp(self.s_lp, r) for r in rows))
                total = _divergence(np.array([t_span, 1 - t_span]), np.array([s_span, 1 - s_span]), divergence)
            else:
                t_later = self.teacher_span(positions[1:])
                s_later = sum(self.token_lp(self.s_lp, r) for r in rows[1:])
                teacher = np.sort(np.exp(self.t_lp[positions[0]] + t_later))[::-1][:TOP_K]
                student = np.sort(np.exp(self.s_lp[rows[0]] + s_later))[::-1][:TOP_K]
                total = float(np.abs(teacher - student).sum())
            terms.append(total)
        return terms

    def advantages(self) -> dict[int, tuple[float, float]]:
        """Per aligned row: (its span's log t - log s_old, a float32-rounding bound of the path's value)."""
        out = {}
        for rows, positions in self.groups:
            t_values = [self.t_lp[p, self.t_ids[p]] for p in positions]
            advantage = float(sum(t_values)) - sum(self.token_lp(self.old_lp, r) for r in rows)
            bound = 4 * F32_EPS * (abs(sum(t_values)) + sum(abs(v) for v in t_values)) + 1e-12
            out.update({r: (advantage, bound) for r in rows})
        return out

    def sampled_loss(self) -> float:
        return sum(
            -np.exp(self.token_lp(self.s_lp, r) - self.token_lp(self.old_lp, r)) * a
            for r, (a, _) in self.advantages().items()
        )


def _batch(scored: list, field: str, fill: float, dtype) -> torch.Tensor:
    width = max(len(s.span_len) for s in scored)
    rows = []
    for s in scored:
        value = getattr(s, field) if field != "span_len" else s.span_len
        pad = [(0, width - len(value))] + [(0, 0)] * (value.ndim - 1)
        rows.append(np.pad(value.astype(np.float64), pad, constant_values=fill))
    return torch.tensor(np.stack(rows), dtype=dtype)


def test_every_loss_equals_an_independent_float64_reference(bpe_pair: dict) -> None:
    from recipe_gkd.config import load_config
    from recipe_gkd.cross_tokenizer.route import CrossTokenizerScorer
    from recipe_gkd.data import encode_prompt
    from recipe_gkd.losses import sampled_reverse_kl_loss_sum

    student, teacher = bpe_pair["student"], bpe_pair["teacher"]
    models = {"student": Bigram(len(student), 1), "old": Bigram(len(student), 2), "teacher": Bigram(len(teacher), 3)}
    data = load_config(None, []).data
    record = {data.prompt_key: PROMPT}
    prompt_ids = encode_prompt(student, record, data.prompt_key, True)
    responses = _responses(student)
    route = CrossTokenizerScorer(InProcessTeacher(teacher, models["teacher"]), student, teacher, TOP_K, data)
    sequences = [np.asarray(prompt_ids + r, dtype=np.int32) for r in responses]
    scored = route.score_records(sequences, [len(prompt_ids)] * len(responses), [record] * len(responses))
    refs = [Reference(student, teacher, models, r, prompt_ids) for r in responses]

    # The cases hold what they are meant to: multi-token spans on both sides, a control token inside a span,
    # shared one-to-one spans, an aligned EOS, an EOS after invalid text, cut responses.
    groups = [g for ref in refs for g in ref.groups]
    assert any(len(rows) > 1 and len(positions) > 1 for rows, positions in groups)
    assert any(len(rows) > 1 and len(positions) == 1 for rows, positions in groups)
    assert any(rows[-1] - rows[0] + 1 > len(rows) for rows, _ in groups)
    assert any(ref.shared(*g) for ref in refs for g in ref.groups)
    pieces = [_bytes_of(student, ref.ids[r]) for ref in refs for rows, _ in ref.groups for r in rows]
    assert any(p is not None and not _is_utf8(p) for p in pieces)  # aligned tokens holding part of a character
    assert [ref.eos_aligned for ref in refs] == [True, True, False, False, False, True]
    for ref, s in zip(refs, scored, strict=True):
        assert s.span_len.tolist() == ref.span_len()
        one_to_one = sum(len(r) == 1 and len(p) == 1 for r, p in ref.groups)
        assert s.counts == {
            "one_to_one_tokens": float(one_to_one),
            "shared_spans": float(sum(bool(ref.shared(*g)) for g in ref.groups)),
            "spans": float(len(ref.groups)),
            "aligned_tokens": float(sum(len(r) for r, _ in ref.groups)),
            "response_tokens": float(len(ref.ids)),
        }

    width = max(len(r) for r in responses)
    logits = torch.tensor(
        np.stack([np.pad(ref.s_lp, [(0, width - len(ref.ids)), (0, 0)]) for ref in refs]), requires_grad=True
    )
    targets = torch.tensor([r + [0] * (width - len(r)) for r in responses])
    mask = torch.tensor([[j < len(r) for j in range(width)] for r in responses])
    arrays = {
        "teacher_logprobs_BTK": _batch(scored, "topk_logprobs", 0.0, torch.float64),
        "teacher_ids_BTK": _batch(scored, "topk_ids", -1, torch.long),
        "teacher_tail_BT": _batch(scored, "tail_logmass", 0.0, torch.float64),
        "teacher_span_BT": _batch(scored, "sampled_logprob", 0.0, torch.float64),
        "span_len_BT": _batch(scored, "span_len", -1, torch.long),
    }
    for objective, divergence in [("span", "forward_kl"), ("span", "jsd"), ("uld", "forward_kl")]:
        loss, count = cross_tokenizer_loss_sum(
            logits, targets, *arrays.values(), mask, objective=objective, divergence=divergence, beta=JSD_BETA
        )
        terms = [ref.loss(objective, divergence) for ref in refs]
        assert loss.item() == pytest.approx(sum(map(sum, terms)), rel=LOSS_RTOL), (objective, divergence)
        # Span by span: the loss over one span's rows (the reference's groups) is that span's term.
        for b, ref in enumerate(refs):
            for (rows, _), term in zip(ref.groups, terms[b], strict=True):
                one = torch.zeros_like(mask)
                one[b, rows] = True
                span_loss, _ = cross_tokenizer_loss_sum(
                    logits, targets, *arrays.values(), one, objective=objective, divergence=divergence, beta=JSD_BETA
                )
                assert span_loss.item() == pytest.approx(term, rel=LOSS_RTOL, abs=SPAN_ATOL), (objective, b, rows)
        assert int(count) == sum(len(r) for r in responses)
        # Rows in no span (control tokens, text past the cut, an EOS after invalid text) get no gradient.
        (grad,) = torch.autograd.grad(loss, logits)
        assert grad[arrays["span_len_BT"] == -1].abs().max() == 0

    rollout = torch.tensor(
        np.stack([np.pad(ref.old_lp[np.arange(len(ref.ids)), ref.ids], (0, width - len(ref.ids))) for ref in refs])
    )
    advantage, use, kept = span_advantages(arrays["teacher_span_BT"], rollout, arrays["span_len_BT"], mask)
    for b, ref in enumerate(refs):
        expected_adv = ref.advantages()
        assert kept[b].nonzero().flatten().tolist() == sorted(expected_adv)
        for row, (value, bound) in expected_adv.items():
            got = (
                advantage[b, row].item()
                if use[b, row]
                else (arrays["teacher_span_BT"][b, row] - rollout[b, row]).item()
            )
            assert got == pytest.approx(value, abs=bound), (b, row)
    loss, _, _ = sampled_reverse_kl_loss_sum(
        logits, targets, rollout, arrays["teacher_span_BT"], kept, advantage=advantage, advantage_mask=use
    )
    assert loss.item() == pytest.approx(sum(ref.sampled_loss() for ref in refs), rel=LOSS_RTOL)
