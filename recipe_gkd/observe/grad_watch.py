"""One line when the actor's gradient is exactly zero while its loss is not: nothing trains.

A step whose loss is positive has a gradient somewhere unless the graph never reaches a trained parameter: every
parameter frozen, a block run without autograd in front of every trained one (activation recompute over a frozen
input: recipe_gkd/actor/lora.py `_input_requires_grad`), or every token's loss weight zero while the loss is
reported. The optimizer then steps with nothing and the run looks healthy in every other column. Once `grad_norm`
is exactly 0 with a positive `loss` for PATIENCE steps in a row the run prints one line (once per run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Consecutive steps of an exactly-zero gradient before the line.
PATIENCE = 2


@dataclass
class ZeroGradWatch:
    """Fed one metrics.jsonl row per step; `observe` returns the line the first time it fires."""

    trained: str  # what the actor trains, for the line ("the whole student", "LoRA adapters of rank 8")
    zero: int = 0
    fired: bool = False

    def observe(self, row: dict[str, Any]) -> str | None:
        loss, norm = row.get("loss"), row.get("grad_norm")
        self.zero = self.zero + 1 if norm == 0.0 and loss is not None and loss > 0 else 0
        if self.fired or self.zero < PATIENCE:
            return None
        self.fired = True
        return (
            f"the actor's gradient is exactly 0 at steps {row['step'] - PATIENCE + 1}-{row['step']} while the loss "
            f"is {loss:.4g}: nothing trains ({self.trained}); a parameter that should train gets no gradient (a "
            "frozen graph in front of it, a loss mask of zeros): check actor.lora and actor.megatron.recompute"
        )
