"""How far two correct training runs' weights may differ: float32 sums in another order, through Adam.

Two correct runs sum float32 gradients in another order (TP shards, micro-batches, another CPU's
SIMD width: AVX2 vs AVX-512). Where an entry's gradient is a near-cancelling sum of size ~eps,
that rounding is a visible part of Adam's step lr * m_hat / (sqrt(v_hat) + eps), and the step's
sign can even flip. What the arithmetic does bound: no Adam step moves an entry by more than
lr_t * c_t (adam_step_bound), so two runs' weights differ by at most twice the sum. A wrong
shard or gather moves whole rows; rounding moves a handful of entries: so all but <= 0.1% (or 2)
entries of a tensor must agree within 1e-6, and none may differ by more than the Adam ceiling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

WEIGHT_TIGHT_ATOL = 1e-6
WEIGHT_TIGHT_FRACTION = 1e-3
ADAM_BETAS = (0.9, 0.999)  # actor.optim.beta1/beta2 defaults, which every scenario keeps


def adam_step_bound(lrs: Sequence[float], betas: tuple[float, float] = ADAM_BETAS, first_step: int = 1) -> float:
    """The most one entry can move over Adam steps at these learning rates, whatever the gradients.

    With m_t = (1 - b1) sum_i b1^(t-i) g_i and v_t = (1 - b2) sum_i b2^(t-i) g_i^2, Cauchy-Schwarz
    gives |m_t| <= (1 - b1) sqrt(sum_k (b1^2 / b2)^k / (1 - b2)) sqrt(v_t); with the bias
    corrections |m_hat_t| / sqrt(v_hat_t) <= c_t below (c_1 = 1, ~1.0 for the first steps), and eps
    only shrinks the step. Decoupled weight decay shrinks both runs' weights alike. `first_step`: the
    steps' number t when they continue from saved moments (a resumed run).
    """
    beta1, beta2 = betas
    total = 0.0
    for t, lr in enumerate(lrs, start=first_step):
        ratios = sum((beta1 * beta1 / beta2) ** k for k in range(t))
        c_t = (1 - beta1) / (1 - beta1**t) * math.sqrt((1 - beta2**t) / (1 - beta2) * ratios)
        total += lr * c_t
    return total


def assert_same_weights(
    a: dict[str, np.ndarray], b: dict[str, np.ndarray], lrs: Sequence[float], first_step: int = 1
) -> None:
    """Same weights up to float32 summation order after Adam steps at `lrs` (the first is step `first_step`)."""
    assert a.keys() == b.keys()
    ceiling = 2 * adam_step_bound(lrs, first_step=first_step)
    for name, weight in a.items():
        diff = np.abs(b[name] - weight)
        assert diff.max() <= ceiling, f"{name}: max diff {diff.max()} beyond what Adam steps allow ({ceiling})"
        loose = int((diff > WEIGHT_TIGHT_ATOL).sum())
        allowed = max(2, WEIGHT_TIGHT_FRACTION * diff.size)
        assert loose <= allowed, f"{name}: {loose} entries differ by > {WEIGHT_TIGHT_ATOL} (allowed {allowed:g})"
