"""algorithm.support=union against independent float64 references.

The teacher's side goes through what production uses: the reference scorer (scores_from_logprobs,
what a backend returns for named ids) and the union target's merge (recipe_gkd/targets/union.py union_scores).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recipe_gkd.batch import EXCLUDED_ID
from recipe_gkd.losses import DIVERGENCES, gkd_loss
from recipe_gkd.targets.union import union_scores
from teacher_server.wire.protocol import TeacherScores, scores_from_logprobs

pytestmark = pytest.mark.timeout(120)

BATCH, SEQ, VOCAB, TOP_K = 2, 5, 11, 3
# float64 end to end: the only differences are summation order over <= V terms.
TOL = 1e-10


def _inputs(seed: int) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    student_BTV = 2.0 * torch.randn(BATCH, SEQ, VOCAB, generator=gen, dtype=torch.float64)
    teacher_BTV = (2.0 * torch.randn(BATCH, SEQ, VOCAB, generator=gen, dtype=torch.float64)).log_softmax(-1)
    mask_BT = torch.rand(BATCH, SEQ, generator=gen) > 0.3
    mask_BT[0, 0] = True
    return student_BTV, teacher_BTV.numpy(), mask_BT


def _union_tensors(
    student_BTV: torch.Tensor, teacher_BTV: np.ndarray, k_s: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the actor receives with union support: [B,T,K+k_s] logprobs and ids, [B,T] tail (float64)."""
    logprobs, ids, tails = [], [], []
    student_ids_NS = student_BTV.reshape(-1, VOCAB).topk(k_s, dim=-1).indices.numpy().astype(np.int32)
    teacher_NV = teacher_BTV.reshape(-1, VOCAB)
    next_ids = np.zeros(teacher_NV.shape[0], dtype=np.int64)
    reply = scores_from_logprobs(teacher_NV, next_ids, TOP_K, named_ids_NS=student_ids_NS)
    # scores_from_logprobs returns float32 like the wire; recompute in float64 for a 1e-10 comparison.
    named64 = np.take_along_axis(teacher_NV, student_ids_NS.astype(np.int64), axis=1)
    top64 = np.take_along_axis(teacher_NV, reply.topk_ids.astype(np.int64), axis=1)
    rest = teacher_NV.copy()
    np.put_along_axis(rest, reply.topk_ids.astype(np.int64), -np.inf, axis=1)
    np.put_along_axis(rest, student_ids_NS.astype(np.int64), -np.inf, axis=1)
    with np.errstate(divide="ignore"):
        other64 = np.logaddexp.reduce(rest, axis=1)
    reply64 = TeacherScores(top64, reply.topk_ids, reply.sampled_logprob, reply.tail_logmass, named64, other64)
    merged = union_scores(reply64, student_ids_NS)
    logprobs.append(merged.topk_logprobs.astype(np.float64))
    ids.append(merged.topk_ids)
    tails.append(np.asarray(merged.tail_logmass, dtype=np.float64))
    width = TOP_K + k_s
    return (
        torch.from_numpy(np.concatenate(logprobs)).reshape(BATCH, SEQ, width),
        torch.from_numpy(np.concatenate(ids).astype(np.int64)).reshape(BATCH, SEQ, width),
        torch.from_numpy(np.concatenate(tails)).reshape(BATCH, SEQ),
    )


def _divergence(t: torch.Tensor, s: torch.Tensor, divergence: str, beta: float) -> torch.Tensor:
    """Between probability vectors on the last axis, from the definitions (0 log 0 = 0)."""

    def kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.where(a > 0, a * (a.clamp_min(1e-300).log() - b.clamp_min(1e-300).log()), 0.0).sum(-1)

    if divergence == "forward_kl":
        return kl(t, s)
    if divergence == "reverse_kl":
        return kl(s, t)
    m = beta * t + (1 - beta) * s
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


def _reference(
    student_BTV: torch.Tensor, teacher_BTV: np.ndarray, mask_BT: torch.Tensor, groups_BTV: np.ndarray | None, **kw
) -> torch.Tensor:
    """Token mean of the divergence over a partition of the vocabulary (None: every id is its own outcome).

    groups_BTV[b, t, v] = the outcome id v falls in; outcomes are summed probabilities.
    """
    s = student_BTV.softmax(-1)
    t = torch.from_numpy(teacher_BTV).exp()
    if groups_BTV is not None:
        index = torch.from_numpy(groups_BTV)
        s = torch.zeros_like(s).scatter_add(-1, index, s)
        t = torch.zeros_like(t).scatter_add(-1, index, t)
    per_token = _divergence(t, s, kw["divergence"], kw.get("beta", 0.5))
    return per_token[mask_BT].sum() / mask_BT.sum()


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_union_with_every_student_id_is_the_full_divergence(divergence: str) -> None:
    """k_s = V: the union covers the vocabulary, so the loss and its gradient are the full-vocabulary ones."""
    student_BTV, teacher_BTV, mask_BT = _inputs(seed=1)
    logprobs, ids, tail = _union_tensors(student_BTV, teacher_BTV, k_s=VOCAB)
    assert (ids == EXCLUDED_ID).sum() == TOP_K * BATCH * SEQ  # every teacher id is repeated once by the student
    got_leaf = student_BTV.clone().requires_grad_(True)
    got = gkd_loss(got_leaf, logprobs, ids, mask_BT, divergence=divergence, teacher_tail_logmass=tail, chunk_size=3)
    got.backward()
    ref_leaf = student_BTV.clone().requires_grad_(True)
    ref = _reference(ref_leaf, teacher_BTV, mask_BT, None, divergence=divergence)
    ref.backward()
    assert got.item() == pytest.approx(ref.item(), abs=TOL)
    assert got_leaf.grad is not None and ref_leaf.grad is not None
    torch.testing.assert_close(got_leaf.grad, ref_leaf.grad, atol=TOL, rtol=0)


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_union_is_exact_over_its_partition(divergence: str) -> None:
    """k_s < V: the divergence between the two distributions over {teacher ids} + {student ids} + one rest."""
    k_s = 4
    student_BTV, teacher_BTV, mask_BT = _inputs(seed=2)
    logprobs, ids, tail = _union_tensors(student_BTV, teacher_BTV, k_s=k_s)
    # The partition: each id in the union is its own outcome, every other id falls in outcome VOCAB.
    groups = np.full((BATCH, SEQ, VOCAB + 1), VOCAB, dtype=np.int64)[..., :VOCAB].copy()
    for b in range(BATCH):
        for t in range(SEQ):
            for v in ids[b, t].tolist():
                if v != EXCLUDED_ID:
                    groups[b, t, v] = v
    # VOCAB + 1 outcomes: pad the probability vectors by one column.
    student_pad = torch.cat([student_BTV, torch.full((BATCH, SEQ, 1), -torch.inf, dtype=torch.float64)], -1)
    teacher_pad = np.concatenate([teacher_BTV, np.full((BATCH, SEQ, 1), -np.inf)], -1)
    groups_pad = np.concatenate([groups, np.full((BATCH, SEQ, 1), VOCAB)], -1)
    got_leaf = student_BTV.clone().requires_grad_(True)
    got = gkd_loss(got_leaf, logprobs, ids, mask_BT, divergence=divergence, teacher_tail_logmass=tail)
    got.backward()
    ref_leaf = student_pad.clone().requires_grad_(True)
    ref = _reference(ref_leaf, teacher_pad, mask_BT, groups_pad, divergence=divergence)
    ref.backward()
    assert got.item() == pytest.approx(ref.item(), abs=TOL)
    assert got_leaf.grad is not None and ref_leaf.grad is not None
    torch.testing.assert_close(got_leaf.grad, ref_leaf.grad[..., :VOCAB], atol=TOL, rtol=0)


def test_union_scores_counts_each_id_once() -> None:
    reply = TeacherScores(
        topk_logprobs=np.log(np.array([[0.5, 0.2]], np.float32)),
        topk_ids=np.array([[7, 3]], np.int32),
        sampled_logprob=np.zeros(1, np.float32),
        tail_logmass=np.log(np.array([0.3], np.float32)),
        named_logprobs=np.log(np.array([[0.2, 0.1, 0.1]], np.float32)),
        other_logmass=np.log(np.array([0.2], np.float32)),
    )
    merged = union_scores(reply, np.array([[3, 5, 5]], np.int32))
    np.testing.assert_array_equal(merged.topk_ids, [[7, 3, EXCLUDED_ID, 5, EXCLUDED_ID]])
    assert np.isneginf(merged.topk_logprobs[0, [2, 4]]).all()
    np.testing.assert_allclose(np.exp(merged.topk_logprobs).sum() + np.exp(merged.tail_logmass), 1.0, rtol=1e-6)
