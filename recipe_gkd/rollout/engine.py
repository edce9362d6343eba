"""What a rollout backend is to the rollout worker: the Engine and Scorer protocols and one `Generation`.

The worker (recipe_gkd/rollout/worker.py) picks the backend (`make_engine`); the backends
(rollout/hf.py, rollout/vllm.py) implement `Engine`; the teacher client implements `Scorer`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from recipe_gkd.stop_set import StopSet
from teacher_server.wire.protocol import TeacherScores

if TYPE_CHECKING:
    from recipe_gkd.weight_sync import EngineTensor


@dataclass
class Generation:
    """One sampled response: token ids (ending with a stop id unless cut by max_new_tokens) and their logprobs."""

    response_ids: list[int]
    logprobs: np.ndarray  # float32 [len(response_ids)], under the unscaled student distribution
    # rollout.student_top_k > 0: the student's top ids at each response position, most likely first.
    topk_ids: np.ndarray | None = None  # int32 [len(response_ids), student_top_k]
    # The stop id the response ends with (its last token; recipe_gkd/stop_set.py), None when the length
    # limit cut it.
    stop_id: int | None = None


class Engine(Protocol):
    """What a rollout backend implements."""

    tokenizer: Any
    stop: StopSet  # where every response ends (the student's EOS, generation_config.json's, the turn end)

    def generate(
        self,
        prompts: list[list[int]],
        *,
        greedy: bool,
        seed: int | None = None,
        max_new_tokens: list[int] | None = None,
    ) -> list[Generation]:
        """One response per prompt; `max_new_tokens` per prompt (None: rollout.sampling.max_new_tokens for all)."""
        ...

    def update_weights(self, named: Iterator[tuple[str, Any]]) -> set[str]:
        """Load a whole version from a stream of (HF name, array or tensor); raise if any tensor is left stale (the full
        student's load: recipe_gkd/weight_sync/payload.py FullStudent)."""
        ...

    def join_weight_group(
        self, backend: str, host: str, port: int, first_rank: int, world_size: int, timeout_s: float
    ) -> None:
        """Join the gloo/nccl weight-sync group from rank `first_rank` (one rank per receiving process)."""
        ...

    def receive_weights(self) -> set[str]:
        """Receive one version over the weight-sync group and load it (draining the rest on an error); the full
        student's load when the engine's own receivers joined a gloo/nccl group."""
        ...

    def update_adapter(self, named: Iterator[tuple[str, Any]]) -> set[str]:
        """Load a whole LoRA adapter version in its sync form (recipe_gkd/weight_sync/adapter.py) over the base
        weights the engine started with; raise if any adapter tensor is missing (the adapter-only load:
        recipe_gkd/weight_sync/payload.py AdapterOnly). Every later generate and probe uses it."""
        ...

    def token_logprobs(self, input_ids: np.ndarray) -> np.ndarray: ...

    def weight_checksums(self, dtype: str) -> list[EngineTensor]:
        """Every tensor the engine computes with, fingerprinted in `dtype` (the training dtype's torch name), with
        the HF tensors it holds (recipe_gkd/weight_sync/check.py tensor_checksum); with actor.lora.rank > 0 the
        adapter's tensors alone, under their PEFT names (the base is never synced), none before the first version."""
        ...


class Scorer(Protocol):
    """The teacher as the rollout worker sees it."""

    def score(
        self, sequences: list[np.ndarray], score_from: list[int], named_ids: list[np.ndarray] | None = None
    ) -> list[TeacherScores]:
        """Per sequence: the teacher's top-k, tail and sampled-token logprob for positions score_from..

        named_ids (per sequence [n_scored, k_s]): also the teacher's logprobs at those ids and its mass
        outside the top-k and them (TeacherScores.named_logprobs, other_logmass).
        """
        ...
