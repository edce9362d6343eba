"""One line when most responses run to the length limit: the turn end may be missing from the stop set.

A response that never samples a stop id is cut by rollout.sampling.max_new_tokens; a few are normal, most for many
steps mean the limit is too short for the task or the student never emits an id of its stop set (a Base checkpoint
with another model's template). `response_clipped_frac` is in every metrics.jsonl row; once it stays above
CLIPPED_FRAC for PATIENCE steps in a row the run prints one line naming the limit and the stop ids (once per run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Cut: more than half of a step's sampled responses (turns) ...
CLIPPED_FRAC = 0.5
# ... for this many consecutive steps (a batch of long answers is not a pattern).
PATIENCE = 10


@dataclass
class ClipWatch:
    """Fed one metrics.jsonl row per step; `observe` returns the line the first time it fires."""

    max_new_tokens: int
    above: int = 0
    fired: bool = False

    def observe(self, row: dict[str, Any], stop_ids: str) -> str | None:
        """Take one step's row (`stop_ids`: the engines' stop set, described); the line when it first fires."""
        frac = row.get("response_clipped_frac")
        self.above = self.above + 1 if frac is not None and frac > CLIPPED_FRAC else 0
        if self.fired or self.above < PATIENCE:
            return None
        self.fired = True
        return (
            f"responses cut by the length limit at step {row['step']}: response_clipped_frac {frac:.2f} above "
            f"{CLIPPED_FRAC:g} for {PATIENCE} steps in a row; raise rollout.sampling.max_new_tokens "
            f"(now {self.max_new_tokens}) or check that the student ends its turns with one of its stop ids: "
            f"{stop_ids} (docs/before_the_first_step.md)"
        )
