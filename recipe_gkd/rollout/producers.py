"""How a rollout worker produces a batch of responses, chosen once: single-turn sampling or whole conversations.

A producer turns a batch's prompts into `Generated` (what the teacher then scores; the worker assembles the scored
sequences into the step's shards in one place, recipe_gkd/rollout/worker.py `_score` and `_publish`), and answers
for the teacher's own held-out accuracy the same way the student's is measured. `build_producer` picks the class
from the config (rollout.env); the worker holds the object and never asks which it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from recipe_gkd.config import GKDConfig
from recipe_gkd.config.schema import LoRAConfig
from recipe_gkd.config.teachers import DEFAULT_TEACHER, record_teacher, teacher_handles
from recipe_gkd.data import Prompt, encode_prompt, encode_response
from recipe_gkd.rollout.answer_accuracy import AnswerAccuracy
from recipe_gkd.rollout.engine import Engine
from recipe_gkd.rollout.multi_turn import MultiTurnRollout, conversation_accuracy, conversation_counts, episode_seed
from recipe_gkd.teacher_prompt import own_prompt_encoder

# Salt that separates the on/off-policy coin flips from the epoch order's random stream.
MIX_SALT = 0x6B64
# Salt of the per-batch sampling seed (same for a resumed run: a function of the stream position).
SAMPLE_SALT = 0x5EED
# How an off-policy response (the dataset's own, algorithm.lmbda < 1) "ended" in samples.jsonl.
DATASET_ENDING = "dataset"


@dataclass
class Generated:
    """A step's responses waiting for the teacher (kept inside the rollout worker)."""

    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    on_policy: list[bool]
    responses: list[tuple[list[int], np.ndarray | None]]
    weight_version: int  # the weights these were sampled with
    seconds: float
    # rollout.student_top_k: per response the engine's [n, k_s] top ids (None: not sampled, or k_s = 0).
    student_topk: list[np.ndarray | None]
    # rollout.env (multi-turn): per response the tokens the student sampled, the environment's reward, and the
    # batch's episode counters (multi_turn.conversation_counts); None / {} for single-turn rollouts.
    sampled_masks: list[np.ndarray | None] | None = None
    env_rewards: list[float] | None = None
    episodes: dict[str, float] = field(default_factory=dict)
    # How each response ended (StopSet.ending; "dataset" for an off-policy one), and the generate
    # calls' turns: sampled (one per on-policy response, one per turn of a conversation) and cut by the length limit.
    endings: list[str] = field(default_factory=list)
    sampled_turns: int = 0
    clipped_turns: int = 0


def encode_checked(cfg: GKDConfig, tokenizer: Any, prompt: Prompt) -> list[int]:
    """A record's prompt ids as the student samples from them, within data.max_prompt_length."""
    d = cfg.data
    ids = encode_prompt(tokenizer, prompt.record, d.prompt_key, d.apply_chat_template)
    if len(ids) > d.max_prompt_length:
        raise ValueError(
            f"prompt {prompt.sample_id} has {len(ids)} tokens > data.max_prompt_length={d.max_prompt_length}; "
            "raise data.max_prompt_length or filter the dataset"
        )
    return ids


def sampling_seed(data_seed: int, first_position: int) -> int:
    """The sampling seed of the batch whose first prompt is at `first_position` of the stream."""
    return int(np.random.SeedSequence([data_seed, SAMPLE_SALT, first_position]).generate_state(1)[0])


class BatchProducer(Protocol):
    """What the rollout worker asks of the way it produces responses."""

    def generate(self, prompts: list[Prompt], greedy: bool, mix_from: int | None, version: int) -> Generated:
        """Responses to `prompts` sampled with weight version `version`; `mix_from`: the batch's first stream
        position (seeds, on/off-policy coins), None for an evaluation (greedy, every response sampled)."""
        ...

    def teacher_accuracy(self, records: list[dict[str, Any]], own_prompt: bool) -> AnswerAccuracy:
        """The teacher model's greedy accuracy on the held-out `records` that have an answer, as the student's."""
        ...


class SingleTurn:
    """One response per prompt: sampled by the student, or the dataset's own (off-policy, 1 - algorithm.lmbda)."""

    def __init__(self, cfg: GKDConfig, engine: Engine, world: int) -> None:
        self.cfg, self.engine, self.world = cfg, engine, world

    def generate(self, prompts: list[Prompt], greedy: bool, mix_from: int | None, version: int) -> Generated:
        prompt_ids = [encode_checked(self.cfg, self.engine.tokenizer, p) for p in prompts]
        on_policy = [True] * len(prompts) if mix_from is None else self._on_policy_flags(mix_from, len(prompts))
        start = time.perf_counter()
        to_sample = [ids for ids, on in zip(prompt_ids, on_policy, strict=True) if on]
        # Seeded by the batch's first stream position: a resumed run samples what an uninterrupted one did.
        seed = None if mix_from is None else sampling_seed(self.cfg.data.seed, mix_from)
        sampled = iter(self.engine.generate(to_sample, greedy=greedy, seed=seed))
        responses: list[tuple[list[int], np.ndarray | None]] = []
        student_topk: list[np.ndarray | None] = []
        endings: list[str] = []
        clipped = 0
        stop = self.engine.stop
        for prompt, on in zip(prompts, on_policy, strict=True):
            if on:
                gen = next(sampled)
                responses.append((gen.response_ids, gen.logprobs))
                student_topk.append(gen.topk_ids)
                endings.append(stop.ending(gen.stop_id))
                clipped += gen.stop_id is None
            else:
                # The reference response closes its turn as the template does (the stop set's closing id).
                ids = encode_response(self.engine.tokenizer, prompt.record, self.cfg.data.response_key, stop.closing_id)
                responses.append((ids, None))
                student_topk.append(None)
                endings.append(DATASET_ENDING)
        return Generated(
            prompts,
            prompt_ids,
            on_policy,
            responses,
            version,
            time.perf_counter() - start,
            student_topk,
            endings=endings,
            sampled_turns=sum(on_policy),
            clipped_turns=clipped,
        )

    def _on_policy_flags(self, first_position: int, count: int) -> list[bool]:
        """GKD's lambda per sequence, fixed by (seed, stream position) so a resumed run flips the same coins."""
        lmbda = self.cfg.algorithm.lmbda
        if lmbda >= 1.0:
            return [True] * count
        positions = [first_position + k * self.world for k in range(count)]
        return [bool(np.random.default_rng([self.cfg.data.seed, MIX_SALT, p]).random() < lmbda) for p in positions]

    def teacher_accuracy(self, records: list[dict[str, Any]], own_prompt: bool) -> AnswerAccuracy:
        """Each record's own teacher answers it (several teachers: docs/teachers.md), from the student's prompt or
        (`own_prompt`) from the teacher's own (its privileged context)."""
        from recipe_gkd.rollout.answer_accuracy import model_answer_accuracy

        cfg = self.cfg
        handles = teacher_handles(cfg)
        by_teacher: dict[str, list[dict[str, Any]]] = {}
        for i, record in enumerate(records):
            by_teacher.setdefault(record_teacher(cfg, record, f"record {i} of data.eval_files"), []).append(record)
        parts = [
            model_answer_accuracy(
                handles[name].section.model_path,
                group,
                cfg.data,
                cfg.rollout.sampling.max_new_tokens,
                own_prompt_encoder(handles[name], cfg.data) if own_prompt else None,
            )
            for name, group in by_teacher.items()
        ]
        return AnswerAccuracy(*(sum(getattr(p, f) for p in parts) for f in ("correct", "answered", "records")))


class Conversations:
    """rollout.env: each prompt's whole conversation with its environment (recipe_gkd/rollout/multi_turn.py).

    Seeds as single-turn sampling's (the batch's first stream position; per turn derived from it), and each
    environment's from (data.seed, sample id, epoch): a resumed run holds the same conversations.
    """

    def __init__(self, cfg: GKDConfig, engine: Engine) -> None:
        self.cfg = cfg
        self.loop = MultiTurnRollout.from_config(cfg, engine)

    def generate(self, prompts: list[Prompt], greedy: bool, mix_from: int | None, version: int) -> Generated:
        loop = self.loop
        start = time.perf_counter()
        tool_s = loop.tool_seconds
        conversations = [
            loop.start(p.sample_id, p.record, episode_seed(self.cfg.data.seed, p.sample_id, p.epoch)) for p in prompts
        ]
        loop.run(
            conversations, greedy=greedy, seed=None if mix_from is None else sampling_seed(self.cfg.data.seed, mix_from)
        )
        seconds = time.perf_counter() - start
        stop = loop.template.stop
        endings = [f"{c.ending}; last turn: " + stop.ending(c.last_stop) for c in conversations]
        return Generated(
            prompts,
            [c.prompt_ids for c in conversations],
            [True] * len(prompts),
            [(c.response_ids, c.rollout_logprobs()) for c in conversations],
            version,
            seconds,
            [None] * len(prompts),
            sampled_masks=[c.sampled_mask() for c in conversations],
            env_rewards=[c.reward for c in conversations],
            episodes={**conversation_counts(conversations), "tool_s": loop.tool_seconds - tool_s},
            endings=endings,
            sampled_turns=sum(c.turns for c in conversations),
            clipped_turns=sum(c.clipped_turns for c in conversations),
        )

    def teacher_accuracy(self, records: list[dict[str, Any]], own_prompt: bool) -> AnswerAccuracy:
        """The teacher model holds the held-out conversations greedily, as the student's evaluation does (an HF
        engine on the teacher's files, in this process; one teacher, no prompt of its own: the config rules)."""
        from recipe_gkd.rollout.hf import HFEngine

        cfg = self.cfg
        teacher_dir = teacher_handles(cfg)[DEFAULT_TEACHER].section.model_path
        # The teacher's own weights, no student adapter (actor.lora is the student's; this engine never syncs).
        as_teacher = replace(
            cfg,
            model=replace(cfg.model, student_path=teacher_dir, tokenizer_path=""),
            actor=replace(cfg.actor, lora=LoRAConfig()),
        )
        loop = MultiTurnRollout.from_config(as_teacher, HFEngine(as_teacher))
        return conversation_accuracy(loop, records, cfg.data.answer_key, cfg.data.seed)


def build_producer(cfg: GKDConfig, engine: Engine, world: int) -> SingleTurn | Conversations:
    """The producer of `cfg` (rollout.env: conversations; else single-turn sampling), built once by the worker."""
    return Conversations(cfg, engine) if cfg.rollout.env else SingleTurn(cfg, engine, world)
