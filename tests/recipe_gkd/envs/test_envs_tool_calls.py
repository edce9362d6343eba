"""Tool calls read from real-shaped assistant texts: Qwen3 / Hermes `<tool_call>` and Llama 3.x JSON."""

from __future__ import annotations

import json
from typing import Any

import pytest

from recipe_gkd.envs.tool_calls import HermesCalls, Llama3JsonCalls, MalformedCall, ToolCall, tool_call_format


def qwen3_call(name: str, arguments: Any, *, ensure_ascii: bool = False) -> str:
    """A call written the way Qwen3's chat template writes an assistant's tool call (`arguments | tojson`)."""
    return (
        '<tool_call>\n{"name": "'
        + name
        + '", "arguments": '
        + json.dumps(arguments, ensure_ascii=ensure_ascii)
        + "}\n</tool_call>"
    )


def test_hermes_text_around_and_two_calls() -> None:
    text = (
        "<think>\nThe sum needs two steps; the café's bill is 12,5 €.\n</think>\n\nLet me compute.\n"
        + qwen3_call("calculator", {"expression": "12.5 * 3"})
        + "\n"
        + qwen3_call("python", {"code": "print('数学 ✓')"}, ensure_ascii=True)
        + "\nthen I answer.<|im_end|>"
    )
    assert HermesCalls().parse(text) == [
        ToolCall("calculator", {"expression": "12.5 * 3"}),
        ToolCall("python", {"code": "print('数学 ✓')"}),
    ]


def test_hermes_no_call_is_an_answer() -> None:
    assert HermesCalls().parse("The answer is 42.<|im_end|>") == []
    assert HermesCalls().parse("I would call <tool_ but then 7") == []


def test_hermes_malformed_json_is_reported_with_the_others_kept() -> None:
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}\n</tool_call>\n' + qwen3_call(
        "calculator", {"expression": "2"}
    )
    first, second = HermesCalls().parse(text)
    assert isinstance(first, MalformedCall) and "not valid JSON" in first.reason and '"1+1"' in first.reason
    assert second == ToolCall("calculator", {"expression": "2"})


def test_hermes_unclosed_last_call_is_read() -> None:
    # Generation stopped (a stop string, max tokens) before the closing tag.
    text = "ok\n<tool_call>\n" + '{"name": "calculator", "arguments": {"expression": "3*3"}}'
    assert HermesCalls().parse(text) == [ToolCall("calculator", {"expression": "3*3"})]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('{"arguments": {"expression": "1"}}', 'needs a "name"'),
        ('{"name": 3, "arguments": {}}', 'needs a "name"'),
        ('{"name": "calculator"}', 'no "arguments" object'),
        ('{"name": "calculator", "arguments": "1+1"}', "must be a JSON object, got str"),
        ('["calculator", {"expression": "1"}]', "must be a JSON object, got list"),
        ("", "not valid JSON"),
    ],
)
def test_hermes_malformed_calls(body: str, reason: str) -> None:
    (call,) = HermesCalls().parse(f"<tool_call>\n{body}\n</tool_call>")
    assert isinstance(call, MalformedCall) and reason in call.reason, call


def test_llama3_json_calls() -> None:
    parse = Llama3JsonCalls().parse
    assert parse('{"name": "calculator", "parameters": {"expression": "2+2"}}') == [
        ToolCall("calculator", {"expression": "2+2"})
    ]
    assert parse(
        '<|python_tag|>{"name": "calculator", "arguments": {"expression": "1"}}; {"name": "python", "parameters": {"code": "print(1)"}}'
    ) == [
        ToolCall("calculator", {"expression": "1"}),
        ToolCall("python", {"code": "print(1)"}),
    ]
    assert parse("The result is 4.") == []


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"name": "calculator", "parameters": {"expression": "2"}', "not valid JSON"),
        ('{"name": "calculator", "parameters": {"expression": "2"}} and then text', "text after a JSON tool call"),
        ('{"name": "calculator", "parameters": {}, "arguments": {}}', "both"),
        ('{"name": "calculator", "parameters": 5}', "must be a JSON object"),
    ],
)
def test_llama3_json_malformed(text: str, reason: str) -> None:
    calls = Llama3JsonCalls().parse(text)
    assert isinstance(calls[-1], MalformedCall) and reason in calls[-1].reason, calls


def test_format_by_name() -> None:
    assert isinstance(tool_call_format("hermes"), HermesCalls)
    assert isinstance(tool_call_format("llama3_json"), Llama3JsonCalls)
    with pytest.raises(ValueError, match="known: hermes, llama3_json"):
        tool_call_format("qwen")
