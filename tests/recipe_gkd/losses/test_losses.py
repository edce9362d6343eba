"""recipe_gkd.losses against independent float64 references (full-vocabulary softmax, explicit K+1 outcomes)."""

from __future__ import annotations

import math

import pytest
import torch

from recipe_gkd.losses import DIVERGENCES, gkd_loss, gkd_loss_sum, topk_divergence

pytestmark = pytest.mark.timeout(120)

BETAS = (0.0, 0.1, 0.5, 0.9, 1.0)
EXACT_TOL = 1e-10


# ----------------------------------------------------------------------------- inputs and references


def make_inputs(
    batch: int = 2,
    seq: int = 6,
    vocab: int = 13,
    top_k: int = 4,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    logit_scale: float = 2.0,
) -> dict[str, torch.Tensor]:
    """Random student logits, a random teacher's top-k (full-vocab log-probs) and a mask with some holes."""
    gen = torch.Generator().manual_seed(seed)
    student_logits_BTV = logit_scale * torch.randn(batch, seq, vocab, generator=gen, dtype=torch.float64)
    teacher_full_logprobs_BTV = (
        logit_scale * torch.randn(batch, seq, vocab, generator=gen, dtype=torch.float64)
    ).log_softmax(-1)
    # Random top-k ids (not the teacher's largest: the loss must be right for any id set), in random order.
    teacher_ids_BTK = torch.rand(batch, seq, vocab, generator=gen).argsort(dim=-1)[..., :top_k]
    loss_mask_BT = torch.rand(batch, seq, generator=gen) > 0.3
    loss_mask_BT[0, 0] = True
    loss_mask_BT[-1, -1] = False
    return {
        "student_logits": student_logits_BTV.to(dtype),
        "teacher_topk_logprobs": teacher_full_logprobs_BTV.gather(-1, teacher_ids_BTK).to(dtype),
        "teacher_topk_ids": teacher_ids_BTK,
        "loss_mask": loss_mask_BT,
        "teacher_full_logprobs": teacher_full_logprobs_BTV,
    }


def loss_args(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return (inputs["student_logits"], inputs["teacher_topk_logprobs"], inputs["teacher_topk_ids"], inputs["loss_mask"])


def reference_divergence(p: torch.Tensor, q: torch.Tensor, divergence: str, beta: float) -> torch.Tensor:
    """Divergence between probability vectors (last axis), written straight from the definitions."""

    def kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * torch.log(a / b)).sum(-1)

    if divergence == "forward_kl" or (divergence == "jsd" and beta == 0.0):
        return kl(p, q)
    if divergence == "reverse_kl" or (divergence == "jsd" and beta == 1.0):
        return kl(q, p)
    mixture = beta * p + (1.0 - beta) * q
    return beta * kl(p, mixture) + (1.0 - beta) * kl(q, mixture)


def reference_full_vocab(student_logits_BTV, teacher_full_logprobs_BTV, loss_mask_BT, divergence, beta, temperature):
    """Full-vocabulary divergence in float64, token mean over the mask."""
    q = torch.softmax(student_logits_BTV.double() / temperature, dim=-1)
    p = teacher_full_logprobs_BTV.double().exp()
    return reference_divergence(p, q, divergence, beta)[loss_mask_BT].mean()


def reference_k_plus_1(
    student_logits_BTV, teacher_logprobs_BTK, teacher_ids_BTK, loss_mask_BT, divergence, beta, temperature
):
    """Explicit K+1-outcome distributions in float64: top-k probabilities then 1 - their sum."""
    q_full = torch.softmax(student_logits_BTV.double() / temperature, dim=-1)
    q_top = q_full.gather(-1, teacher_ids_BTK)
    p_top = teacher_logprobs_BTK.double().exp()
    p = torch.cat([p_top, 1.0 - p_top.sum(-1, keepdim=True)], dim=-1)
    q = torch.cat([q_top, 1.0 - q_top.sum(-1, keepdim=True)], dim=-1)
    return reference_divergence(p, q, divergence, beta)[loss_mask_BT].mean()


def value_and_grad(fn, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.detach().clone().requires_grad_(True)
    value = fn(logits)
    (grad,) = torch.autograd.grad(value, logits)
    return value.detach(), grad


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("tail", [False, True])
def test_full_vocab_topk_equals_full_vocab_reference(divergence: str, beta: float, tail: bool) -> None:
    vocab = 11
    inputs = make_inputs(vocab=vocab, top_k=vocab, seed=1)  # K == V: the tail is empty, tail=True drops it
    temperature = 0.7
    ours, ours_grad = value_and_grad(
        lambda s: gkd_loss(
            s, *loss_args(inputs)[1:], divergence=divergence, beta=beta, temperature=temperature, tail=tail
        ),
        inputs["student_logits"],
    )
    ref, ref_grad = value_and_grad(
        lambda s: reference_full_vocab(
            s, inputs["teacher_full_logprobs"], inputs["loss_mask"], divergence, beta, temperature
        ),
        inputs["student_logits"],
    )
    assert ref > 1e-3
    assert abs(ours - ref) <= EXACT_TOL
    assert torch.allclose(ours_grad, ref_grad, rtol=0.0, atol=EXACT_TOL)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_tail_equals_k_plus_1_reference(divergence: str, beta: float) -> None:
    inputs = make_inputs(vocab=17, top_k=5, seed=2)
    temperature = 1.3
    ours, ours_grad = value_and_grad(
        lambda s: gkd_loss(s, *loss_args(inputs)[1:], divergence=divergence, beta=beta, temperature=temperature),
        inputs["student_logits"],
    )
    ref, ref_grad = value_and_grad(
        lambda s: reference_k_plus_1(s, *loss_args(inputs)[1:], divergence, beta, temperature),
        inputs["student_logits"],
    )
    assert ref > 1e-3
    assert abs(ours - ref) <= EXACT_TOL
    assert torch.allclose(ours_grad, ref_grad, rtol=0.0, atol=EXACT_TOL)


def test_topk_without_tail_is_renormalised_topk_reference() -> None:
    """tail=False at K < V: both sides restricted to the teacher's ids and renormalised there."""
    inputs = make_inputs(vocab=17, top_k=5, seed=3)
    student, teacher_lp, ids, mask = loss_args(inputs)
    for divergence in DIVERGENCES:
        ours = gkd_loss(*loss_args(inputs), divergence=divergence, beta=0.3, tail=False)
        q = torch.softmax(student, -1).gather(-1, ids)
        p = teacher_lp.exp()
        ref = reference_divergence(p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True), divergence, 0.3)[
            mask
        ].mean()
        assert abs(ours - ref) <= EXACT_TOL


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_gradcheck_float64(divergence: str, tail: bool) -> None:
    inputs = make_inputs(batch=2, seq=3, vocab=7, top_k=3, seed=4, logit_scale=1.0)
    student = inputs["student_logits"].detach().clone().requires_grad_(True)

    def fn(logits: torch.Tensor) -> torch.Tensor:
        return gkd_loss(
            logits, *loss_args(inputs)[1:], divergence=divergence, beta=0.4, temperature=0.9, tail=tail, chunk_size=2
        )

    assert torch.autograd.gradcheck(fn, (student,), eps=1e-6, atol=1e-8, rtol=1e-6)


# ----------------------------------------------------------------------------- properties


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_non_negative(divergence: str) -> None:
    for seed in range(5):
        for scale in (0.1, 1.0, 5.0):
            inputs = make_inputs(vocab=19, top_k=6, seed=seed, logit_scale=scale)
            for tail in (True, False):
                for beta in BETAS:
                    loss = gkd_loss(*loss_args(inputs), divergence=divergence, beta=beta, tail=tail)
                    assert loss >= 0.0, (seed, scale, tail, beta, loss)


def test_per_token_divergence_non_negative() -> None:
    gen = torch.Generator().manual_seed(5)
    p_logprobs = torch.randn(64, 9, generator=gen, dtype=torch.float64).log_softmax(-1)
    q_logprobs = (3 * torch.randn(64, 9, generator=gen, dtype=torch.float64)).log_softmax(-1)
    for divergence in DIVERGENCES:
        for beta in BETAS:
            per_token = topk_divergence(p_logprobs, q_logprobs, divergence=divergence, beta=beta)
            assert per_token.shape == (64,)
            assert (per_token > 0).all()


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_zero_when_student_equals_teacher(divergence: str) -> None:
    inputs = make_inputs(vocab=13, top_k=5, seed=6)
    # Student logits = the teacher's full log-probs: the same distribution over all V.
    same = dict(inputs, student_logits=inputs["teacher_full_logprobs"].clone())
    for beta in BETAS:
        no_tail = gkd_loss(*loss_args(same), divergence=divergence, beta=beta, tail=False)
        with_tail = gkd_loss(*loss_args(same), divergence=divergence, beta=beta, tail=True)
        if divergence != "jsd" or beta in (0.0, 1.0):
            # Both sides go through the same log_softmax: bitwise-equal log-probs, an exact 0.
            assert no_tail == 0.0
        assert abs(no_tail) <= 1e-15
        assert abs(with_tail) <= 1e-15
        # And clearly positive when they differ.
        assert gkd_loss(*loss_args(inputs), divergence=divergence, beta=beta) > 1e-3


def test_jsd_endpoints_follow_trl() -> None:
    inputs = make_inputs(vocab=13, top_k=5, seed=7)
    forward = gkd_loss(*loss_args(inputs), divergence="forward_kl")
    reverse = gkd_loss(*loss_args(inputs), divergence="reverse_kl")
    assert gkd_loss(*loss_args(inputs), divergence="jsd", beta=0.0) == forward
    assert gkd_loss(*loss_args(inputs), divergence="jsd", beta=1.0) == reverse
    # The endpoints are the limits of JSD(beta)/beta and JSD(beta)/(1 - beta).
    small = 1e-6
    assert math.isclose(gkd_loss(*loss_args(inputs), divergence="jsd", beta=small) / small, forward, rel_tol=1e-4)
    assert math.isclose(gkd_loss(*loss_args(inputs), divergence="jsd", beta=1 - small) / small, reverse, rel_tol=1e-4)


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_masked_positions_contribute_exactly_zero(divergence: str, tail: bool) -> None:
    inputs = make_inputs(batch=3, seq=5, vocab=11, top_k=4, seed=8)
    student, teacher_lp, ids, mask = loss_args(inputs)
    masked = ~mask
    assert masked.any()

    def fn(s: torch.Tensor, t_lp: torch.Tensor, t_ids: torch.Tensor) -> torch.Tensor:
        return gkd_loss(s, t_lp, t_ids, mask, divergence=divergence, tail=tail, chunk_size=3)

    loss, grad = value_and_grad(lambda s: fn(s, teacher_lp, ids), student)
    # Garbage at masked positions: huge logits, NaN teacher log-probs, repeated and out-of-vocab ids.
    student2, teacher_lp2, ids2 = student.clone(), teacher_lp.clone(), ids.clone()
    student2[masked] = 1e4 * torch.randn_like(student2[masked])
    teacher_lp2[masked] = math.nan
    ids2[masked] = 10**6
    loss2, grad2 = value_and_grad(lambda s: fn(s, teacher_lp2, ids2), student2)
    assert torch.equal(loss, loss2)
    assert torch.equal(grad, grad2)
    assert (grad2[masked] == 0).all()
    assert (grad2[mask].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_all_masked_returns_zero_not_nan(divergence: str, tail: bool) -> None:
    inputs = make_inputs(seed=9)
    student, teacher_lp, ids, mask = loss_args(inputs)
    none = torch.zeros_like(mask)
    loss, grad = value_and_grad(lambda s: gkd_loss(s, teacher_lp, ids, none, divergence=divergence, tail=tail), student)
    assert loss.item() == 0.0
    assert (grad == 0).all()
    loss_sum, count = gkd_loss_sum(student, teacher_lp, ids, none, divergence=divergence, tail=tail)
    assert loss_sum.item() == 0.0 and count.item() == 0


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_bf16_inputs_agree_with_fp32(divergence: str) -> None:
    inputs = make_inputs(batch=2, seq=16, vocab=1000, top_k=32, seed=10, dtype=torch.float32)
    student, teacher_lp, ids, mask = loss_args(inputs)
    for tail in (True, False):
        fp32, fp32_grad = value_and_grad(
            lambda s, t=tail: gkd_loss(s, teacher_lp, ids, mask, divergence=divergence, tail=t), student
        )
        bf16, bf16_grad = value_and_grad(
            lambda s, t=tail: gkd_loss(s, teacher_lp.bfloat16(), ids, mask, divergence=divergence, tail=t),
            student.bfloat16(),
        )
        assert bf16.dtype == torch.float32 and bf16_grad.dtype == torch.bfloat16
        assert abs(bf16 - fp32) <= 1e-2 * fp32
        grad_error = (bf16_grad.float() - fp32_grad).norm() / fp32_grad.norm()
        assert grad_error <= 1e-2


def test_quantised_teacher_mass_above_one_stays_finite() -> None:
    """A confident bf16 teacher can have top-k mass >= 1 after rounding: the loss stays finite."""
    inputs = make_inputs(vocab=13, top_k=3, seed=11, dtype=torch.float32)
    teacher_lp = torch.full_like(inputs["teacher_topk_logprobs"], -30.0)
    teacher_lp[..., 0] = 0.0  # top-k mass 1 + 2e-13 > 1: no room left for the tail
    for divergence in DIVERGENCES:
        loss, grad = value_and_grad(
            lambda s, d=divergence: gkd_loss(
                s, teacher_lp, inputs["teacher_topk_ids"], inputs["loss_mask"], divergence=d
            ),
            inputs["student_logits"],
        )
        assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_teacher_zero_mass_outcomes_give_no_nan() -> None:
    inputs = make_inputs(vocab=13, top_k=4, seed=12)
    teacher_lp = inputs["teacher_topk_logprobs"].clone()
    teacher_lp[..., -1] = -math.inf
    for divergence in ("forward_kl", "jsd"):
        for tail in (True, False):
            loss, grad = value_and_grad(
                lambda s, d=divergence, t=tail: gkd_loss(
                    s, teacher_lp, inputs["teacher_topk_ids"], inputs["loss_mask"], divergence=d, tail=t
                ),
                inputs["student_logits"],
            )
            assert torch.isfinite(loss) and torch.isfinite(grad).all()


# ----------------------------------------------------------------------------- reduction, chunking, layout


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_chunked_equals_unchunked(divergence: str, tail: bool) -> None:
    inputs = make_inputs(batch=3, seq=7, vocab=29, top_k=6, seed=13)
    results = [
        value_and_grad(
            lambda s, c=chunk: gkd_loss(s, *loss_args(inputs)[1:], divergence=divergence, tail=tail, chunk_size=c),
            inputs["student_logits"],
        )
        for chunk in (None, 1, 4, 1000)
    ]
    for loss, grad in results[1:]:
        assert torch.allclose(loss, results[0][0], rtol=0.0, atol=1e-14)
        assert torch.allclose(grad, results[0][1], rtol=0.0, atol=1e-14)


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_sum_and_count_over_micro_batches_equal_single_batch_mean(divergence: str) -> None:
    inputs = make_inputs(batch=4, seq=6, vocab=13, top_k=4, seed=14)
    student, teacher_lp, ids, mask = loss_args(inputs)
    mask[2:, :4] = False  # the two micro-batches have different token counts
    full, full_grad = value_and_grad(lambda s: gkd_loss(s, teacher_lp, ids, mask, divergence=divergence), student)

    def two_micro_batches(s: torch.Tensor) -> torch.Tensor:
        parts = [
            gkd_loss_sum(s[rows], teacher_lp[rows], ids[rows], mask[rows], divergence=divergence)
            for rows in (slice(0, 2), slice(2, 4))
        ]
        total_count = sum(count for _, count in parts)  # what the actor all-reduces over DP ranks
        return sum(loss_sum for loss_sum, _ in parts) / total_count

    split, split_grad = value_and_grad(two_micro_batches, student)
    assert int(mask[:2].sum()) != int(mask[2:].sum())
    assert abs(split - full) <= 1e-14
    assert torch.allclose(split_grad, full_grad, rtol=0.0, atol=1e-15)


def test_temperature_divides_student_logits() -> None:
    inputs = make_inputs(seed=15)
    student, teacher_lp, ids, mask = loss_args(inputs)
    for divergence in DIVERGENCES:
        tempered = gkd_loss(student, teacher_lp, ids, mask, divergence=divergence, temperature=2.5)
        pre_divided = gkd_loss(student / 2.5, teacher_lp, ids, mask, divergence=divergence)
        assert abs(tempered - pre_divided) <= 1e-14


def test_non_contiguous_logits_match_contiguous() -> None:
    """Megatron's [T,B,V] output can be passed as a transposed view without a copy."""
    inputs = make_inputs(batch=3, seq=5, seed=16)
    student_TBV = inputs["student_logits"].transpose(0, 1).contiguous()
    loss, grad = value_and_grad(
        lambda s: gkd_loss(s, *loss_args(inputs)[1:], divergence="jsd"), inputs["student_logits"]
    )
    loss_t, grad_TBV = value_and_grad(
        lambda s: gkd_loss(s.transpose(0, 1), *loss_args(inputs)[1:], divergence="jsd"), student_TBV
    )
    assert torch.equal(loss, loss_t)
    assert torch.equal(grad, grad_TBV.transpose(0, 1))


def test_backward_keeps_no_full_fp32_copy_of_the_logits() -> None:
    """Tensors saved for backward: the bf16 logits themselves plus [M,K]-sized pieces, no fp32 [B,T,V]."""
    batch, seq, vocab, top_k = 2, 64, 2048, 8
    inputs = make_inputs(batch=batch, seq=seq, vocab=vocab, top_k=top_k, seed=17, dtype=torch.bfloat16)
    student = inputs["student_logits"].requires_grad_(True)
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = gkd_loss(student, *loss_args(inputs)[1:], divergence="jsd", chunk_size=16)
    loss.backward()
    full_size = batch * seq * vocab
    float_saved = [t for t in saved if t.is_floating_point() and t.data_ptr() != student.data_ptr()]
    assert sum(t.numel() for t in float_saved) < full_size / 16
    assert all(t.numel() < full_size for t in saved if t.data_ptr() != student.data_ptr())


# ----------------------------------------------------------------------------- errors


def test_negative_teacher_ids_raise() -> None:
    inputs = make_inputs(vocab=13, seed=18)
    ids = inputs["teacher_topk_ids"].clone()
    ids[0, 0, 1] = -2
    with pytest.raises(ValueError, match="negative id"):
        gkd_loss(inputs["student_logits"], inputs["teacher_topk_logprobs"], ids, inputs["loss_mask"], divergence="jsd")
    # -1 marks an excluded column (union support), which must carry no teacher mass.
    ids[0, 0, 1] = -1
    with pytest.raises(ValueError, match="excluded"):
        gkd_loss(inputs["student_logits"], inputs["teacher_topk_logprobs"], ids, inputs["loss_mask"], divergence="jsd")


def folded_inputs(student_vocab: int, extra_rows: int, top_k: int, seed: int) -> dict[str, torch.Tensor]:
    """A teacher with `extra_rows` more embedding rows than the student, its top-k reaching into them."""
    teacher_vocab = student_vocab + extra_rows
    gen = torch.Generator().manual_seed(seed)
    batch, seq = 2, 5
    student = 2.0 * torch.randn(batch, seq, student_vocab, generator=gen, dtype=torch.float64)
    teacher_full = (2.0 * torch.randn(batch, seq, teacher_vocab, generator=gen, dtype=torch.float64)).log_softmax(-1)
    order = torch.rand(batch, seq, teacher_vocab, generator=gen)
    order[..., student_vocab + 1] = -1.0  # every position's top-k holds at least this folded id
    ids = order.argsort(-1)[..., :top_k]
    top = teacher_full.gather(-1, ids)
    rest = teacher_full.scatter(-1, ids, -math.inf).logsumexp(-1)  # the server's exact tail
    mask = torch.ones(batch, seq, dtype=torch.bool)
    mask[1, -1] = False
    return {"student": student, "teacher_full": teacher_full, "ids": ids, "top": top, "tail": rest, "mask": mask}


def reference_folded(student, teacher_full, ids, mask, student_vocab, divergence, beta):
    """K' + 1 outcomes in float64: the in-vocabulary top-k ids, then everything else (folded ids included)."""
    q_full = torch.softmax(student, dim=-1)
    valid = ids < student_vocab
    q_top = torch.where(valid, q_full.gather(-1, torch.where(valid, ids, 0)), 0.0)
    p_top = torch.where(valid, teacher_full.exp().gather(-1, ids), 0.0)
    p = torch.cat([p_top, 1.0 - p_top.sum(-1, keepdim=True)], dim=-1)
    q = torch.cat([q_top, 1.0 - q_top.sum(-1, keepdim=True)], dim=-1)
    # Zero-mass outcomes on both sides (folded ids) contribute nothing: drop them from the sums.
    p, q = p.clamp(min=1e-300), q.clamp(min=1e-300)
    terms = reference_divergence(p, q, divergence, beta)
    return terms[mask].mean()


@pytest.mark.parametrize("beta", (0.0, 0.5, 1.0))
@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("sent_tail", [True, False])
def test_ids_beyond_the_student_vocab_fold_into_the_tail(divergence: str, beta: float, sent_tail: bool) -> None:
    vocab = 13
    x = folded_inputs(vocab, extra_rows=3, top_k=5, seed=21)
    tail = x["tail"] if sent_tail else None
    ours, ours_grad = value_and_grad(
        lambda s: gkd_loss(
            s, x["top"], x["ids"], x["mask"], divergence=divergence, beta=beta, teacher_tail_logmass=tail
        ),
        x["student"],
    )
    ref, ref_grad = value_and_grad(
        lambda s: reference_folded(s, x["teacher_full"], x["ids"], x["mask"], vocab, divergence, beta), x["student"]
    )
    assert ref > 1e-3 and torch.isfinite(ours_grad).all()
    assert abs(ours - ref) <= EXACT_TOL
    assert torch.allclose(ours_grad, ref_grad, rtol=0.0, atol=EXACT_TOL)


def test_folded_ids_need_the_tail_bucket() -> None:
    x = folded_inputs(13, extra_rows=3, top_k=5, seed=22)
    with pytest.raises(ValueError, match=r"algorithm\.tail=true"):
        gkd_loss(x["student"], x["top"], x["ids"], x["mask"], divergence="forward_kl", tail=False)


def test_sent_tail_is_used_as_sent() -> None:
    """With the server's tail the teacher's K+1 distribution is (top-k, tail) renormalised, not 1 - sum(top-k)."""
    inputs = make_inputs(vocab=13, top_k=4, seed=23)
    student, teacher_lp, ids, mask = loss_args(inputs)
    exact_tail = inputs["teacher_full_logprobs"].scatter(-1, ids, -math.inf).logsumexp(-1)
    with_exact = gkd_loss(student, teacher_lp, ids, mask, divergence="forward_kl", teacher_tail_logmass=exact_tail)
    rebuilt = gkd_loss(student, teacher_lp, ids, mask, divergence="forward_kl")
    assert abs(with_exact - rebuilt) <= EXACT_TOL  # exact float64 inputs: both ways agree
    doubled = gkd_loss(
        student, teacher_lp, ids, mask, divergence="forward_kl", teacher_tail_logmass=exact_tail + math.log(2.0)
    )
    assert abs(doubled - with_exact) > 1e-3  # ... and a different sent tail is not ignored
    bad = exact_tail.clone()
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="teacher_tail_logmass holds NaN"):
        gkd_loss(student, teacher_lp, ids, mask, divergence="forward_kl", teacher_tail_logmass=bad)
    with pytest.raises(ValueError, match="teacher_tail_logmass must be"):
        gkd_loss(student, teacher_lp, ids, mask, divergence="forward_kl", teacher_tail_logmass=exact_tail[:, :-1])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"divergence": "kl"}, "unknown divergence"),
        ({"beta": -0.1}, "beta must be in"),
        ({"beta": 1.5}, "beta must be in"),
        ({"temperature": 0.0}, "temperature must be"),
        ({"temperature": -1.0}, "temperature must be"),
        ({"temperature": math.nan}, "temperature must be"),
        ({"chunk_size": 0}, "chunk_size"),
    ],
)
def test_bad_arguments_raise(change: dict, match: str) -> None:
    inputs = make_inputs(seed=19)
    kwargs = {"divergence": "jsd", **change}
    with pytest.raises(ValueError, match=match):
        gkd_loss(*loss_args(inputs), **kwargs)


def test_bad_shapes_and_values_raise() -> None:
    inputs = make_inputs(vocab=13, top_k=4, seed=20)
    student, teacher_lp, ids, mask = loss_args(inputs)
    cases = [
        ((student[0], teacher_lp, ids, mask), "student_logits must be"),
        ((student, teacher_lp[:, :-1], ids, mask), "teacher_topk_logprobs must be"),
        ((student, teacher_lp, ids[..., :-1], mask), "teacher_topk_ids"),
        ((student, teacher_lp, ids.double(), mask), "integer"),
        ((student, teacher_lp, ids, mask[:, :-1]), "loss_mask must be"),
        ((student, teacher_lp, ids, mask.double() * 2), "only 0 and 1"),
        ((student, teacher_lp, torch.cat([ids, ids[..., :1]], -1), mask), "must have the shape"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            gkd_loss(*args, divergence="forward_kl")
    duplicated = ids.clone()
    duplicated[0, 0, 1] = duplicated[0, 0, 0]
    with pytest.raises(ValueError, match="repeat an id"):
        gkd_loss(student, teacher_lp, duplicated, mask, divergence="forward_kl")
    too_many = torch.rand(2, 6, 14).argsort(-1) % 13
    # K > V columns are allowed (union support excludes the repeated ones), but real ids then repeat.
    with pytest.raises(ValueError, match="repeat an id"):
        gkd_loss(student, teacher_lp.new_zeros(2, 6, 14), too_many, mask, divergence="forward_kl")
