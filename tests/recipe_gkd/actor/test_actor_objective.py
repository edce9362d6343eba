"""The actor's objective split by teacher (several teachers): each teacher's rows alone, without gradient."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from target_kinds import kinds

from recipe_gkd.actor.collate import collate
from recipe_gkd.actor.objective import ActorObjective
from recipe_gkd.batch import ScoredSequence
from recipe_gkd.config import CONFIG_DIR, load_config
from recipe_gkd.parallel_layout import ParallelLayout

PAD, VOCAB, TOP_K = 0, 102, 8
PRESET = CONFIG_DIR / "presets" / "cpu_two_teachers.yaml"


def sequence(sample_id: int, teacher: str, length: int, response_start: int) -> ScoredSequence:
    """A scored sequence whose teacher top-k is a real distribution's (descending logprobs, distinct ids)."""
    rng = np.random.default_rng(sample_id)
    n = length - response_start
    logits_NV = rng.standard_normal((n, VOCAB)) * 3
    logprobs_NV = logits_NV - np.logaddexp.reduce(logits_NV, axis=1, keepdims=True)
    ids_NK = np.argsort(-logprobs_NV, axis=1)[:, :TOP_K]
    top_NK = np.take_along_axis(logprobs_NV, ids_NK, 1)
    tail_N = np.log1p(-np.exp(np.logaddexp.reduce(top_NK, axis=1)))
    return ScoredSequence(
        sample_id=sample_id,
        input_ids=rng.integers(3, VOCAB, length).astype(np.int32),
        response_start=response_start,
        on_policy=True,
        teacher_topk_logprobs=top_NK.astype(np.float32),
        teacher_topk_ids=ids_NK.astype(np.int32),
        teacher_tail_logmass=tail_N.astype(np.float32),
        teacher_sampled_logprob=-rng.random(n).astype(np.float32),
        teacher=teacher,
    )


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_teacher_sums_equal_each_teachers_rows_scored_alone(divergence: str) -> None:
    cfg = load_config(PRESET, [f"algorithm.divergence={divergence}"])
    layout = ParallelLayout()
    objective = ActorObjective(
        cfg, VOCAB, layout, torch.device("cpu"), tp_group=None, pp_group=None, dp_group=None, **kinds(cfg)
    )  # type: ignore[arg-type]
    assert objective.teacher_names == ["reverse", "sum"]
    teachers = ["sum", "reverse", "sum", "sum", "reverse"]
    seqs = [sequence(i, t, length=9 + 2 * i, response_start=4 + i % 3) for i, t in enumerate(teachers)]
    micro = collate(seqs, PAD, objective.teacher_names)
    assert micro.teacher_index_B is not None and micro.teacher_index_B.tolist() == [1, 0, 1, 1, 0]
    torch.manual_seed(0)
    logits_BTV = torch.randn(*micro.input_ids_BT.shape, VOCAB, requires_grad=True)
    loss_sum, _, logged = objective.train_loss(micro, logits_BTV)
    sums = logged["teacher_sums"]
    for i, name in enumerate(objective.teacher_names):
        rows = [b for b, t in enumerate(teachers) if t == name]
        alone = collate([seqs[b] for b in rows], PAD)
        want, _ = objective.loss_sum(logits_BTV[rows, : alone.input_ids_BT.shape[1]], alone)
        assert sums[i].item() == pytest.approx(want.item(), rel=1e-6)
        assert sums[2 + i].item() == alone.num_tokens
    # The teachers' sums make the micro-batch's; the gradient comes from the loss alone.
    assert sums[:2].sum().item() == pytest.approx(loss_sum.item(), rel=1e-6)
    assert not sums.requires_grad and loss_sum.requires_grad


def test_a_teacher_without_rows_in_the_micro_batch_counts_nothing() -> None:
    cfg = load_config(PRESET)
    layout = ParallelLayout()
    objective = ActorObjective(
        cfg, VOCAB, layout, torch.device("cpu"), tp_group=None, pp_group=None, dp_group=None, **kinds(cfg)
    )  # type: ignore[arg-type]
    micro = collate([sequence(0, "reverse", 10, 4), sequence(1, "reverse", 8, 3)], PAD, objective.teacher_names)
    logits_BTV = torch.randn(*micro.input_ids_BT.shape, VOCAB)
    sums = objective.teacher_sums(logits_BTV, micro)
    assert sums[1].item() == 0 and sums[3].item() == 0 and sums[2].item() == micro.num_tokens
    with pytest.raises(ValueError, match="teacher index"):
        objective.teacher_sums(logits_BTV, dataclasses.replace(micro, teacher_index_B=None))
    with pytest.raises(ValueError, match=r"teachers \['other'\]"):
        collate([sequence(2, "other", 8, 3)], PAD, objective.teacher_names)
