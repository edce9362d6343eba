"""Environments by name: one class per environment, chosen once; an unknown name lists the known ones."""

from __future__ import annotations

from typing import Any

from recipe_gkd.envs.tasks import CalculatorEnv, PythonToolEnv, ToolTaskEnv

ENVIRONMENTS: dict[str, type[ToolTaskEnv]] = {env.name: env for env in (CalculatorEnv, PythonToolEnv)}


def build_environment(name: str, **options: Any) -> ToolTaskEnv:
    """A fresh environment (one episode at a time) of the class registered as `name`, built with `options`."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; known environments: {', '.join(sorted(ENVIRONMENTS))}")
    return ENVIRONMENTS[name](**options)
