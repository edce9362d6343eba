"""The run's target kind and objective, as the actor builds them once and hands them to its ActorObjective."""

from __future__ import annotations

from typing import Any

from recipe_gkd.config import GKDConfig
from recipe_gkd.targets import build_objective, build_target


def kinds(cfg: GKDConfig) -> dict[str, Any]:
    """ActorObjective's `target` and `objective` keywords for `cfg`."""
    return {"target": build_target(cfg), "objective": build_objective(cfg)}
