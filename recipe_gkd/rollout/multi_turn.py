"""Multi-turn rollouts, token in, token out: the student talks with a tool-using environment (`rollout.env`).

1. Each record's environment gives the first messages (`reset`, seeded by data seed, sample id and epoch); the
   prompt is their chat-template rendering with the environment's tools.
2. Per turn, ONE batched `Engine.generate` for the live conversations, each allowed
   min(rollout.sampling.max_new_tokens, the room left under rollout.max_total_tokens) new tokens.
3. Each environment reads its assistant message (the text of the sampled ids) and runs its tool calls (the
   environments side by side, every call bounded by rollout.tool_timeout_s).
4. The tool results join as the template's delta: render [..., assistant] (A) and [..., assistant, tools] with
   the generation prompt (B), check that B starts with A, append the rest of A's assistant turn after the sampled
   EOS, then B[len(A):]. Earlier turns are never re-tokenised; the sampled ids stay as sampled.
5. A conversation ends on its answer (the environment is done), rollout.max_turns or rollout.max_total_tokens.

The response is everything after the first prompt: `sampled` marks the student's own tokens, the rest (turn
markers, tool results) are attended by the actor and the teacher but never trained (ScoredSequence.sampled_mask).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from recipe_gkd.config import GKDConfig
from recipe_gkd.envs import Environment, Message, StepResult, build_environment
from recipe_gkd.rollout.answer_accuracy import AnswerAccuracy
from recipe_gkd.rollout.engine import Engine, Generation
from recipe_gkd.stop_set import StopSet

# Environments stepped side by side (each mostly waits on a tool: a sandbox subprocess, an API).
MAX_ENV_THREADS = 16
# Salts of the seeds derived here (distinct from the worker's data-order and sampling salts).
EPISODE_SALT = 0xE9150DE
TURN_SALT = 0x7E4A
ENDINGS = ("answer", "max_turns", "max_total_tokens")


class TemplateMismatch(RuntimeError):
    """The chat template does not render a tool turn as an extension of the conversation before it."""


def episode_seed(data_seed: int, sample_id: int, epoch: int) -> int:
    """The environment's seed for one record in one epoch: the same on a resumed run."""
    return int(np.random.SeedSequence([data_seed, EPISODE_SALT, sample_id, epoch]).generate_state(1)[0])


def turn_seed(batch_seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` of a batch sampled with `batch_seed`."""
    return int(np.random.SeedSequence([batch_seed, TURN_SALT, turn]).generate_state(1)[0])


@dataclass
class Conversation:
    """One record's conversation: its messages, the ids so far, which response ids the student sampled."""

    sample_id: int
    env: Environment
    messages: list[Message]
    tools: list[dict[str, Any]]
    prompt_ids: list[int]
    rendered: list[int]  # the template's ids of `messages` + the generation prompt (the prefix of the next A)
    response_ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # sampling logprobs; 0.0 where not sampled
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    clipped_turns: int = 0  # turns the length limit cut (no stop id sampled)
    last_stop: int | None = None  # the stop id the last sampled turn ended with (None: cut by the length)
    ending: str = ""  # one of ENDINGS once it has ended

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def add(self, ids: list[int], sampled: bool, logprobs: np.ndarray | None = None) -> None:
        self.response_ids.extend(ids)
        self.sampled.extend([sampled] * len(ids))
        self.logprobs.extend([0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs])

    def sampled_mask(self) -> np.ndarray:
        return np.asarray(self.sampled, dtype=bool)

    def rollout_logprobs(self) -> np.ndarray:
        return np.asarray(self.logprobs, dtype=np.float32)


class ChatTemplate:
    """The tokenizer's chat template as the loop uses it: render ids, and the ids a tool turn appends."""

    def __init__(self, tokenizer: Any, stop: StopSet) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        if stop.closing_id is None:
            raise TemplateMismatch(
                f"the tokenizer of {self.name!r} has no EOS and its chat template closes a turn with no special "
                "token: the rollout cannot tell where a turn ends"
            )
        self.close_id: int = stop.closing_id

    def ids(self, messages: list[Message], tools: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=generation_prompt, return_dict=False
            )
        )

    def text(self, gen: Generation) -> str:
        """The assistant message's text: the sampled ids without their stop id, special tokens kept (a
        `<tool_call>` may be one)."""
        body = gen.response_ids[:-1] if gen.stop_id is not None else gen.response_ids
        return self.tokenizer.decode(body, skip_special_tokens=False)

    def tool_turn(
        self, conv: Conversation, assistant: Message, observations: list[Message], stopped: bool
    ) -> tuple[list[int], list[int]]:
        """The ids that follow the sampled assistant turn up to the next generation prompt, and B (the template's
        ids of the whole conversation so far, the next turn's prefix). `stopped`: the turn ended on a stop id,
        which stands for the template's own close (its first token)."""
        a_ids = self.ids([*conv.messages, assistant], conv.tools, generation_prompt=False)
        b_ids = self.ids([*conv.messages, assistant, *observations], conv.tools, generation_prompt=True)
        if b_ids[: len(a_ids)] != a_ids:
            at = next((i for i, (x, y) in enumerate(zip(a_ids, b_ids, strict=False)) if x != y), len(b_ids))
            raise TemplateMismatch(
                f"the chat template of {self.name!r} renders the conversation with its tool results "
                f"differently from the conversation without them (first difference at token {at}: "
                f"{self.tokenizer.decode(a_ids[at : at + 8])!r} vs {self.tokenizer.decode(b_ids[at : at + 8])!r}); "
                "a tool turn cannot be appended token by token (rollout.env needs an append-only template)"
            )
        close = self._turn_close(conv, a_ids)
        return (close[1:] if stopped else close) + b_ids[len(a_ids) :], b_ids

    def _turn_close(self, conv: Conversation, a_ids: list[int]) -> list[int]:
        """The template's end of the assistant turn, the last turn of A: from A's last turn-end token (the stop
        set's closing id: ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`) to its end. The turn's content is not
        compared: the sampled ids stand."""
        close = self.close_id
        last = len(a_ids) - 1 - a_ids[::-1].index(close) if close in a_ids else -1
        # The generation prompt ends before the assistant's content, so its close must come after that point.
        if last < len(conv.rendered) - 1:
            raise TemplateMismatch(
                f"the chat template of {self.name!r} does not close an assistant turn with "
                f"{self.stop.name(close)!r} (the stop set: {self.stop.describe()}): the rollout cannot tell where "
                "a turn ends"
            )
        return a_ids[last:]


@dataclass(frozen=True)
class Limits:
    """The loop's bounds (rollout.max_turns, rollout.max_total_tokens, rollout.sampling.max_new_tokens)."""

    max_turns: int
    max_total_tokens: int
    max_new_tokens: int


class MultiTurnRollout:
    """Runs whole conversations of a batch of records on an engine; one environment per conversation."""

    def __init__(
        self, engine: Engine, new_env: Callable[[], Environment], limits: Limits, max_prompt_length: int
    ) -> None:
        self.engine = engine
        self.template = ChatTemplate(engine.tokenizer, engine.stop)
        self.new_env = new_env
        self.limits = limits
        self.max_prompt_length = max_prompt_length
        self.tool_seconds = 0.0  # wall seconds spent in the environments' steps (tools), over all runs

    @classmethod
    def from_config(cls, cfg: GKDConfig, engine: Engine) -> MultiTurnRollout:
        """The loop of `rollout.env` and its bounds (rollout.max_turns, max_total_tokens, tool_timeout_s, ...)."""
        r = cfg.rollout
        limits = Limits(r.max_turns, r.max_total_tokens, r.sampling.max_new_tokens)
        return cls(engine, environment_factory(cfg), limits, cfg.data.max_prompt_length)

    def start(self, sample_id: int, record: dict[str, Any], seed: int) -> Conversation:
        env = self.new_env()
        messages = env.reset(record, seed=seed)
        tools = env.tools()
        prompt_ids = self.template.ids(messages, tools, generation_prompt=True)
        if len(prompt_ids) > self.max_prompt_length:
            raise ValueError(
                f"prompt {sample_id} has {len(prompt_ids)} tokens (with the {env.name} environment's system prompt and "
                f"tools) > data.max_prompt_length={self.max_prompt_length}; raise data.max_prompt_length"
            )
        return Conversation(sample_id, env, messages, tools, prompt_ids, list(prompt_ids))

    def run(self, conversations: list[Conversation], *, greedy: bool, seed: int | None) -> list[Conversation]:
        """Every conversation to its end; returns them (the same objects)."""
        for turn in range(self.limits.max_turns):
            live = [c for c in conversations if not c.ending and self._has_room(c)]
            if not live:
                break
            rooms = [min(self.limits.max_new_tokens, self.limits.max_total_tokens - c.length) for c in live]
            generations = self.engine.generate(
                [c.prompt_ids + c.response_ids for c in live],
                greedy=greedy,
                seed=None if seed is None else turn_seed(seed, turn),
                max_new_tokens=rooms,
            )
            assistants = [self._take_turn(c, g) for c, g in zip(live, generations, strict=True)]
            started = time.perf_counter()
            with ThreadPoolExecutor(max_workers=min(len(live), MAX_ENV_THREADS), thread_name_prefix="env") as pool:
                steps = list(pool.map(lambda c, a: c.env.step(a), live, assistants))
            self.tool_seconds += time.perf_counter() - started
            for conv, assistant, step, gen in zip(live, assistants, steps, generations, strict=True):
                self._after_step(conv, assistant, step, gen)
        for conv in conversations:
            if not conv.ending:  # out of turns (an environment that does not end itself) or of tokens
                conv.ending = "max_total_tokens" if not self._has_room(conv) else "max_turns"
        return conversations

    def _has_room(self, conv: Conversation) -> bool:
        if conv.length < self.limits.max_total_tokens:
            return True
        conv.ending = conv.ending or "max_total_tokens"
        return False

    def _take_turn(self, conv: Conversation, gen: Generation) -> Message:
        conv.turns += 1
        conv.last_stop = gen.stop_id
        conv.add(gen.response_ids, sampled=True, logprobs=gen.logprobs)
        if gen.stop_id is None:
            conv.clipped_turns += 1
        return {"role": "assistant", "content": self.template.text(gen)}

    def _after_step(self, conv: Conversation, assistant: Message, step: StepResult, gen: Generation) -> None:
        conv.tool_calls += step.tool_calls
        conv.tool_failures += step.tool_failures
        stopped = gen.stop_id is not None
        if step.done:
            # The environment scores what it read (a turn cut by the token budget too, as single-turn rollouts are).
            conv.messages.append(assistant)
            conv.reward = step.reward
            cut = not stopped and conv.length >= self.limits.max_total_tokens
            conv.ending = "max_turns" if step.truncated else "max_total_tokens" if cut else "answer"
            return
        between, rendered = self.template.tool_turn(conv, assistant, step.observations, stopped)
        if conv.length + len(between) >= self.limits.max_total_tokens:
            conv.messages.append(assistant)
            conv.ending = "max_total_tokens"  # no room for the tool's result and one more token
            return
        conv.add(between, sampled=False)
        conv.messages.extend([assistant, *step.observations])
        conv.rendered = rendered


def environment_factory(cfg: GKDConfig) -> Callable[[], Environment]:
    """A fresh environment of `rollout.env` per call, with the run's options (its turns, tool-call format, record keys,
    tool timeout and isolation)."""
    r, d = cfg.rollout, cfg.data

    def new_env() -> Environment:
        return build_environment(
            r.env,
            max_turns=r.max_turns,
            tool_call_format_name=r.tool_call_format,
            prompt_key=d.prompt_key,
            answer_key=d.answer_key,
            tool_timeout_s=r.tool_timeout_s,
            tool_isolation=r.tool_isolation,
        )

    return new_env


def conversation_accuracy(
    rollout: MultiTurnRollout, records: list[dict[str, Any]], answer_key: str, data_seed: int
) -> AnswerAccuracy:
    """Greedy conversations on the `records` that have `answer_key`, as an evaluation holds them (record i seeded as
    sample i of epoch 0): the share the environment rewards; the records without an answer are only counted."""
    answered = [(i, r) for i, r in enumerate(records) if r.get(answer_key) is not None]
    conversations = [rollout.start(i, r, episode_seed(data_seed, i, 0)) for i, r in answered]
    rollout.run(conversations, greedy=True, seed=None)
    return AnswerAccuracy(
        correct=float(sum(c.reward for c in conversations)), answered=len(conversations), records=len(records)
    )


def conversation_counts(conversations: list[Conversation]) -> dict[str, float]:
    """A batch's episode counters (RolloutStats.episodes): conversations, turns, tool calls and failures, tool
    tokens (response tokens the student did not sample), and how the conversations ended."""
    counts = {
        "conversations": float(len(conversations)),
        "turns": float(sum(c.turns for c in conversations)),
        "tool_calls": float(sum(c.tool_calls for c in conversations)),
        "tool_failures": float(sum(c.tool_failures for c in conversations)),
        "tool_tokens": float(sum(len(c.sampled) - sum(c.sampled) for c in conversations)),
    }
    for ending in ENDINGS:
        counts[f"ended_{ending}"] = float(sum(c.ending == ending for c in conversations))
    return counts
