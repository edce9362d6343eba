"""Whole episodes of each environment, driven by scripted assistant messages; the registry by name."""

from __future__ import annotations

import json
from typing import Any

import pytest

from recipe_gkd.envs import ENVIRONMENTS, build_environment
from recipe_gkd.envs.sandbox import bubblewrap_isolation
from recipe_gkd.envs.tasks import CalculatorEnv, PythonToolEnv, answer_matches

RECORD = {"prompt": "A shop sells 17 boxes of 23 pens and 4 loose pens. How many pens?", "answer": "395"}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def call(name: str, **arguments: Any) -> str:
    """A tool call as Qwen3's chat template writes one."""
    return (
        '<tool_call>\n{"name": "'
        + name
        + '", "arguments": '
        + json.dumps(arguments, ensure_ascii=False)
        + "}\n</tool_call>"
    )


def test_registry_by_name() -> None:
    assert sorted(ENVIRONMENTS) == ["calculator", "python"]
    assert isinstance(build_environment("calculator", max_turns=3), CalculatorEnv)
    with pytest.raises(ValueError, match="unknown environment 'calc'; known environments: calculator, python"):
        build_environment("calc")
    with pytest.raises(TypeError, match="memory_mib"):  # an option of another environment
        build_environment("calculator", memory_mib=64)


def test_calculator_episode() -> None:
    env = build_environment("calculator", max_turns=6)
    messages = env.reset(RECORD)
    assert [m["role"] for m in messages] == ["system", "user"] and messages[1]["content"] == RECORD["prompt"]
    assert env.tools()[0]["function"]["name"] == "calculator"

    step = env.step(assistant("<think>\n17 boxes first.\n</think>\n\n" + call("calculator", expression="17 * 23")))
    assert step.observations == [{"role": "tool", "content": "391"}]
    assert (step.done, step.reward, step.tool_calls, step.tool_failures) == (False, 0.0, 1, 0)

    # Two calls in one turn: two tool messages, in order; an error call among them is answered, not raised.
    step = env.step(
        assistant(call("calculator", expression="391 + 4") + "\n" + call("calculator", expression="391 / 0"))
    )
    assert [m["content"] for m in step.observations] == ["395", "error: division by zero"]
    assert (step.tool_calls, step.tool_failures, step.done) == (2, 1, False)

    step = env.step(assistant('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"\n</tool_call>'))
    assert step.tool_failures == 1 and step.observations[0]["content"].startswith(
        "error: the tool call is not valid JSON"
    )
    step = env.step(assistant(call("python", code="print(1)")))
    assert step.observations[0]["content"] == "error: no tool named 'python'; the tools are 'calculator'"
    step = env.step(assistant(call("calculator", expr="1+1")))
    assert step.observations[0]["content"] == "error: the call to 'calculator' is missing 'expression'"

    step = env.step(assistant("So the shop has 395 pens."))
    assert (step.done, step.reward, step.observations, step.truncated) == (True, 1.0, [], False)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(assistant("again"))


def test_wrong_answer_and_max_turns() -> None:
    env = build_environment("calculator", max_turns=3)
    env.reset(RECORD)
    assert env.step(assistant("It is 391.")).reward == 0.0

    env.reset(RECORD)
    for _ in range(2):
        assert not env.step(assistant(call("calculator", expression="17 * 23"))).done
    last = env.step(assistant(call("calculator", expression="391 + 4")))
    assert (last.done, last.truncated, last.reward, last.observations, last.tool_calls) == (True, True, 0.0, [], 1)


def test_reasoning_is_neither_run_nor_scored() -> None:
    env = build_environment("calculator")
    env.reset(RECORD)
    thinking = (
        "<think>\nI could call " + call("calculator", expression="1/0") + " but 17*23 = 391, plus 4.\n</think>\n\n"
    )
    step = env.step(assistant(thinking + call("calculator", expression="17*23+4")))
    assert (step.tool_calls, step.observations) == (1, [{"role": "tool", "content": "395"}])
    # 395 appears only in the reasoning; the answer given is 391.
    assert env.step(assistant("<think>\nIt is 395.\n</think>\n\nThe shop has 391 pens")).reward == 0.0


def test_llama3_json_format_episode() -> None:
    env = build_environment(
        "calculator", tool_call_format_name="llama3_json", prompt_key="question", answer_key="target"
    )
    env.reset({"question": "2 to the 10th?", "target": 1024})
    step = env.step(assistant('{"name": "calculator", "parameters": {"expression": "2**10"}}'))
    assert step.observations == [{"role": "tool", "content": "1024"}]
    assert env.step(assistant("1,024")).reward == 1.0
    with pytest.raises(KeyError, match="'target'"):
        env.reset({"question": "no answer"})


def test_python_episode() -> None:
    # The default isolation where this machine has it (test_envs_sandbox.py covers both).
    isolation = "socket_guard" if isinstance(bubblewrap_isolation(), str) else "bwrap"
    env = build_environment("python", tool_timeout_s=60.0, tool_isolation=isolation)  # ends by itself
    assert isinstance(env, PythonToolEnv)
    env.reset(RECORD)
    step = env.step(assistant("Let me count.\n" + call("python", code="boxes = 17\nprint(boxes * 23 + 4)")))
    assert step.observations == [{"role": "tool", "content": "395\n"}] and step.tool_failures == 0
    step = env.step(assistant(call("python", code="print(undefined_name)")))
    assert step.tool_failures == 1 and "NameError" in step.observations[0]["content"]
    assert step.observations[0]["content"].endswith("[exit status 1]")
    done = env.step(assistant("The answer is 395"))
    assert (done.done, done.reward) == (True, 1.0)


@pytest.mark.parametrize(
    ("text", "answer", "matches"),
    [
        ("395", "395", True),
        ("= 395.0", 395, True),
        ("1,024 pens", "1024", True),
        ("0.30000000000000004", "0.3", True),
        ("-3", "3", False),
        ("no number", "3", False),
    ],
)
def test_answer_matching(text: str, answer: Any, matches: bool) -> None:
    assert answer_matches(text, answer) is matches
