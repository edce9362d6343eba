"""Two tool-using task environments: a question with a numeric answer, solved with the calculator or with Python.

An episode: `reset(record)` gives [system, user]; each assistant turn that calls tools gets one tool message
per call back (a malformed call, an unknown tool or bad arguments get an error message, and count as a tool
failure); the first assistant turn without a tool call ends the episode, and its reward is 1.0 when the last
number in it equals the record's answer. Reasoning before `</think>` is neither run nor scored. The
environment enforces `max_turns` itself: the assistant turn numbered `max_turns` ends the episode whatever it
holds: an answer is scored, tool calls are not run (reward 0.0, `truncated`).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping
from typing import Any, ClassVar

from recipe_gkd.envs.arithmetic import CalculatorTool
from recipe_gkd.envs.deadline import call_within
from recipe_gkd.envs.protocol import Message, StepResult, Tool, ToolResult, tool_message, tool_schema
from recipe_gkd.envs.sandbox import PythonSandbox, PythonTool, SandboxLimits
from recipe_gkd.envs.tool_calls import MalformedCall, ToolCall, content_after_reasoning, tool_call_format

_NUMBER = re.compile(r"-?(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)(?:[eE][+-]?[0-9]+)?")
# Two numbers are the same answer when they agree to this relative (or, near zero, absolute) tolerance:
# a float printed by the tool and copied by the model keeps 17 significant digits, far inside it.
ANSWER_REL_TOL = 1e-9
# Wall seconds of one tool call unless the environment is built with another (rollout.tool_timeout_s).
DEFAULT_TOOL_TIMEOUT_S = 10.0
# How a tool that runs the model's code is isolated unless built with another (rollout.tool_isolation).
DEFAULT_TOOL_ISOLATION = "bwrap"


def final_number(text: str) -> float | None:
    """The last number written in `text` (commas between thousands dropped), or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def answer_matches(text: str, answer: Any) -> bool:
    """Whether the last number in `text` equals `answer` (a number or a numeric string)."""
    predicted = final_number(text)
    expected = final_number(str(answer))
    if predicted is None or expected is None:
        return False
    return math.isclose(predicted, expected, rel_tol=ANSWER_REL_TOL, abs_tol=ANSWER_REL_TOL)


def check_arguments(tool: Tool, call: ToolCall) -> str | None:
    """What is wrong with a call's arguments against the tool's schema (missing or unknown keys), or None."""
    properties = tool.parameters.get("properties", {})
    missing = [key for key in tool.parameters.get("required", []) if key not in call.arguments]
    unknown = [key for key in call.arguments if key not in properties]
    if missing:
        return f"error: the call to {tool.name!r} is missing {', '.join(map(repr, missing))}"
    if unknown:
        return f"error: {tool.name!r} takes no {', '.join(map(repr, unknown))} (it takes {', '.join(map(repr, properties))})"
    return None


class ToolTaskEnv:
    """A question with a numeric answer and a set of tools; one episode at a time (see the module docstring)."""

    name: ClassVar[str] = ""
    system_prompt: ClassVar[str] = ""

    def __init__(
        self,
        *,
        max_turns: int = 8,
        tool_call_format_name: str = "hermes",
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        tool_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S,
        tool_isolation: str = DEFAULT_TOOL_ISOLATION,
        **tool_options: Any,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if tool_timeout_s <= 0:
            raise ValueError(f"tool_timeout_s must be > 0, got {tool_timeout_s}")
        self.tool_timeout_s = tool_timeout_s
        tools = self.build_tools(tool_timeout_s=tool_timeout_s, tool_isolation=tool_isolation, **tool_options)
        self._tools = {tool.name: tool for tool in tools}
        self._format = tool_call_format(tool_call_format_name)
        self.max_turns = max_turns
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self._answer: Any = None
        self.turns = 0
        self.done = True
        self.rng = random.Random(0)

    def build_tools(self, *, tool_timeout_s: float, tool_isolation: str) -> list[Tool]:
        """The environment's tools, built from its own options (the keyword arguments `__init__` does not take);
        a tool that can stop its own work (the sandbox) bounds itself at `tool_timeout_s`, and one that runs the
        model's code is isolated as `tool_isolation` says (sandbox.py)."""
        raise NotImplementedError(f"{type(self).__name__} must define build_tools()")

    def tools(self) -> list[dict[str, Any]]:
        """The tools as `apply_chat_template(tools=...)` takes them."""
        return [tool_schema(tool) for tool in self._tools.values()]

    def reset(self, record: Mapping[str, Any], seed: int = 0) -> list[Message]:
        """Start an episode; `seed` seeds `self.rng`, what a task that draws (a variation, a tool's noise) draws
        from (the rollout loop derives it from the data seed, the sample id and the epoch: a resume repeats it)."""
        self.rng = random.Random(seed)
        for key in (self.prompt_key, self.answer_key):
            if key not in record:
                raise KeyError(
                    f"the {self.name} environment needs {key!r} in every record; this one has {sorted(record)}"
                )
        self._answer = record[self.answer_key]
        self.turns = 0
        self.done = False
        return [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": str(record[self.prompt_key])},
        ]

    def step(self, assistant_message: Message) -> StepResult:
        if self.done:
            raise RuntimeError(f"step() after the episode ended; call reset() first ({self.name} environment)")
        self.turns += 1
        text = content_after_reasoning(str(assistant_message.get("content") or ""))
        calls = self._format.parse(text)
        if not calls:
            self.done = True
            return StepResult([], done=True, reward=1.0 if answer_matches(text, self._answer) else 0.0)
        if self.turns >= self.max_turns:
            # The last turn allowed: its calls are not run, nobody would read their results.
            self.done = True
            return StepResult([], done=True, tool_calls=len(calls), truncated=True)
        results = [self._answer_call(call) for call in calls]
        failures = sum(result.failed for result in results)
        observations = [tool_message(result.content) for result in results]
        return StepResult(observations, done=False, tool_calls=len(calls), tool_failures=failures)

    def _answer_call(self, call: ToolCall | MalformedCall) -> ToolResult:
        if isinstance(call, MalformedCall):
            return ToolResult(f"error: {call.reason}", failed=True)
        tool = self._tools.get(call.name)
        if tool is None:
            return ToolResult(
                f"error: no tool named {call.name!r}; the tools are {', '.join(map(repr, self._tools))}", failed=True
            )
        problem = check_arguments(tool, call)
        if problem is not None:
            return ToolResult(problem, failed=True)
        return call_within(tool, call.arguments, self.tool_timeout_s)


class CalculatorEnv(ToolTaskEnv):
    """Arithmetic word problems with the `calculator` tool; reward 1.0 for the right final number."""

    name: ClassVar[str] = "calculator"
    system_prompt: ClassVar[str] = (
        "Solve the problem. Use the calculator tool for arithmetic. End with the final number, alone."
    )

    def build_tools(self, *, tool_timeout_s: float, tool_isolation: str) -> list[Tool]:
        # A parser, not code: bounded by its own limits (arithmetic.py), call_within bounds it too; nothing to isolate.
        return [CalculatorTool()]


class PythonToolEnv(ToolTaskEnv):
    """Problems with a numeric answer and the sandboxed `python` tool; reward 1.0 for the right final number."""

    name: ClassVar[str] = "python"
    system_prompt: ClassVar[str] = (
        "Solve the problem. You may run Python with the python tool; it returns what the program prints. "
        "End with the final number, alone."
    )

    def build_tools(
        self,
        *,
        tool_timeout_s: float,
        tool_isolation: str,
        memory_mib: int = 512,
        cpu_s: int = 10,
        max_output_bytes: int = 8192,
        max_processes: int = 16,
        scratch_mib: int = 64,
    ) -> list[Tool]:
        """The sandboxed python tool: `tool_timeout_s` wall seconds per call, the other limits per call too."""
        limits = SandboxLimits(
            timeout_s=tool_timeout_s,
            memory_mib=memory_mib,
            cpu_s=cpu_s,
            max_output_bytes=max_output_bytes,
            max_processes=max_processes,
            scratch_mib=scratch_mib,
        )
        return [PythonTool(PythonSandbox(limits, tool_isolation=tool_isolation))]
