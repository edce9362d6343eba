"""Every tool call bounded in wall time (`rollout.tool_timeout_s`), whatever the tool.

The rule is one: a tool gets `timeout_s` seconds. A tool that can stop its own work enforces it itself (the
Python sandbox kills its program at `timeout_s` and says so); every call also runs on a thread of its own, and a
call still running `TOOL_GUARD_SLACK_S` after that is answered as timed out, so that a tool that cannot bound
itself (a hung library call) never hangs a rollout step. Python cannot stop a thread: the abandoned one runs on
as a daemon thread (it holds no lock of the rollout's) until its call returns.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from recipe_gkd.envs.protocol import Tool, ToolResult

# Headroom for a self-bounding tool to report its own timeout (the sandbox's kill and reap take milliseconds).
TOOL_GUARD_SLACK_S = 1.0


def call_within(tool: Tool, arguments: Mapping[str, Any], timeout_s: float) -> ToolResult:
    """`tool(arguments)`, or a failed result saying it timed out when it has not returned `timeout_s` +
    TOOL_GUARD_SLACK_S seconds later. An exception of the tool (a bug: tools answer bad input) is raised here."""
    outcome: list[ToolResult | BaseException] = []

    def run() -> None:
        try:
            outcome.append(tool(arguments))
        except BaseException as err:  # noqa: BLE001 - handed to the calling thread and raised there
            outcome.append(err)

    thread = threading.Thread(target=run, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(timeout_s + TOOL_GUARD_SLACK_S)
    if thread.is_alive():
        return ToolResult(f"error: the {tool.name} tool timed out after {timeout_s:g} s", failed=True)
    result = outcome[0]
    if isinstance(result, BaseException):
        raise RuntimeError(f"the {tool.name} tool raised instead of answering: {result!r}") from result
    return result
