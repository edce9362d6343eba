"""The zero-gradient line: exactly 0 with a positive loss for PATIENCE steps in a row, once per run."""

from __future__ import annotations

from recipe_gkd.observe.grad_watch import PATIENCE, ZeroGradWatch


def row(step: int, loss: float | None, grad_norm: float | None) -> dict:
    return {"step": step, "loss": loss, "grad_norm": grad_norm}


def test_a_zero_gradient_with_a_positive_loss_is_said_once_naming_the_keys() -> None:
    # What a LoRA student behind a frozen, recomputed embedding logged before the fix: loss 0.65, grad_norm 0.0.
    watch = ZeroGradWatch("LoRA adapters of rank 8 on qkv, proj, fc1, fc2")
    lines = [watch.observe(row(step, 0.65, 0.0)) for step in range(1, PATIENCE + 4)]
    fired = [line for line in lines if line]
    assert len(fired) == 1 and lines[PATIENCE - 1] == fired[0], "on the PATIENCE-th step, then never again"
    assert f"steps 1-{PATIENCE}" in fired[0] and "LoRA adapters of rank 8" in fired[0]
    assert "actor.lora" in fired[0] and "actor.megatron.recompute" in fired[0]


def test_a_training_run_or_a_single_zero_says_nothing() -> None:
    watch = ZeroGradWatch("the whole student")
    steps = [(0.6, 0.4), (0.5, 0.0), (0.5, 0.3), (0.0, 0.0), (0.0, 0.0), (None, None), (0.4, 0.0), (0.4, 1e-12)]
    assert all(watch.observe(row(i + 1, loss, norm)) is None for i, (loss, norm) in enumerate(steps))
