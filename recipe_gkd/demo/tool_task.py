"""The tool demo's task: add three 4-digit numbers (5000-9999) with the calculator, one addition per call.

    user       "sum:6437+8479+6720"
    assistant  <tool_call>\\n{"name": "calculator", "arguments": {"expression": "6437+8479"}}\\n</tool_call>
    tool       14916
    assistant  <tool_call>\\n{"name": "calculator", "arguments": {"expression": "14916+6720"}}\\n</tool_call>
    tool       21636
    assistant  21636

Sums of 4-digit numbers are beyond what the tiny models compute in their heads, but every step of the
script is a copy: the operands from the prompt, the running total from the last tool response, the answer
from the last one. So a model that uses the tool solves the task and one that ignores the tool's output
cannot. Records are ``{"prompt", "answer", "numbers"}``; the `calculator` environment
(recipe_gkd/envs/tasks.py) gives [system, user] for a record and rewards the final number.

A scripted trajectory is encoded as the multi-turn rollout builds its ids: the first prompt through the chat
template with the generation prompt, each assistant turn as its content's ids + EOS (the tokens the student
samples), each tool turn as the template's delta (the rendering with it, minus the rendering without it).
`encode_trajectory` checks on every turn that the rendering so far is a prefix of the next one.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from recipe_gkd.demo.sft import EncodedExample, collate
from recipe_gkd.demo.task import read_records, write_records
from recipe_gkd.envs.arithmetic import CalculatorTool
from recipe_gkd.envs.protocol import Message, tool_message
from recipe_gkd.envs.registry import build_environment
from recipe_gkd.offline_models import IM_END, IM_START

TASK_NAME = "tool_sum"
ENV_NAME = "calculator"
PROMPT_PREFIX = "sum:"
# The prompt writes the numbers as the calls do (`4821+7390`): a call's operands are then copies of prompt text.
OPERATOR = "+"
NUMBERS_PER_PROMPT = 3
# Every running total then has 5 digits (10000 <= a + b, a + b + c <= 29997), so each copy sits at a fixed
# distance from its source: the tiny models learn that within minutes of CPU, not hours.
MIN_NUMBER, MAX_NUMBER = 5000, 9999
TRAIN_SIZE = 20_000
EVAL_SIZE = 500
DEV_SIZE = 128
DEFAULT_SEED = 5050
# Turns of a scripted trajectory: one call per addition, then the answer.
SCRIPTED_TURNS = NUMBERS_PER_PROMPT


@dataclass(frozen=True)
class ToolSumRecord:
    """One task record, as written to the jsonl files."""

    prompt: str
    answer: str
    numbers: tuple[int, ...]


def make_record(numbers: Sequence[int]) -> ToolSumRecord:
    """The record asking for the sum of `numbers`."""
    return ToolSumRecord(
        prompt=PROMPT_PREFIX + OPERATOR.join(str(n) for n in numbers), answer=str(sum(numbers)), numbers=tuple(numbers)
    )


@dataclass(frozen=True)
class ToolSplits:
    """Disjoint splits: `train` (written), `dev` (build-time only) and held-out `eval` (written)."""

    train: list[ToolSumRecord]
    dev: list[ToolSumRecord]
    eval: list[ToolSumRecord]


def generate_splits(
    seed: int = DEFAULT_SEED, train_size: int = TRAIN_SIZE, eval_size: int = EVAL_SIZE, dev_size: int = DEV_SIZE
) -> ToolSplits:
    """Deterministic splits of distinct prompts, drawn in the order eval, dev, train (so the held-out splits
    do not depend on `train_size`)."""
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    records: list[ToolSumRecord] = []
    while len(records) < eval_size + dev_size + train_size:
        numbers = tuple(rng.randint(MIN_NUMBER, MAX_NUMBER) for _ in range(NUMBERS_PER_PROMPT))
        if numbers not in seen:
            seen.add(numbers)
            records.append(make_record(numbers))
    return ToolSplits(
        train=records[eval_size + dev_size :],
        dev=records[eval_size : eval_size + dev_size],
        eval=records[:eval_size],
    )


def call_text(expression: str) -> str:
    """An assistant turn calling the calculator, in hermes form as the template writes a structured call."""
    arguments = json.dumps({"expression": expression})
    return f'<tool_call>\n{{"name": "calculator", "arguments": {arguments}}}\n</tool_call>'


ToolAnswer = Callable[[str], str]
"""What the tool returns for an expression (the calculator, or a wrong one for the ablation)."""


def calculator_answer(expression: str) -> str:
    """The calculator tool's own answer (the environment's)."""
    result = CalculatorTool()({"expression": expression})
    if result.failed:
        raise ValueError(f"the scripted expression {expression!r} failed: {result.content}")
    return result.content


def wrong_answer(seed: int) -> ToolAnswer:
    """A tool that answers `total+number` with `total+other`, `other` another number of the task's range: a wrong
    result distributed as the true ones are (the same leading digits), so only a model that reads it follows it.

    A uniform 5-digit number would not do: every true first total starts with 1, which a model can write without
    reading the tool, and fail on a wrong one for that reason alone.
    """
    rng = random.Random(seed)

    def answer(expression: str) -> str:
        total, _, number = expression.rpartition(OPERATOR)
        while (other := rng.randint(MIN_NUMBER, MAX_NUMBER)) == int(number):
            pass
        return calculator_answer(f"{total}{OPERATOR}{other}")

    return answer


def scripted_turns(record: ToolSumRecord, tool: ToolAnswer = calculator_answer) -> list[Message]:
    """The messages after the environment's [system, user]: add left to right, one call per addition,
    each call reading the running total from the last tool response; the answer is the last response."""
    turns: list[Message] = []
    total = str(record.numbers[0])
    for number in record.numbers[1:]:
        expression = f"{total}{OPERATOR}{number}"
        turns.append({"role": "assistant", "content": call_text(expression)})
        total = tool(expression)
        turns.append(tool_message(total))
    turns.append({"role": "assistant", "content": total})
    return turns


def start_messages(record: ToolSumRecord) -> tuple[list[Message], list[dict[str, Any]]]:
    """The environment's first messages for `record` and its tools (as the rollout renders them)."""
    env = build_environment(ENV_NAME)
    return env.reset(asdict(record)), env.tools()


def render_ids(tokenizer: Any, messages: list[Message], tools: list[dict[str, Any]], generation: bool) -> list[int]:
    return list(
        tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation, return_dict=False)
    )


class TemplateBreaksPrefix(ValueError):
    """The chat template re-renders an earlier turn differently once a later one is added."""


def encode_trajectory(tokenizer: Any, messages: list[Message], tools: list[dict[str, Any]]) -> EncodedExample:
    """Prompt ids, response ids and the sampled mask (assistant tokens) of a whole conversation, built turn by
    turn as the multi-turn rollout does; `messages` starts with the environment's [system, user]."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt_ids = render_ids(tokenizer, messages[:first], tools, generation=True)
    ids, sampled = list(prompt_ids), []
    for i in range(first, len(messages)):
        message = messages[i]
        if message["role"] == "assistant":
            turn = [*tokenizer(message["content"], add_special_tokens=False).input_ids, tokenizer.eos_token_id]
            ids += turn
            sampled += [True] * len(turn)
            if render_ids(tokenizer, messages[: i + 1], tools, generation=False) != ids:
                raise TemplateBreaksPrefix(
                    f"assistant turn {i}: generation prompt + content + EOS is not its rendering"
                )
        elif i + 1 == len(messages) or messages[i + 1]["role"] != "tool":
            # The last of a run of tool messages: the delta of the whole run, up to the next generation prompt.
            rendered = render_ids(tokenizer, messages[: i + 1], tools, generation=True)
            if rendered[: len(ids)] != ids:
                raise TemplateBreaksPrefix(f"tool turn {i}: the rendering so far is not a prefix of the next one")
            sampled += [False] * (len(rendered) - len(ids))
            ids = rendered
    return EncodedExample(prompt_ids, ids[len(prompt_ids) :], sampled)


def conversation(
    record: ToolSumRecord, tool: ToolAnswer = calculator_answer
) -> tuple[list[Message], list[dict[str, Any]]]:
    """The whole scripted conversation of `record` (answered by `tool`) and the environment's tools."""
    messages, tools = start_messages(record)
    return messages + scripted_turns(record, tool), tools


def encode_record(tokenizer: Any, record: ToolSumRecord, tool: ToolAnswer = calculator_answer) -> EncodedExample:
    """The scripted trajectory of `record` (answered by `tool`), encoded turn by turn as the rollout does."""
    return encode_trajectory(tokenizer, *conversation(record, tool))


# An assistant turn in TOOLS_CHAT_TEMPLATE's rendering: what follows its header up to its EOS, included.
_ASSISTANT_TURN = re.compile(re.escape(IM_START + "assistant\n") + "(.*?" + re.escape(IM_END) + ")", re.DOTALL)


def encode_record_fast(tokenizer: Any, record: ToolSumRecord, tool: ToolAnswer = calculator_answer) -> EncodedExample:
    """`encode_record`'s result from one rendering of the whole conversation (~10x faster: one template render
    and one tokenisation instead of one per turn); the sampled tokens are those inside an assistant turn.

    Only for TOOLS_CHAT_TEMPLATE, whose turns `_ASSISTANT_TURN` finds, with a tokenizer whose specials end its
    pieces (no token spans a turn's edge); the build checks it equals
    `encode_record` on the dev split, and a test on several records.
    """
    messages, tools = conversation(record, tool)
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [match.span(1) for match in _ASSISTANT_TURN.finditer(text)]
    sampled = [any(start <= begin < end for start, end in spans) for begin, _ in encoded["offset_mapping"]]
    first = sampled.index(True)
    ids = list(encoded["input_ids"])
    return EncodedExample(ids[:first], ids[first:], sampled[first:])


@torch.no_grad()
def argmax_share(
    model: torch.nn.Module, tokenizer: Any, encoded: Sequence[EncodedExample], batch_size: int = 64
) -> float:
    """Share of trajectories whose every sampled (assistant) token is the model's argmax under teacher forcing.

    With a deterministic tool, greedy decoding reproduces a trajectory exactly iff this holds for it: each
    assistant token is then the greedy choice, and each tool delta is what the tool answers to those choices.
    """
    model.eval()
    correct = 0
    for start in range(0, len(encoded), batch_size):
        batch = encoded[start : start + batch_size]
        input_ids_BL, attention_BL, labels_BL = collate(batch, tokenizer.pad_token_id)
        logits_BLV = model(input_ids=input_ids_BL, attention_mask=attention_BL).logits
        # Position t predicts token t + 1; labels are IGNORE_INDEX (negative) off the sampled tokens.
        predicted_BL = logits_BLV[:, :-1].argmax(dim=-1)
        labels_BL = labels_BL[:, 1:]
        wrong_B = ((predicted_BL != labels_BL) & (labels_BL >= 0)).any(dim=1)
        correct += int((~wrong_B).sum())
    return correct / len(encoded)


def write_jsonl(path: str | Path, records: Iterable[ToolSumRecord]) -> Path:
    """One JSON object per line, sorted keys (reproducible bytes)."""
    return write_records(path, ({**asdict(r), "numbers": list(r.numbers)} for r in records))


def read_jsonl(path: str | Path, limit: int | None = None) -> list[ToolSumRecord]:
    """The first `limit` records (all when None) of a task jsonl file."""
    return [ToolSumRecord(r["prompt"], r["answer"], tuple(r["numbers"])) for r in read_records(path, limit)]
