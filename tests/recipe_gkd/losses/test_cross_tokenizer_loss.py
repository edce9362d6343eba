"""The cross-tokenizer losses against an independent float64 reference over the same spans, and equal to the
same-tokenizer losses when the tokenizers are one (algorithm.cross_tokenizer)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from recipe_gkd.batch import EXCLUDED_ID, FOLDED_BASE
from recipe_gkd.cross_tokenizer.align import Span, StudentText
from recipe_gkd.cross_tokenizer.span_scores import aligned_scores
from recipe_gkd.losses import (
    cross_tokenizer_loss_sum,
    gkd_loss_sum,
    sampled_reverse_kl_loss_sum,
    span_advantages,
)
from teacher_server.wire.protocol import TeacherScores

B, T, V, K = 3, 9, 23, 5
DIVERGENCES = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)]


def _teacher_topk(gen: torch.Generator, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random teacher distribution's top-k log-probs, ids (in [0, V)) and exact tail, float64."""
    logits = torch.randn(rows, V, generator=gen, dtype=torch.float64) * 2
    logprobs = torch.log_softmax(logits, dim=-1)
    values, ids = logprobs.topk(K, dim=-1)
    rest = logprobs.scatter(-1, ids, -math.inf).logsumexp(dim=-1)
    return values, ids, rest


@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCES)
@pytest.mark.parametrize("objective", ["span", "uld"])
def test_identical_tokenizers_give_the_same_tokenizer_loss(divergence: str, beta: float, objective: str) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64, requires_grad=True)
    values, ids, tail = _teacher_topk(gen, B * T)
    values, ids, tail = values.view(B, T, K), ids.view(B, T, K), tail.view(B, T)
    mask = torch.rand(B, T, generator=gen) > 0.2
    targets = torch.randint(0, V, (B, T), generator=gen)
    same, _ = gkd_loss_sum(
        logits, values, ids, mask, divergence=divergence, beta=beta, teacher_tail_logmass=tail, temperature=1.3
    )
    # Through the route: every span one token on each side, every piece shared (the identity map).
    spans = [Span(j, j + 1, j, j + 1) for j in range(T)]
    text = StudentText("", np.zeros((T, 2), np.int32), np.ones(T, bool), False)
    cols, span_len = [], []
    for b in range(B):
        reply = TeacherScores(
            values[b].float().numpy(), ids[b].int().numpy(), np.zeros(T, np.float32), tail[b].float().numpy()
        )
        scored = aligned_scores(text, spans, reply, np.arange(V), K)
        assert np.array_equal(scored.topk_ids, ids[b].numpy()) and np.array_equal(
            scored.tail_logmass, reply.tail_logmass
        )
        assert scored.counts["shared_spans"] == T == scored.counts["one_to_one_tokens"]
        cols.append(torch.from_numpy(scored.topk_ids).long())
        span_len.append(torch.from_numpy(scored.span_len).long())
    cross, count = cross_tokenizer_loss_sum(
        logits,
        targets,
        values,
        torch.stack(cols),
        tail,
        torch.zeros(B, T, dtype=torch.float64),
        torch.stack(span_len),
        mask,
        objective=objective,
        divergence=divergence,
        beta=beta,
        temperature=1.3,
    )
    assert int(count) == int(mask.sum())
    torch.testing.assert_close(cross, same, rtol=0, atol=0)
    (g_cross,) = torch.autograd.grad(cross, logits)
    (g_same,) = torch.autograd.grad(same, logits)
    torch.testing.assert_close(g_cross, g_same, rtol=0, atol=0)


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    return float(sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q, strict=True) if pi > 0))


def _divergence(t: np.ndarray, s: np.ndarray, divergence: str, beta: float) -> float:
    t, s = t / t.sum(), s / s.sum()
    if divergence == "forward_kl":
        return _kl(t, s)
    if divergence == "reverse_kl":
        return _kl(s, t)
    m = beta * t + (1 - beta) * s
    return beta * _kl(t, m) + (1 - beta) * _kl(s, m)


def _random_spans(gen: np.random.Generator) -> list[list[int]]:
    """Per row, the span lengths tiling the first positions (the rest unaligned or padding)."""
    rows = []
    for _ in range(B):
        lengths, used = [], 0
        while used < T - 2:
            n = int(gen.choice([1, 1, 2, 3]))
            n = min(n, T - 2 - used)
            lengths.append(n)
            used += n
        rows.append(lengths)
    return rows


@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCES)
@pytest.mark.parametrize("objective", ["span", "uld"])
def test_loss_matches_an_independent_float64_reference(divergence: str, beta: float, objective: str) -> None:
    gen = np.random.default_rng(7)
    logits = torch.tensor(gen.normal(size=(B, T, V)) * 1.5, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor(gen.integers(0, V, size=(B, T)))
    t_values = np.sort(np.log(gen.dirichlet(np.ones(V) * 0.3, size=(B, T)))[..., :K], axis=-1)[..., ::-1].copy()
    t_ids = np.stack([np.stack([gen.permutation(V)[:K] for _ in range(T)]) for _ in range(B)])
    t_tail = np.log(np.clip(1 - np.exp(t_values).sum(-1), 1e-6, None))
    t_span = -gen.uniform(0.05, 4.0, size=(B, T))
    span_len = np.full((B, T), -1)
    kinds = {}
    for b, lengths in enumerate(_random_spans(gen)):
        t = 0
        for n in lengths:
            span_len[b, t : t + n] = 0
            span_len[b, t] = n
            if n == 1 and gen.random() < 0.6:  # shared: some pieces folded (the student lacks them)
                folded = gen.random(K) < 0.4
                folded[0] = False
                t_ids[b, t] = np.where(folded, FOLDED_BASE + np.arange(K), t_ids[b, t])
                kinds[(b, t)] = "shared"
            else:
                t_ids[b, t] = EXCLUDED_ID
                kinds[(b, t)] = "span"
            t += n
    mask = np.ones((B, T), bool)
    mask[2, T - 1] = False
    loss, _ = cross_tokenizer_loss_sum(
        logits,
        targets,
        torch.tensor(t_values),
        torch.tensor(t_ids),
        torch.tensor(t_tail),
        torch.tensor(t_span),
        torch.tensor(span_len),
        torch.tensor(mask),
        objective=objective,
        divergence=divergence,
        beta=beta,
    )
    # Reference: numpy float64, span by span.
    probs = torch.softmax(logits.detach(), dim=-1).numpy()
    expected = 0.0
    for (b, t), kind in kinds.items():
        n = span_len[b, t]
        if kind == "shared":
            ids = t_ids[b, t]
            real = ids < FOLDED_BASE
            t_p = np.exp(t_values[b, t])
            teacher = np.append(t_p[real], np.exp(t_tail[b, t]) + t_p[~real].sum())
            student_cols = probs[b, t, ids[real]]
            student = np.append(student_cols, 1 - student_cols.sum())
            expected += _divergence(teacher, student, divergence, beta)
            continue
        token_p = [probs[b, t + j, targets[b, t + j]] for j in range(n)]
        if objective == "span":
            s_span, t_sp = float(np.prod(token_p)), math.exp(t_span[b, t])
            expected += _divergence(np.array([t_sp, 1 - t_sp]), np.array([s_span, 1 - s_span]), divergence, beta)
        else:
            merged = np.sort(probs[b, t] * np.prod(token_p[1:]))[::-1][:K]
            teacher = np.sort(np.exp(t_values[b, t]))[::-1]
            expected += float(np.abs(merged - teacher).sum())
    assert loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    # Positions that start no span (inside one: only through the span sum; unaligned: none) never get a divergence.
    assert grad[span_len == -1].abs().max() == 0


def test_sampled_advantage_is_the_spans() -> None:
    gen = torch.Generator().manual_seed(1)
    # Near-certain student tokens (s_old ~ 1) and a span the teacher likes more: a positive advantage, which no
    # per-token "teacher logprob" rollout + A <= 0 could carry (the demo run found that).
    rollout = -torch.rand(1, 6, generator=gen, dtype=torch.float64) * 0.01 - torch.tensor([[0, 0, 0, 2.0, 1.5, 0]])
    span_len = torch.tensor([[2, 0, 1, 3, 0, 0]])
    teacher_span = torch.tensor([[-0.9, 0.0, -0.2, -1.7, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 6, dtype=torch.bool)
    advantage, use, kept = span_advantages(teacher_span, rollout, span_len, mask)
    r = rollout[0]
    expected = [-0.9 - r[0] - r[1]] * 2 + [None] + [-1.7 - r[3] - r[4] - r[5]] * 3
    assert use[0].tolist() == [e is not None for e in expected] and kept.all()
    for got, want in zip(advantage[0].tolist(), expected, strict=True):
        if want is not None:
            assert got == pytest.approx(float(want), abs=1e-12)
    assert advantage[0, 3] > 0
    logits = torch.randn(1, 6, V, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (1, 6), generator=gen)
    loss, _, stats = sampled_reverse_kl_loss_sum(
        logits, targets, rollout, teacher_span, kept, advantage=advantage, advantage_mask=use
    )
    # Reference: the surrogate -ratio * A per token, A the span's (one-token span: log t - log s_old).
    logprob = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]
    a = torch.where(use, advantage, teacher_span - rollout)
    torch.testing.assert_close(loss, (-(logprob - rollout).exp() * a).sum())
    assert float(stats.advantage_sum) == pytest.approx(float(a.sum()))
    # One-token spans everywhere: exactly the same-tokenizer step.
    ones = torch.ones(1, 6, dtype=torch.long)
    advantage, use, kept = span_advantages(teacher_span, rollout, ones, mask)
    assert not use.any()
    same = sampled_reverse_kl_loss_sum(
        logits, targets, rollout, teacher_span, kept, advantage=advantage, advantage_mask=use
    )[0]
    plain = sampled_reverse_kl_loss_sum(logits, targets, rollout, teacher_span, mask)[0]
    torch.testing.assert_close(same, plain, rtol=0, atol=0)
    # An unaligned token leaves the loss.
    _, _, kept = span_advantages(teacher_span, rollout, torch.tensor([[1, -1, 1, 1, 1, 1]]), mask)
    assert kept.tolist() == [[True, False, True, True, True, True]]


class _InProcessTeacher:
    """The server's text path in this process: the replica's rendering, then the hf backend."""

    def __init__(self, model_dir) -> None:
        from transformers import AutoTokenizer

        from teacher_server.server.backends import BackendOptions, load_backend
        from teacher_server.wire.conversation import Renderer

        self.renderer = Renderer(AutoTokenizer.from_pretrained(model_dir))
        self.backend = load_backend("hf", BackendOptions(str(model_dir), max_top_k=64))

    def score_conversations(self, conversations):
        import dataclasses

        from teacher_server.server.backends import parsed_request

        out = []
        for conversation in conversations:
            r = self.renderer.render(conversation)
            scored = self.backend.score(parsed_request([r.ids], [r.score_from], top_k=8)).split()[0]
            out.append(dataclasses.replace(scored, token_ids=r.ids[r.score_from :], byte_offsets=r.byte_offsets))
        return out


def test_the_route_with_one_tokenizer_gives_the_same_tokenizer_arrays(tiny_model_dir) -> None:
    """Through the text route (render, score, align, map) a teacher of the student's own tokenizer gives exactly the
    arrays the token-id route gives: with the loss test above, the same loss."""
    from transformers import AutoTokenizer

    from recipe_gkd.config import load_config
    from recipe_gkd.cross_tokenizer.route import CrossTokenizerScorer
    from recipe_gkd.data import encode_prompt
    from teacher_server.server.backends import parsed_request

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = load_config(None, []).data
    teacher = _InProcessTeacher(tiny_model_dir)
    records = [{"prompt": "rev:hello"}, {"prompt": "rev:abc"}]
    responses = [tok("olleh", add_special_tokens=False)["input_ids"] + [tok.eos_token_id], tok("cb a")["input_ids"]]
    prompts = [encode_prompt(tok, r, "prompt", True) for r in records]
    sequences = [np.asarray(p + r, dtype=np.int32) for p, r in zip(prompts, responses, strict=True)]
    starts = [len(p) for p in prompts]
    route = CrossTokenizerScorer(teacher, tok, tok, 8, data)
    crossed = route.score_records(sequences, starts, records)
    # One sequence per forward on both routes (a padded batch rounds differently).
    direct = [
        teacher.backend.score(parsed_request([q], [f], top_k=8)).split()[0]
        for q, f in zip(sequences, starts, strict=True)
    ]
    for c, d, response in zip(crossed, direct, responses, strict=True):
        assert c.span_len.tolist() == [1] * len(response)
        for field in ("topk_logprobs", "topk_ids", "tail_logmass", "sampled_logprob"):
            assert np.array_equal(getattr(c, field), getattr(d, field)), field
        assert c.counts["shared_spans"] == c.counts["spans"] == len(response)
