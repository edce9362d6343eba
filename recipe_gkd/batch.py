"""The data that moves between workers in one step: ragged per-sequence numpy arrays.

Rollout workers build `TrainShard`s (generated or dataset responses + the teacher's top-k) and
put them in Ray's object store; the driver hands the refs to the actor ranks, which collate
them into padded tensors. Arrays are numpy so they cross processes without pickling torch.

Alignment: a sequence is `input_ids[:L]` = prompt + response. The teacher's arrays cover the
response tokens only: row j describes token `response_start + j` (the teacher's distribution
for that position, computed from the logits at the position before it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from torch import Tensor

# A teacher column that is no outcome (algorithm.support=union: a student id the teacher's top-k
# already holds): its logprob is -inf and the loss gives it zero mass on both sides.
EXCLUDED_ID = -1
# algorithm.cross_tokenizer: a teacher piece the student lacks is id FOLDED_BASE + its column (distinct, beyond
# any vocabulary): the top-k loss folds its teacher mass into the tail bucket (recipe_gkd/cross_tokenizer/span_scores.py).
FOLDED_BASE = 1 << 30


class TargetPayload(Protocol):
    """A target kind's own per-response arrays (recipe_gkd/targets): row j describes response token j."""

    def rows(self) -> int:
        """Its rows (the sequence's response tokens)."""
        ...

    def counts(self) -> dict[str, float]:
        """The response's counts the rollout worker sums for the metrics (e.g. alignment counts); may be empty."""
        ...

    @staticmethod
    def collate(payloads: Sequence[TargetPayload], rows: Sequence[slice], seq_len: int) -> Tensor:
        """The payloads of a micro-batch as one [B, seq_len, ...] tensor, sequence b's rows at positions rows[b]."""
        ...


@dataclass
class ScoredSequence:
    """One prompt with its response and the teacher's scores for every response token."""

    sample_id: int  # global index of the prompt in the dataset (for exactly-once accounting)
    input_ids: np.ndarray  # int32 [L]: prompt + response (ends with EOS unless truncated)
    response_start: int  # index of the first response token, >= 1
    on_policy: bool  # sampled from the student (True) or taken from the dataset (False)
    # K columns; with algorithm.support=union K + k_s: the teacher's top-k, then the student's top-k_s
    # ids (EXCLUDED_ID where the teacher's top-k holds them already) with the teacher's logprobs there.
    teacher_topk_logprobs: np.ndarray  # float32 [L - response_start, K]
    teacher_topk_ids: np.ndarray  # int32 [L - response_start, K]
    # log of the teacher's mass outside those columns, computed by the server from its full distribution.
    teacher_tail_logmass: np.ndarray  # float32 [L - response_start]
    # The teacher's logprob of the token actually at each response position.
    teacher_sampled_logprob: np.ndarray  # float32 [L - response_start]
    # The student's logprob of each sampled response token at sampling time (on-policy only).
    rollout_logprobs: np.ndarray | None = None  # float32 [L - response_start]
    reward: float | None = None  # task reward when the dataset defines an answer
    teacher: str = "default"  # the teacher that scored it (data.teacher_key; docs/teachers.md)
    # The target kind's own arrays (recipe_gkd/targets: the teacher's hidden states, the cross-tokenizer spans),
    # None for a kind that needs the teacher arrays above only.
    payload: TargetPayload | None = None
    # Multi-turn rollouts (recipe_gkd/envs): True where the student sampled the response token, False where the
    # token came from elsewhere (a tool's output, the chat template's turn markers between turns). Such tokens are
    # attended, never trained or counted: every loss, advantage and metric sums the True rows only. None: the
    # student sampled every response token (single-turn rollouts, dataset responses).
    sampled_mask: np.ndarray | None = None  # bool [L - response_start]

    @property
    def num_response_tokens(self) -> int:
        """Every response token, sampled or not (the teacher's arrays have this many rows)."""
        return len(self.input_ids) - self.response_start

    def sampled_rows(self) -> np.ndarray:
        """bool [L - response_start]: the response tokens the student sampled (all of them without a sampled_mask)."""
        if self.sampled_mask is None:
            return np.ones(self.num_response_tokens, dtype=bool)
        return np.asarray(self.sampled_mask, dtype=bool)

    @property
    def num_sampled_tokens(self) -> int:
        """The response tokens the student sampled: what the losses and the metrics count."""
        return self.num_response_tokens if self.sampled_mask is None else int(np.count_nonzero(self.sampled_mask))


def trained_rows(seq: ScoredSequence, mask_tool_tokens: bool) -> np.ndarray:
    """bool [L - response_start]: the response tokens the loss trains on: the sampled ones, or every one with
    algorithm.mask_tool_tokens=false (the ablation)."""
    return seq.sampled_rows() if mask_tool_tokens else np.ones(seq.num_response_tokens, dtype=bool)


def trained_tokens(seq: ScoredSequence, mask_tool_tokens: bool) -> int:
    """How many of `seq`'s response tokens the loss trains on (`trained_rows`)."""
    return seq.num_sampled_tokens if mask_tool_tokens else seq.num_response_tokens


@dataclass
class TrainShard:
    """The sequences of one step destined for one actor data-parallel rank, from one rollout worker."""

    step: int
    weight_version: int  # version of the student weights these were sampled with
    sequences: list[ScoredSequence] = field(default_factory=list)
    # Seconds spent by the producing rollout worker (generate, teacher) for this step.
    timings: dict[str, float] = field(default_factory=dict)


def only_teacher(shard: TrainShard, teacher: str | None) -> TrainShard:
    """`shard` with only the sequences teacher `teacher` scored (all of them for None)."""
    return shard if teacher is None else replace(shard, sequences=[s for s in shard.sequences if s.teacher == teacher])


def actor_rank_of(worker: int, worker_sequences: int, index: int, dp_size: int) -> int:
    """The actor data-parallel rank that sequence `index` of rollout worker `worker` goes to (of `worker_sequences`):
    global index modulo dp, so every rank gets the same count when the global batch divides by dp."""
    return (worker * worker_sequences + index) % dp_size


# A teacher's sums in RolloutStats.per_teacher (rollout/worker.py add_teacher_stats, observe/metrics.py teacher_columns).
TEACHER_SUMS = ("sequences", "response_tokens", "teacher_topk_mass_sum", "reward_sum", "rewarded")


@dataclass
class RolloutStats:
    """What a rollout worker tells the driver about a step (small: no per-token data)."""

    step: int
    weight_version: int
    num_sequences: int
    # Response tokens the student sampled (ScoredSequence.num_sampled_tokens): a tool's output is not counted.
    num_response_tokens: int
    sample_ids: list[int]
    timings: dict[str, float]
    # The teacher of each of sample_ids, in the same order.
    sample_teachers: list[str] = field(default_factory=list)
    # Per teacher: sequences, response_tokens, teacher_topk_mass_sum, reward_sum, rewarded (on-policy rewards).
    per_teacher: dict[str, dict[str, float]] = field(default_factory=dict)
    # Task reward (when the dataset has answers), split by where the response came from:
    # sampled by the student (on-policy) or the dataset's own (off-policy, algorithm.lmbda < 1).
    onpolicy_reward_sum: float = 0.0
    onpolicy_rewarded: int = 0
    offpolicy_reward_sum: float = 0.0
    offpolicy_rewarded: int = 0
    # Every sum below is over the response tokens the student sampled (ScoredSequence.sampled_rows).
    # Sum over response tokens of the teacher's top-k mass (1 - the server's exact tail mass).
    teacher_topk_mass_sum: float = 0.0
    # On-policy response tokens, and the sums of the student's (at sampling) and the teacher's
    # logprob of them: their mean difference estimates the full-vocabulary KL(student || teacher).
    onpolicy_tokens: int = 0
    rollout_logprob_sum: float = 0.0
    teacher_sampled_logprob_sum: float = 0.0
    # algorithm.cross_tokenizer: sums of the responses' alignment counts (cross_tokenizer/span_scores.ALIGN_COUNTS).
    alignment: dict[str, float] = field(default_factory=dict)
    # debug.log_memory: the worker's resident (and peak GPU) memory, MiB, keyed rollout<rank>_rss_mb, ...
    memory_mb: dict[str, float] = field(default_factory=dict)
    # rollout.env (multi-turn): the batch's conversations, turns, tool_calls, tool_failures, tool_tokens (response
    # tokens the student did not sample), ended_<answer|max_turns|max_total_tokens> and tool_s (seconds in the
    # environments); {} for single-turn rollouts (recipe_gkd/rollout/multi_turn.py conversation_counts).
    episodes: dict[str, float] = field(default_factory=dict)
    # The batch's generate turns (one per on-policy response; one per turn of a conversation) and those the length
    # limit cut (no stop id sampled): metrics.jsonl's response_clipped_frac.
    sampled_turns: int = 0
    clipped_turns: int = 0
    # The student's stop set as the engine uses it (recipe_gkd/stop_set.py StopSet.describe), for the clipped line.
    stop_ids: str = ""
    # trainer.log_samples: a few decoded responses for samples.jsonl (rollout/samples.py), on the steps that log them.
    samples: list[dict[str, Any]] = field(default_factory=list)
