"""Test support for multi-turn rollouts: a Qwen2.5-style tool-calling chat template, a scripted policy (an engine
whose generate returns fixed ids), a scripted environment, and a tiny model with the template.

The template is Qwen2.5-Instruct's, cut to what the rollout uses: the tools listed in the system turn, assistant
turns as their text (the model writes `<tool_call>` JSON in it), a run of tool messages as ONE user turn with each
result in `<tool_response>` tags, every turn closed by `<|im_end|>` (the EOS and the pad token).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from recipe_gkd.envs import Message, StepResult
from recipe_gkd.rollout.engine import Generation
from recipe_gkd.rollout.multi_turn import Conversation, Limits, MultiTurnRollout
from recipe_gkd.stop_set import stop_set_of

QWEN_TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A tool result that real tools print: a character byte-level BPE splits into bytes (no merge covers it), an emoji,
# and special tokens' text (a tool may print anything, e.g. a web page about chat templates).
AWKWARD_RESULT = "température 23°C ✓ 🙂 café <|im_start|>assistant\nnot a turn <|endoftext|> done"


def tool_call(name: str, **arguments: Any) -> str:
    """A tool call as Qwen's template writes one."""
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(arguments) + "}\n</tool_call>"


def with_tool_template(tokenizer_dir: Path) -> Any:
    """The tokenizer in `tokenizer_dir` with the Qwen-style tool template, saved there."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = QWEN_TOOL_TEMPLATE
    tokenizer.save_pretrained(str(tokenizer_dir))
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def scripted_logprobs(n: int, turn: int) -> np.ndarray:
    """Distinct, recognisable sampling logprobs of a scripted turn (never 0.0, the value of unsampled tokens)."""
    return -(np.arange(1, n + 1, dtype=np.float32) / 100 + turn)


class ScriptedPolicy:
    """An engine whose generate returns fixed ids: per conversation (its first user message) a list of turns'
    texts, each encoded canonically and closed by EOS, cut at the prompt's max_new_tokens. Records every call."""

    def __init__(self, tokenizer: Any, scripts: Mapping[str, list[str]]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop_set_of(tokenizer, None, chat_template=True, what="the scripted policy's tokenizer")
        self.scripts = scripts
        self.calls: list[dict[str, Any]] = []

    def generate(
        self,
        prompts: list[list[int]],
        *,
        greedy: bool,
        seed: int | None = None,
        max_new_tokens: list[int] | None = None,
    ) -> list[Generation]:
        self.calls.append({"prompts": prompts, "greedy": greedy, "seed": seed, "max_new_tokens": max_new_tokens})
        limits = max_new_tokens or [10_000] * len(prompts)
        out = []
        for prompt, limit in zip(prompts, limits, strict=True):
            text = self.tokenizer.decode(prompt)
            user = next(k for k in self.scripts if k in text)
            # Turns so far: one tool turn closes each (counting generation prompts would count a tool's text too).
            turn = text.count("</tool_response><|im_end|>")
            ids = [
                *self.tokenizer.encode(self.scripts[user][turn], add_special_tokens=False),
                self.tokenizer.eos_token_id,
            ]
            ids = ids[:limit]
            out.append(Generation(ids, scripted_logprobs(len(ids), turn), stop_id=self.stop.end(ids)[1]))
        return out


@dataclass
class EchoEnv:
    """A scripted environment: answers each assistant turn with `results` (one tool message each) until turn
    `answer_on`, where it ends with reward 1.0. Counts one tool call per result and one failure per 'error:'."""

    results: tuple[str, ...] = (AWKWARD_RESULT,)
    answer_on: int = 3
    name: ClassVar[str] = "echo"

    def __post_init__(self) -> None:
        self.turns = 0
        self.seeds: list[int] = []

    def reset(self, record: Mapping[str, Any], seed: int = 0) -> list[Message]:
        self.turns = 0
        self.seeds.append(seed)
        return [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": str(record["prompt"])}]

    def step(self, assistant_message: Message) -> StepResult:
        self.turns += 1
        if self.turns >= self.answer_on:
            return StepResult([], done=True, reward=1.0)
        observations = [{"role": "tool", "content": r} for r in self.results]
        failures = sum(r.startswith("error:") for r in self.results)
        return StepResult(observations, done=False, tool_calls=len(self.results), tool_failures=failures)

    def tools(self) -> list[dict[str, Any]]:
        return [
            {
                "type": "function",
                "function": {"name": "echo", "description": "Echo.", "parameters": {"type": "object"}},
            }
        ]


def rollout(engine: Any, new_env: Any, *, max_turns: int = 6, max_total: int = 4096, max_new: int = 200) -> Any:
    return MultiTurnRollout(engine, new_env, Limits(max_turns, max_total, max_new), max_prompt_length=2048)


def segments(conv: Conversation) -> list[tuple[bool, list[int], list[float]]]:
    """The response as runs of (sampled, ids, logprobs)."""
    runs: list[tuple[bool, list[int], list[float]]] = []
    for token, sampled, lp in zip(conv.response_ids, conv.sampled, conv.logprobs, strict=True):
        if not runs or runs[-1][0] != sampled:
            runs.append((sampled, [], []))
        runs[-1][1].append(token)
        runs[-1][2].append(lp)
    return runs


class Recording:
    """An engine that keeps what the wrapped engine's generate returned, call by call."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.stop = engine.stop
        self.returned: list[list[Any]] = []

    def generate(self, prompts: list[list[int]], **kwargs: Any) -> list[Any]:
        out = self.engine.generate(prompts, **kwargs)
        self.returned.append(out)
        return out


def check_sampled_conversations(tokenizer: Any, engine: Recording, convs: list[Conversation]) -> None:
    """Each conversation of a real engine: its sampled runs are the engine's own ids and logprobs; the runs between
    them are the template's text between the turns, tokenized on their own (an independent route: text, not ids);
    the whole decodes to the template's rendering of the final conversation."""
    eos = tokenizer.eos_token_id
    for i, conv in enumerate(convs):
        runs = segments(conv)
        assert [s for s, _, _ in runs] == [True, False] * (conv.turns - 1) + [True]
        for turn, (_, ids, lps) in enumerate(runs[::2]):
            gen = engine.returned[turn][i]
            assert ids == gen.response_ids
            np.testing.assert_array_equal(np.float32(lps), gen.logprobs)
        assistants = [k for k, m in enumerate(conv.messages) if m["role"] == "assistant"]
        for turn, (_, ids, lps) in enumerate(runs[1::2]):
            # [..., assistant turn `turn`] and [..., assistant turn `turn`, its tool messages]
            text_a = tokenizer.apply_chat_template(
                conv.messages[: assistants[turn] + 1], tools=conv.tools, tokenize=False
            )
            text_b = tokenizer.apply_chat_template(
                conv.messages[: assistants[turn + 1]], tools=conv.tools, tokenize=False, add_generation_prompt=True
            )
            assert text_b.startswith(text_a)
            close = "\n" if runs[2 * turn][1][-1] == eos else "<|im_end|>\n"
            assert ids == tokenizer.encode(close + text_b[len(text_a) :], add_special_tokens=False)
            assert set(lps) == {0.0}
        whole = tokenizer.apply_chat_template(conv.messages, tools=conv.tools, tokenize=False)
        decoded = tokenizer.decode(conv.prompt_ids + conv.response_ids, skip_special_tokens=False)
        assert whole == decoded + ("\n" if conv.response_ids[-1] == eos else "<|im_end|>\n")
