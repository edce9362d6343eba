"""What the training loop may ask of its workers: the actor pool, the rollout pool, the weight sync.

`gkd.train` and `checkpoint` talk to these Protocols only. Two implementations:
- `recipe_gkd/runtime/ray_pools.py`: every worker a Ray actor in its placement-group bundle; every wait
  bounded by debug.hang_timeout_s, the workers' set-up by debug.setup_timeout_s (every real run,
  CPU demo included).
- `recipe_gkd/runtime/local_pools.py`: the workers as plain objects in the driver's own process, one actor
  rank (the in-process tests: the same loop, in milliseconds per step).

Work a pool launches comes back as a `Pending` handle, awaited through the same pool, so a
schedule can keep work in flight (one_step_off: batch t+1 is produced while the actor trains on
batch t). A rollout worker's result per step is its `RolloutStats` plus one shard handle per
actor data-parallel rank; the driver passes shard handles on to the actor pool untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from recipe_gkd.batch import RolloutStats
from recipe_gkd.rollout.answer_accuracy import AnswerAccuracy
from recipe_gkd.weight_sync import EngineTensor

# Work launched on a pool and not yet awaited (Ray: object refs; local: results already computed).
Pending = Any
# A TrainShard as the driver holds it (Ray: an object ref; local: the TrainShard itself).
ShardHandle = Any
# Per rollout worker: its step statistics and, per actor data-parallel rank, the handle of its shard.
Produced = tuple[RolloutStats, list[ShardHandle]]


class RolloutPool(Protocol):
    """The rollout workers, each with its own prompt shard and teacher client."""

    size: int

    def produce(self, step: int) -> Pending:
        """Every worker generates and scores its share of batch `step` (awaited: list[Produced])."""
        ...

    def generate(self, step: int) -> Pending:
        """Every worker samples its share of batch `step` and keeps it until `score(step)`."""
        ...

    def score(self, step: int) -> Pending:
        """Every worker has the teacher score what it generated for `step` (awaited: list[Produced])."""
        ...

    def produce_eval(self) -> Pending:
        """Greedy responses to the held-out prompts, scored (awaited: list[Produced])."""
        ...

    def wait(self, pending: Pending, phase: str) -> list[Any]:
        """The results of `pending`, one per worker; a worker's error is raised here."""
        ...

    def wait_done(self, pending: Pending, phase: str) -> None:
        """Block until `pending` has finished, without fetching (nor raising) its results."""
        ...

    def data_positions(self, batch: int) -> list[int]:
        """Per worker: prompts of its shard consumed up to and including batch `batch`."""
        ...

    def set_positions(self, positions: list[int]) -> None:
        """Resume: per worker, prompts of its shard already consumed."""
        ...

    def teacher_accuracy(self, own_prompt: bool = False) -> AnswerAccuracy:
        """The teacher model's greedy accuracy on the held-out records with an answer (worker 0, after training), from
        the student's prompt or (`own_prompt`) from each teacher's own prompt (privileged context)."""
        ...


class ActorPool(Protocol):
    """The actor ranks (megatron): one optimizer step over all of them per batch."""

    dp_size: int
    summary: str  # rank 0's one-line account of how it computes

    def train(self, shards: list[list[ShardHandle]]) -> list[dict[str, float]]:
        """One optimizer step; shards[dp rank][rollout worker]. Returns each rank's statistics."""
        ...

    def eval_loss(self, shards: list[list[ShardHandle]], teacher: str | None = None) -> dict[str, float | None]:
        """Forward-only divergence and teacher KL on `shards` (only teacher `teacher`'s sequences when given)."""
        ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def export_hf(self, out_dir: str) -> None:
        """The student as an HF directory (every rank takes part; rank 0 writes); a LoRA student merged."""
        ...

    def export_adapter(self, out_dir: str) -> None:
        """A LoRA student's adapter as a PEFT directory (every rank takes part; rank 0 writes)."""
        ...


class WeightSync(Protocol):
    """Actor -> rollout weights (weight_sync.* settings): one whole version per push."""

    def push(self, version: int) -> dict[str, float]:
        """Every rollout worker holds the actor's current weights as `version` afterwards.

        Returns {"sync_export_s", "sync_load_s", "sync_bytes"}; raises WeightSyncError naming the side that failed.
        """
        ...

    def logprob_probe(self) -> tuple[np.ndarray, list[np.ndarray]]:
        """The sync check: the actor's token logprobs [R, L-1] on a fixed probe and each rollout engine's."""
        ...

    def weight_checksums(self, dtype: str) -> tuple[dict[str, int], list[list[EngineTensor]]]:
        """The sync check's fingerprints in `dtype`: per HF name the actor's export, per engine its tensors."""
        ...


@dataclass
class Pools:
    """Everything `gkd.train` drives."""

    actor: ActorPool
    rollout: RolloutPool
    weights: WeightSync
    setup_s: float
