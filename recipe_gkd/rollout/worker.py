"""The rollout worker: reads its prompt shard, samples with the student, has the teacher score.

One class for every engine: the engine (`hf` or `vllm`) only generates and loads weights.
The worker is a plain class: the Ray pool (recipe_gkd/runtime/ray_pools.py) wraps it so that the
shards go into Ray's object store, the local pool (recipe_gkd/runtime/local_pools.py) calls it directly.
Finished sequences go to the teacher from here, and the results come out as one `TrainShard`
per actor data-parallel rank plus small `RolloutStats` (all the driver reads).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from recipe_gkd.batch import TEACHER_SUMS, RolloutStats, ScoredSequence, TrainShard, actor_rank_of
from recipe_gkd.config import GKDConfig, cpu_threads, rollout_engines
from recipe_gkd.config.teachers import DEFAULT_TEACHER
from recipe_gkd.data import Dataset, Prompt, ShardedStream, answer_reward
from recipe_gkd.process_memory import worker_memory_mb
from recipe_gkd.rollout.answer_accuracy import AnswerAccuracy
from recipe_gkd.rollout.engine import Engine, Scorer
from recipe_gkd.rollout.producers import BatchProducer, Generated, build_producer, encode_checked
from recipe_gkd.rollout.samples import sample_row, samples_due
from recipe_gkd.rollout.teacher_set import ScoringTarget, TeacherSet
from recipe_gkd.stop_set import check_turn_ends
from recipe_gkd.weight_sync import PROBE_ROWS, Transport, probe_rows

# Data positions remembered per generated batch: enough for the deepest pipeline plus the checkpoint.
POSITIONS_KEPT = 4


def make_engine(cfg: GKDConfig) -> Engine:
    """The configured rollout backend (imports its engine only here)."""
    if cfg.rollout.backend.value == "hf":
        from recipe_gkd.rollout.hf import HFEngine

        return HFEngine(cfg)
    from recipe_gkd.rollout.vllm import VLLMEngine

    return VLLMEngine(cfg)


class RolloutWorker:
    """Rollout engine `rank` of `world`: its own data shard, its own teacher client."""

    def __init__(self, cfg: GKDConfig, rank: int, world: int, target: ScoringTarget) -> None:
        """`target`: the run's target kind (recipe_gkd/targets build_target), built once above the worker."""
        self.cfg = cfg
        self.target = target
        self.rank = rank
        self.world = world
        self.weight_version = 0
        self.engine: Engine | None = None
        self.teachers: TeacherSet | None = None
        self.producer: BatchProducer | None = None  # single-turn sampling, or conversations (rollout.env)
        self.weight_transport: Transport | None = None  # handed down once by the pools (init_weight_sync)
        # two_step_off runs score(t+1) beside generate(t+2) in two threads of this worker:
        # the engine (generate, weight loads) and the teacher client each take one at a time.
        self._engine_lock = threading.Lock()
        self._teacher_lock = threading.Lock()
        self._pending: dict[int, Generated] = {}
        self._position_after: dict[int, int] = {}  # batch -> prompts of this shard consumed after it

    # ------------------------------------------------------------------ set-up

    def setup(
        self, scorer: Scorer | Mapping[str, Scorer] | None = None, teacher_addresses: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """Load the engine, open the data shards, connect to the teachers. Returns small info.

        `scorer`: the teacher(s) in this process (one, or teacher name -> scorer); else one client per
        configured teacher, `teacher_addresses` (name -> address) overriding their addresses (autostarted servers).
        """
        cfg = self.cfg
        if threads := cpu_threads(cfg)["rollout"]:
            import torch

            torch.set_num_threads(threads)
        self.engine = make_engine(cfg)
        check_turn_ends(cfg, self.engine.stop)  # a same-tokenizer teacher ends a turn where the student does
        self.producer = build_producer(cfg, self.engine, self.world)
        if scorer is None:
            self.teachers = TeacherSet.connect(cfg, self.target, self.engine.tokenizer, teacher_addresses)
        else:
            scorers = scorer if isinstance(scorer, Mapping) else {DEFAULT_TEACHER: scorer}
            self.teachers = TeacherSet(cfg, self.target, scorers, self.engine.tokenizer)
        train = Dataset(cfg.data.train_files, "data.train_files")
        self.train_stream = ShardedStream(train, cfg.data.seed, self.rank, self.world)
        self.eval_dataset = Dataset(cfg.data.eval_files, "data.eval_files") if cfg.data.eval_files else None
        self.per_step = cfg.data.train_batch_size // rollout_engines(cfg)
        return {"rank": self.rank, "train_prompts": len(train), "backend": cfg.rollout.backend.value}

    def set_position(self, prompts_consumed: int) -> None:
        """Resume: this worker has already used `prompts_consumed` prompts of its shard."""
        self.train_stream.position = prompts_consumed
        self._position_after.clear()

    def data_position(self, batch: int) -> int:
        """Prompts of this shard consumed up to and including batch `batch` (what a checkpoint records).

        The async schedules read ahead: the worker's current position may already include later batches.
        """
        if batch not in self._position_after:
            raise KeyError(f"rollout worker {self.rank}: no data position recorded for batch {batch}")
        return self._position_after[batch]

    # ------------------------------------------------------------------ one step

    def produce(self, step: int, dp_size: int) -> tuple[RolloutStats, list[TrainShard]]:
        """Generate this worker's share of step `step`, score it, split it over `dp_size` actor ranks.

        Returns the stats and one TrainShard per actor data-parallel rank.
        """
        self.generate(step)
        return self._score_generated(step, dp_size)

    def generate(self, step: int) -> float:
        """Sample this worker's share of step `step` and keep it here until `score(step)`; returns seconds.

        Steps must be generated in order: the prompt shard is read sequentially.
        """
        with self._engine_lock:
            prompts = self.train_stream.take(self.per_step)
            self._remember_position(step)
            first_position = (self.train_stream.position - self.per_step) * self.world + self.rank
            generated = self._generate(prompts, greedy=False, mix_from=first_position)
        self._pending[step] = generated
        return generated.seconds

    def score(self, step: int, dp_size: int) -> tuple[RolloutStats, list[TrainShard]]:
        """Send step `step`'s sequences to the teacher and publish one TrainShard per actor rank."""
        return self._score_generated(step, dp_size)

    def _score_generated(self, step: int, dp_size: int) -> tuple[RolloutStats, list[TrainShard]]:
        generated = self._pending.pop(step)
        sequences, teacher_s = self._score(generated, "data.train_files")
        stats, shards = self._publish(
            step, sequences, {"generate_s": generated.seconds, "teacher_s": teacher_s}, dp_size, generated
        )
        t = self.cfg.trainer
        if self.rank == 0 and samples_due(t.log_samples, t.log_samples_every, t.eval_every, step):
            stats.samples = self._samples(generated, sequences[: t.log_samples])
        return stats, shards

    def produce_eval(self, dp_size: int) -> tuple[RolloutStats, list[TrainShard]]:
        """Greedy responses to this worker's share of the first data.eval_batch_size held-out prompts."""
        records = self.eval_records()
        prompts = [Prompt(i, 0, records[i]) for i in range(self.rank, len(records), self.world)]
        with self._engine_lock:
            generated = self._generate(prompts, greedy=True, mix_from=None)
        sequences, teacher_s = self._score(generated, "data.eval_files")
        timings = {"generate_s": generated.seconds, "teacher_s": teacher_s}
        return self._publish(-1, sequences, timings, dp_size, generated)

    def eval_records(self) -> list[dict[str, Any]]:
        """The held-out records every evaluation reads: the first data.eval_batch_size of data.eval_files."""
        if self.eval_dataset is None:
            raise ValueError("trainer.eval_every > 0 needs data.eval_files")
        return [self.eval_dataset[i] for i in range(min(self.cfg.data.eval_batch_size, len(self.eval_dataset)))]

    def teacher_accuracy(self, own_prompt: bool = False) -> AnswerAccuracy:
        """The teacher model's greedy accuracy on the held-out records that have an answer (HF, this process):
        from the student's prompt, or (`own_prompt`) from each teacher's own prompt (its privileged context,
        docs/privileged_teacher.md; the student's prompt for a teacher without one).

        The run's report calls it after training, on rollout worker 0 (torch and transformers
        are loaded here already); the records without data.answer_key are counted, not scored.
        """
        assert self.producer is not None, "call setup() first"
        return self.producer.teacher_accuracy(self.eval_records(), own_prompt)

    def _remember_position(self, batch: int) -> None:
        self._position_after[batch] = self.train_stream.position
        for old in [b for b in self._position_after if b <= batch - POSITIONS_KEPT]:
            del self._position_after[old]

    def _generate(self, prompts: list[Prompt], greedy: bool, mix_from: int | None) -> Generated:
        """Responses to `prompts` from the run's producer (single-turn sampling, or conversations)."""
        assert self.producer is not None, "call setup() first"
        return self.producer.generate(prompts, greedy, mix_from, self.weight_version)

    def _score(self, generated: Generated, source: str) -> tuple[list[ScoredSequence], float]:
        """Each record's teacher's top-k for every response token of `generated`; returns the sequences and seconds."""
        assert self.teachers is not None, "call setup() first"
        where = [f"record {p.sample_id} of {source}" for p in generated.prompts]
        teachers = self.teachers.route([p.record for p in generated.prompts], where)
        ids = [
            np.asarray(p + r, dtype=np.int32)
            for p, (r, _) in zip(generated.prompt_ids, generated.responses, strict=True)
        ]
        starts = [len(p) for p in generated.prompt_ids]
        start = time.perf_counter()
        with self._teacher_lock:
            # Each teacher's own prompt, if it has one, replaces the student's there (the rows stay the response's).
            scores = self.teachers.score(
                teachers, ids, starts, generated.student_topk, [p.record for p in generated.prompts], where
            )
        teacher_s = time.perf_counter() - start
        n = len(generated.prompts)
        masks = generated.sampled_masks or [None] * n
        rewards = generated.env_rewards or [
            self._reward(p, r) for p, (r, _) in zip(generated.prompts, generated.responses, strict=True)
        ]
        sequences = [
            ScoredSequence(
                sample_id=prompt.sample_id,
                input_ids=seq,
                response_start=first,
                on_policy=on,
                teacher_topk_logprobs=scored.topk_logprobs,
                teacher_topk_ids=scored.topk_ids,
                teacher_tail_logmass=scored.tail_logmass,
                teacher_sampled_logprob=scored.sampled_logprob,
                # The target kind's own arrays (the teacher's hidden states, the cross-tokenizer spans), if any.
                payload=self.teachers.target.payload(scored, teacher),
                rollout_logprobs=rollout_lp,
                reward=reward,
                teacher=teacher,
                sampled_mask=mask,
            )
            for prompt, seq, first, on, (_, rollout_lp), scored, teacher, reward, mask in zip(
                generated.prompts,
                ids,
                starts,
                generated.on_policy,
                generated.responses,
                scores,
                teachers,
                rewards,
                masks,
                strict=True,
            )
        ]
        return sequences, teacher_s

    def _reward(self, prompt: Prompt, response: list[int]) -> float | None:
        """The decoded response against the record's answer (data.answer_match), when the dataset has one."""
        answer = prompt.record.get(self.cfg.data.answer_key)
        if answer is None:
            return None
        assert self.engine is not None
        text = self.engine.tokenizer.decode(response, skip_special_tokens=True)
        return answer_reward(text, str(answer), self.cfg.data.answer_match)

    def _samples(self, generated: Generated, sequences: list[ScoredSequence]) -> list[dict[str, Any]]:
        """samples.jsonl rows of `sequences` (the first of `generated`'s): text with special tokens kept."""
        assert self.engine is not None
        decode = self.engine.tokenizer.decode
        rows = []
        for seq, ended in zip(sequences, generated.endings, strict=False):
            sampled = seq.sampled_rows()
            response = seq.input_ids[seq.response_start :]
            rows.append(
                sample_row(
                    sample_id=seq.sample_id,
                    prompt=decode(seq.input_ids[: seq.response_start].tolist(), skip_special_tokens=False),
                    response=decode(response.tolist(), skip_special_tokens=False),
                    response_ids=response.tolist(),
                    ended=ended,
                    reward=seq.reward,
                    teacher_mean_logprob=(
                        float(seq.teacher_sampled_logprob[sampled].astype(np.float64).mean()) if sampled.any() else None
                    ),
                    on_policy=seq.on_policy,
                    teacher=seq.teacher,
                )
            )
        return rows

    def _publish(
        self, step: int, sequences: list[ScoredSequence], timings: dict[str, float], dp_size: int, generated: Generated
    ) -> tuple[RolloutStats, list[TrainShard]]:
        # ScoredSequence j of this worker goes to actor rank (global index) % dp: every rank gets
        # the same count when the global batch divides by dp (config.validate checks that).
        weight_version = generated.weight_version
        shards = [TrainShard(step, weight_version, timings=timings) for _ in range(dp_size)]
        for j, seq in enumerate(sequences):
            shards[actor_rank_of(self.rank, len(sequences), j, dp_size)].sequences.append(seq)
        stats = summarize(step, weight_version, sequences, timings)
        stats.episodes = generated.episodes
        stats.sampled_turns, stats.clipped_turns = generated.sampled_turns, generated.clipped_turns
        assert self.engine is not None
        stats.stop_ids = self.engine.stop.describe()
        if self.cfg.debug.log_memory:
            stats.memory_mb = worker_memory_mb(f"rollout{self.rank}")
        return stats, shards

    # ------------------------------------------------------------------ weights

    def init_weight_sync(self, transport: Transport, index: int) -> None:
        """Keep the run's transport (its payload says how the engine loads a version) and take this worker's part
        of its set-up as rollout engine `index` (a collective: the engine's receivers join the group)."""
        assert self.engine is not None, "call setup() first"
        self.weight_transport = transport
        transport.join_receiver(self.engine, index)

    def receive_weights(self, version: int, sent: Any) -> dict[str, float]:
        """Weight version `version` through the transport, then switch to it (`sent`: what actor rank 0's send
        returned, e.g. the object store's bucket handles)."""
        assert self.engine is not None and self.weight_transport is not None, "call setup() and init_weight_sync()"
        engine, transport = self.engine, self.weight_transport
        return self._switch_weights(version, lambda: transport.receive(engine, sent))

    def _switch_weights(self, version: int, load: Callable[[], set[str]]) -> dict[str, float]:
        """Run `load` (a whole version) with the engine to itself, then record the new version."""
        start = time.perf_counter()
        with self._engine_lock:
            loaded = load()
            self.weight_version = version
        return {"load_s": time.perf_counter() - start, "tensors": float(len(loaded))}

    def shutdown(self) -> None:
        """Close the teacher connections (the driver kills the process afterwards)."""
        if self.teachers is not None:
            self.teachers.close()

    def token_logprobs(self, input_ids: np.ndarray) -> np.ndarray:
        """Logprob of token t+1 at every position under the current weights (weight-sync probe)."""
        assert self.engine is not None
        with self._engine_lock:
            return self.engine.token_logprobs(input_ids)

    def sync_probe(self) -> np.ndarray:
        """The sync check's probe: the first held-out prompts (else training ones) as token ids, one length."""
        dataset = self.eval_dataset or self.train_stream.dataset
        count = min(PROBE_ROWS, len(dataset))
        assert self.engine is not None
        return probe_rows(
            [encode_checked(self.cfg, self.engine.tokenizer, Prompt(i, 0, dataset[i])) for i in range(count)]
        )

    def weight_checksums(self, dtype: str) -> list[Any]:
        """The engine's tensors fingerprinted in `dtype` (weight_sync.EngineTensor), for the sync check."""
        assert self.engine is not None
        with self._engine_lock:
            return self.engine.weight_checksums(dtype)


def add_teacher_stats(per_teacher: dict[str, dict[str, float]], seq: ScoredSequence, topk_mass: float) -> None:
    """Add `seq` to its teacher's sums (metrics per teacher, recipe_gkd.observe.metrics.teacher_columns)."""
    sums = per_teacher.setdefault(seq.teacher, dict.fromkeys(TEACHER_SUMS, 0.0))
    sums["sequences"] += 1
    sums["response_tokens"] += seq.num_sampled_tokens
    sums["teacher_topk_mass_sum"] += topk_mass
    if seq.reward is not None and seq.on_policy:
        sums["reward_sum"] += seq.reward
        sums["rewarded"] += 1


def summarize(
    step: int, weight_version: int, sequences: list[ScoredSequence], timings: dict[str, float]
) -> RolloutStats:
    """The driver's view of a step's sequences: counts and sums, no per-token data.

    Token counts and per-token sums are over the response tokens the student sampled (ScoredSequence.sampled_rows): a
    tool's output and the template's turn markers, which the teacher also scored, count in none of them.
    """
    stats = RolloutStats(
        step=step,
        weight_version=weight_version,
        num_sequences=len(sequences),
        num_response_tokens=sum(s.num_sampled_tokens for s in sequences),
        sample_ids=[s.sample_id for s in sequences],
        timings=timings,
        sample_teachers=[s.teacher for s in sequences],
    )
    for seq in sequences:
        sampled = seq.sampled_rows()
        # The server's exact tail, not 1 - sum(rounded top-k): float64 sums over tokens.
        mass = float((-np.expm1(seq.teacher_tail_logmass[sampled].astype(np.float64))).sum())
        stats.teacher_topk_mass_sum += mass
        add_teacher_stats(stats.per_teacher, seq, mass)
        if seq.reward is not None and seq.on_policy:
            stats.onpolicy_reward_sum += seq.reward
            stats.onpolicy_rewarded += 1
        elif seq.reward is not None:
            stats.offpolicy_reward_sum += seq.reward
            stats.offpolicy_rewarded += 1
        for key, value in (seq.payload.counts() if seq.payload is not None else {}).items():
            stats.alignment[key] = stats.alignment.get(key, 0.0) + value
        if seq.on_policy and seq.rollout_logprobs is not None:
            # Placeholders (0.0) sit at the rows the student did not sample: never summed.
            stats.onpolicy_tokens += seq.num_sampled_tokens
            stats.rollout_logprob_sum += float(seq.rollout_logprobs[sampled].astype(np.float64).sum())
            stats.teacher_sampled_logprob_sum += float(seq.teacher_sampled_logprob[sampled].astype(np.float64).sum())
    return stats
