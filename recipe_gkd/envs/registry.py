"""Environments by name: one class per environment, chosen once; an unknown name lists the known ones.

`rollout.env` names a registered environment (`calculator`, `python`) or the user's own class as
`package.module:Class`, imported where the environment is built (the driver's preflight, then each rollout worker).
Every environment is built as `Class(**options)` with the run's options: max_turns, tool_call_format_name,
prompt_key, answer_key, tool_timeout_s, tool_isolation (a class of one's own may take what it reads and `**kwargs`).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from recipe_gkd.envs.protocol import Environment
from recipe_gkd.envs.tasks import CalculatorEnv, PythonToolEnv, ToolTaskEnv

ENVIRONMENTS: dict[str, type[ToolTaskEnv]] = {env.name: env for env in (CalculatorEnv, PythonToolEnv)}
# `package.module:Class`: a dotted module path, a colon, a class name.
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
ENVIRONMENT_METHODS = ("reset", "step", "tools")


def is_import_path(name: str) -> bool:
    """Whether `name` names a class of one's own (`package.module:Class`) rather than a registered environment."""
    return bool(IMPORT_PATH.match(name))


def environment_class(name: str) -> type[Environment]:
    """The class `name` stands for: a registered one, or `package.module:Class` imported (ValueError naming what is
    wrong: an unknown name, a module that does not import, a class that is not an environment)."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    if not is_import_path(name):
        raise ValueError(
            f"unknown environment {name!r}; known environments: {', '.join(sorted(ENVIRONMENTS))}, or your own "
            "class as package.module:Class"
        )
    module_name, class_name = name.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"environment {name!r}: module {module_name!r} does not import ({err})") from err
    cls = getattr(module, class_name, None)
    missing = [m for m in ENVIRONMENT_METHODS if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        what = "no class" if not isinstance(cls, type) else f"a class without {', '.join(missing)}"
        raise ValueError(f"environment {name!r}: {module_name} holds {what} {class_name!r} (reset, step, tools)")
    return cls


def build_environment(name: str, **options: Any) -> Environment:
    """A fresh environment (one episode at a time) of the class `name` stands for, built with `options`."""
    return environment_class(name)(**options)
