"""The environment protocol: `reset(record) -> messages`, `step(assistant message) -> observations, done, reward`.

A chat message is a plain dict as chat templates read it (`{"role": ..., "content": ...}`). A tool's result
goes back as `{"role": "tool", "content": text}`: Qwen3's template renders a run of tool messages as one user
turn, each wrapped in `<tool_response>...</tool_response>`; Llama 3.1's renders `role` "tool" (or "ipython")
under an `ipython` header (both read `content` only; see docs/multi_turn.md for the template lines).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

Message = dict[str, Any]
"""One chat message as `tokenizer.apply_chat_template` takes it."""


@dataclass(frozen=True)
class ToolResult:
    """What one tool call returns: the text the model reads next, and whether the call failed."""

    content: str
    failed: bool = False


def tool_message(content: str) -> Message:
    """The observation message both Qwen3's and Llama 3.1's chat templates render as a tool's result."""
    return {"role": "tool", "content": content}


@dataclass(frozen=True)
class StepResult:
    """One `step`: the tool messages to append (none when done), whether the episode ended, its reward.

    `reward` is 0.0 until the episode ends. `tool_calls` and `tool_failures` count this step's calls
    (a malformed call, an unknown tool, a crashed or timed-out tool are failures). `truncated` says the
    episode ended on `max_turns` rather than on an answer.
    """

    observations: list[Message]
    done: bool
    reward: float = 0.0
    tool_calls: int = 0
    tool_failures: int = 0
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Tool(Protocol):
    """A tool the model calls by name with a JSON object of arguments. Never raises on bad arguments."""

    name: ClassVar[str]
    description: ClassVar[str]
    parameters: ClassVar[dict[str, Any]]  # JSON schema of the arguments object

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult: ...


def tool_schema(tool: Tool) -> dict[str, Any]:
    """The tool as `apply_chat_template(tools=[...])` takes it (the OpenAI function format)."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


class Environment(Protocol):
    """One episode at a time: `reset` starts it from a data record, `step` answers each assistant turn."""

    name: ClassVar[str]

    def reset(self, record: Mapping[str, Any], seed: int = 0) -> list[Message]:
        """The first messages of an episode from a data record; `seed` fixes whatever the episode draws."""
        ...

    def step(self, assistant_message: Message) -> StepResult: ...

    def tools(self) -> list[dict[str, Any]]: ...
