"""sampled_reverse_kl_loss_sum against an independent float64 reference: values, gradients, stale ratios, clipping."""

from __future__ import annotations

import pytest
import torch

from recipe_gkd.losses import sampled_reverse_kl_loss_sum

VOCAB = 17
BATCH, SEQ = 3, 6


def make_case(seed: int, staleness: float, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Random logits; targets sampled from the student; s_old from weights `staleness` away; a random teacher."""
    gen = torch.Generator().manual_seed(seed)
    logits_BTV = 2 * torch.randn(BATCH, SEQ, VOCAB, generator=gen, dtype=torch.float64)
    old_logits_BTV = logits_BTV + staleness * torch.randn(BATCH, SEQ, VOCAB, generator=gen, dtype=torch.float64)
    targets_BT = torch.multinomial(old_logits_BTV.softmax(-1).reshape(-1, VOCAB), 1, generator=gen).reshape(BATCH, SEQ)
    teacher_BTV = (2 * torch.randn(BATCH, SEQ, VOCAB, generator=gen, dtype=torch.float64)).log_softmax(-1)
    mask_BT = torch.rand(BATCH, SEQ, generator=gen) > 0.3
    mask_BT[0, :2] = True
    return {
        "logits": logits_BTV.to(dtype),
        "targets": targets_BT,
        "old": old_logits_BTV.log_softmax(-1).gather(-1, targets_BT[..., None])[..., 0].to(torch.float32),
        "teacher": teacher_BTV.gather(-1, targets_BT[..., None])[..., 0].to(torch.float32),
        "mask": mask_BT,
    }


def reference_loss(case: dict[str, torch.Tensor], logits_BTV: torch.Tensor, ratio_clip: float) -> torch.Tensor:
    """Token mean of -ratio * A (PPO-clipped), written from the definition over the full softmax, float64."""
    logprob_BT = torch.log_softmax(logits_BTV.double(), dim=-1).gather(-1, case["targets"][..., None])[..., 0]
    old_BT, teacher_BT = case["old"].double(), case["teacher"].double()
    ratio_BT = torch.exp(logprob_BT - old_BT)
    advantage_BT = teacher_BT - old_BT
    per_token_BT = -ratio_BT * advantage_BT
    if ratio_clip > 0:
        per_token_BT = torch.maximum(per_token_BT, -ratio_BT.clamp(1 - ratio_clip, 1 + ratio_clip) * advantage_BT)
    mask_BT = case["mask"].double()
    return (per_token_BT * mask_BT).sum() / mask_BT.sum()


def ours(case: dict[str, torch.Tensor], ratio_clip: float, chunk_size: int | None = None):
    logits = case["logits"].detach().clone().requires_grad_(True)
    loss_sum, count, stats = sampled_reverse_kl_loss_sum(
        logits,
        case["targets"],
        case["old"],
        case["teacher"],
        case["mask"],
        ratio_clip=ratio_clip,
        chunk_size=chunk_size,
    )
    (loss_sum / count).backward()
    return (loss_sum / count).detach(), logits.grad, count, stats


@pytest.mark.parametrize("staleness", [0.0, 0.4])
@pytest.mark.parametrize("ratio_clip", [0.0, 0.2])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_value_and_gradient_equal_float64_reference(staleness: float, ratio_clip: float, chunk_size: int | None):
    case = make_case(seed=int(staleness * 10) + 3, staleness=staleness)
    loss, grad, count, _ = ours(case, ratio_clip, chunk_size)
    logits = case["logits"].detach().clone().requires_grad_(True)
    expected = reference_loss(case, logits, ratio_clip)
    expected.backward()
    assert count.item() == int(case["mask"].sum())
    assert torch.allclose(loss, expected, rtol=0, atol=1e-12)
    assert torch.allclose(grad, logits.grad, rtol=0, atol=1e-12)
    assert grad.abs().sum() > 0
    # Masked positions get no gradient at all.
    assert grad[~case["mask"]].abs().max() == 0


def test_stale_ratios_are_not_one_and_clipping_bites():
    case = make_case(seed=5, staleness=0.8)
    _, _, count, stats = ours(case, ratio_clip=0.1)
    assert stats.ratio_max.item() > 1.1 and stats.ratio_min.item() < 0.9
    assert 0 < stats.clipped.item() < count.item()
    # A clipped token contributes no gradient: with every ratio outside [0.9, 1.1] and the clipped branch
    # active everywhere, the whole gradient vanishes; the reference says the same.
    logprob_BT = torch.log_softmax(case["logits"], -1).gather(-1, case["targets"][..., None])[..., 0]
    ratio_BT = torch.exp(logprob_BT - case["old"].double())
    advantage_BT = case["teacher"].double() - case["old"].double()
    active_BT = case["mask"] & (-ratio_BT.clamp(0.9, 1.1) * advantage_BT > -ratio_BT * advantage_BT)
    assert stats.clipped.item() == active_BT.sum().item()


def test_on_policy_gradient_is_the_reverse_kl_policy_gradient():
    """At s_old = s_theta the gradient is (1/N) sum_t (log s - log t)(x_t) * (onehot(x_t) - softmax): by hand."""
    case = make_case(seed=11, staleness=0.0)
    case["old"] = torch.log_softmax(case["logits"], -1).gather(-1, case["targets"][..., None])[..., 0].float()
    _, grad, count, stats = ours(case, ratio_clip=0.0)
    probs_BTV = case["logits"].softmax(-1)
    onehot_BTV = torch.nn.functional.one_hot(case["targets"], VOCAB).double()
    log_ratio_BT = case["old"].double() - case["teacher"].double()
    expected_BTV = (log_ratio_BT * case["mask"])[..., None] * (onehot_BTV - probs_BTV) / count.item()
    assert torch.allclose(grad, expected_BTV, rtol=0, atol=1e-6)
    assert abs(stats.ratio_sum.item() - count.item()) < 1e-5
    assert abs(stats.advantage_sum.item() + (log_ratio_BT * case["mask"]).sum().item()) < 1e-9


def test_float32_logits_match_the_float64_reference():
    case = make_case(seed=7, staleness=0.3, dtype=torch.float32)
    loss, grad, _, _ = ours(case, ratio_clip=0.2)
    logits = case["logits"].double().requires_grad_(True)
    expected = reference_loss(case, logits, 0.2)
    expected.backward()
    assert grad.dtype == torch.float32
    assert abs(loss.item() - expected.item()) < 1e-5
    assert (grad.double() - logits.grad).abs().max().item() < 1e-5


def test_no_loss_tokens_gives_zero_sum_and_count():
    case = make_case(seed=1, staleness=0.2)
    case["mask"] = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    logits = case["logits"].clone().requires_grad_(True)
    loss_sum, count, stats = sampled_reverse_kl_loss_sum(
        logits, case["targets"], case["old"], case["teacher"], case["mask"]
    )
    assert loss_sum.item() == 0 and count.item() == 0 and stats.ratio_max.item() == float("-inf")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("targets", VOCAB, "target_ids hold ids outside"),
        ("old", float("nan"), "rollout_logprobs hold"),
        ("teacher", 0.5, "teacher_logprobs hold"),
    ],
)
def test_bad_inputs_are_refused(field: str, value: float, message: str):
    case = make_case(seed=2, staleness=0.1)
    case[field] = case[field].clone()
    case[field][0, 0] = value
    with pytest.raises(ValueError, match=message):
        sampled_reverse_kl_loss_sum(case["logits"], case["targets"], case["old"], case["teacher"], case["mask"])


def test_ratio_clip_out_of_range_is_refused():
    case = make_case(seed=2, staleness=0.1)
    with pytest.raises(ValueError, match="ratio_clip"):
        sampled_reverse_kl_loss_sum(
            case["logits"], case["targets"], case["old"], case["teacher"], case["mask"], ratio_clip=1.5
        )
