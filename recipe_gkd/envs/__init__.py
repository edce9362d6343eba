"""Tool-using environments for multi-turn rollouts: the protocol, tool-call formats, a calculator, a Python sandbox."""

from recipe_gkd.envs.protocol import Environment, Message, StepResult, Tool, ToolResult
from recipe_gkd.envs.registry import ENVIRONMENTS, build_environment

__all__ = ["ENVIRONMENTS", "Environment", "Message", "StepResult", "Tool", "ToolResult", "build_environment"]
