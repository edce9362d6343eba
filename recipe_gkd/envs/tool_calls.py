"""Tool calls read from an assistant message's text, in the chat template's own format; one class per format.

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any
  number of them, text around them allowed (Qwen3's template writes each call so; vLLM's `hermes` parser,
  vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py, reads the same, and a last call the model did
  not close, when generation stopped, counts as a call too).
- `llama3_json` (Llama 3.1-3.3 with JSON tool calling): the whole message is `{"name": ..., "parameters":
  {...}}` (the template's spelling; "arguments" is accepted as vLLM's `llama3_json` parser does), optionally
  after `<|python_tag|>`, several separated by `;`. A message that does not start with `{` has no call.

A call that cannot be read (bad JSON, no name, arguments not an object) comes back as `MalformedCall`,
never as an exception: the environment answers it with an error observation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar

_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_THINK_END = "</think>"
_SHOWN_CHARS = 200  # how much of a malformed call the error observation quotes back


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's name and its arguments object."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedCall:
    """A call the model tried to make and that cannot be read; `reason` is what the model is told."""

    raw: str
    reason: str


ParsedCall = ToolCall | MalformedCall


def _shown(raw: str) -> str:
    raw = raw.strip()
    return raw if len(raw) <= _SHOWN_CHARS else raw[:_SHOWN_CHARS] + "..."


def call_from_object(obj: Any, raw: str, arguments_keys: tuple[str, ...]) -> ParsedCall:
    """A `ToolCall` from a decoded JSON value, or the `MalformedCall` saying what is wrong with it."""
    if not isinstance(obj, dict):
        return MalformedCall(raw, f"a tool call must be a JSON object, got {type(obj).__name__}: {_shown(raw)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall(raw, f'a tool call needs a "name" string: {_shown(raw)}')
    present = [key for key in arguments_keys if key in obj]
    if not present:
        return MalformedCall(raw, f'the call to {name!r} has no "{arguments_keys[0]}" object')
    if len(present) > 1:
        return MalformedCall(raw, f"the call to {name!r} has both {present[0]!r} and {present[1]!r}")
    arguments = obj[present[0]]
    if not isinstance(arguments, dict):
        return MalformedCall(
            raw, f'the call to {name!r}: "{present[0]}" must be a JSON object, got {type(arguments).__name__}'
        )
    return ToolCall(name, arguments)


def _decode(raw: str, arguments_keys: tuple[str, ...]) -> ParsedCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as err:
        return MalformedCall(raw, f"the tool call is not valid JSON ({err.msg} at character {err.pos}): {_shown(raw)}")
    return call_from_object(obj, raw, arguments_keys)


def content_after_reasoning(text: str) -> str:
    """The message without its reasoning: what follows the first `</think>` (Qwen3 thinking mode), else all of it.

    As vLLM's `qwen3` reasoning parser splits a completion (vllm/reasoning/qwen3_reasoning_parser.py,
    `Qwen3ReasoningParser.extract_reasoning`) before a tool parser reads the content: a call drafted while
    thinking is not run, a number thought about is not the answer.
    """
    _, end, content = text.partition(_THINK_END)
    return content if end else text


class HermesCalls:
    """`<tool_call>{...}</tool_call>` anywhere in the message (Qwen2.5, Qwen3, Hermes)."""

    name: ClassVar[str] = "hermes"

    def parse(self, text: str) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        for closed, unclosed in _HERMES_CALL.findall(text):
            calls.append(_decode(closed if closed else unclosed, ("arguments",)))
        return calls


class Llama3JsonCalls:
    """The whole message as one JSON call, or several separated by `;` (Llama 3.x JSON tool calling)."""

    name: ClassVar[str] = "llama3_json"

    def parse(self, text: str) -> list[ParsedCall]:
        body = text.strip()
        if body.startswith(_PYTHON_TAG):
            body = body[len(_PYTHON_TAG) :].lstrip()
        if not body.startswith("{"):
            return []
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as err:
                calls.append(
                    MalformedCall(
                        body[pos:],
                        f"the tool call is not valid JSON ({err.msg} at character {err.pos}): {_shown(body[pos:])}",
                    )
                )
                break
            calls.append(call_from_object(obj, body[pos:end], ("parameters", "arguments")))
            rest = body[end:].lstrip()
            if not rest:
                break
            if not rest.startswith(";"):
                calls.append(
                    MalformedCall(rest, f"text after a JSON tool call (calls are separated by ';'): {_shown(rest)}")
                )
                break
            pos = len(body) - len(rest[1:].lstrip())
        return calls


TOOL_CALL_FORMATS: dict[str, type[HermesCalls] | type[Llama3JsonCalls]] = {
    HermesCalls.name: HermesCalls,
    Llama3JsonCalls.name: Llama3JsonCalls,
}


def tool_call_format(name: str) -> HermesCalls | Llama3JsonCalls:
    """The parser of one chat template's tool-call format, chosen once by name."""
    if name not in TOOL_CALL_FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(sorted(TOOL_CALL_FORMATS))}")
    return TOOL_CALL_FORMATS[name]()
