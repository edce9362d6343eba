"""adam_bounds' ceiling against torch's Adam on gradients built to push it."""

from __future__ import annotations

import pytest
import torch
from adam_bounds import ADAM_BETAS, adam_step_bound


def test_adam_step_bound_holds_for_torch_adam() -> None:
    """The ceiling assert_same_weights uses, against torch's Adam on gradients built to push it."""
    torch.manual_seed(0)
    lrs = [5e-4, 1e-3, 1e-3, 1e-3]
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0])
    cases = {
        "steady": lambda t: torch.full((64,), 3.0),  # each step moves lr * 1: the bound is reached
        "tiny_then_huge": lambda t: torch.full((64,), 1e-6 * 1e6**t),
        "huge_then_tiny": lambda t: torch.full((64,), 1e3 * 1e-4**t),
        "alternating": lambda t: signs[t] * torch.rand(64),
        "noise_at_eps": lambda t: 1e-8 * torch.randn(64),
        "random": lambda t: torch.randn(64) * 10.0 ** torch.randint(-8, 3, (64,)),
    }
    moved: dict[str, float] = {}
    for name, grad_at in cases.items():
        weight = torch.nn.Parameter(torch.zeros(64, dtype=torch.float64))
        optimizer = torch.optim.Adam([weight], lr=lrs[0], betas=ADAM_BETAS, eps=1e-8)
        for t, lr in enumerate(lrs):
            optimizer.param_groups[0]["lr"] = lr
            weight.grad = grad_at(t).to(torch.float64)
            optimizer.step()
        moved[name] = weight.detach().abs().max().item()
        assert moved[name] <= adam_step_bound(lrs) * (1 + 1e-9), (name, moved[name], adam_step_bound(lrs))
    # Steady gradients move every entry by lr per step: the bound is tight (c_t is 1.0034 at t=4).
    assert moved["steady"] == pytest.approx(sum(lrs), rel=1e-6)
    assert adam_step_bound(lrs) == pytest.approx(sum(lrs), rel=5e-3)
