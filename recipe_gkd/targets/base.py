"""What every target kind does (`Target`), and what most of them share: a top-k request, no payload, every column.

A target kind is one class holding the whole behaviour of one way of asking a teacher for targets:

- on the rollout worker, the scorer it connects (`connect`), the request it sends and how it unpacks the reply
  (`score`), and its own per-response arrays in the data contract (`payload`: one optional payload per kind);
- in the driver, the metric columns its replies allow (`sends_topk`, `sends_logprobs`);
- on the actor, what it loads (`setup_actor`), its loss sum over a micro-batch (`loss_sum`), the per-token
  advantages of the sampled-token objective (`sampled_inputs`) and whether evaluation has a forward KL (`evaluates_kl`).

recipe_gkd/targets/__init__.py builds the run's kind once from the config; callers hold the object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from recipe_gkd.config import GKDConfig

if TYPE_CHECKING:
    from torch import Tensor

    from recipe_gkd.actor.collate import MicroBatch
    from recipe_gkd.batch import TargetPayload
    from recipe_gkd.rollout.engine import Scorer
    from recipe_gkd.rollout.prompt_join import PromptJoin
    from teacher_server.wire.protocol import TeacherScores


class ActorSide(Protocol):
    """What a target kind and an objective read of the actor's loss driver (recipe_gkd/actor/objective.py
    ActorObjective, which holds them): the rank's vocabulary shard, its layout and device, the tensor-parallel group."""

    cfg: GKDConfig
    vocab_size: int
    vocab_start: int
    vocab_shard: slice
    layout: Any  # the rank's parallel layout (tp, pp, dp sizes and ranks)
    device: Any
    tp_group: Any
    target: Target  # the run's target kind (what an objective's sampled inputs come from)

    def full_vocabulary(self, logits_BTv: Tensor) -> Tensor:
        """[B, T, V] logits over the whole vocabulary from this rank's shard (gathered over TP)."""
        ...

    def loss_sum(self, logits_BTv: Tensor, micro: MicroBatch, divergence: str | None = None) -> tuple[Tensor, Tensor]:
        """The target kind's divergence summed over the micro-batch's loss tokens."""
        ...


class Target:
    """One target kind (a subclass per kind, recipe_gkd/targets/__init__.py KINDS); the defaults are the top-k's."""

    name: ClassVar[str] = ""
    # Whether the actor holds a part of the teacher (its output head): the memory plan counts it on the last stage.
    teacher_on_actor: ClassVar[bool] = False
    # Whether the loss gathers the whole vocabulary's logits on every TP rank (ActorSide.full_vocabulary).
    gathers_vocabulary: ClassVar[bool] = False
    # Whether the rollout worker reads the teacher's tokenizer (to map its replies onto the student's tokens).
    teacher_tokenizer_on_rollout: ClassVar[bool] = False

    def __init__(self, cfg: GKDConfig) -> None:
        self.cfg = cfg

    # ------------------------------------------------------------------ rollout worker

    def connect(self, view: GKDConfig, tokenizer: Any, address: str | None) -> Scorer:
        """The scorer of teacher `view` (its section as `teacher:`), checked against the student's tokenizer."""
        from recipe_gkd.rollout.teacher import TeacherScorer

        return TeacherScorer(view, tokenizer, address)

    def request_options(self, view: GKDConfig) -> dict[str, Any]:
        """What a request to teacher `view` asks for beside the tokens (as TeacherClient.from_config asks it)."""
        return {"top_k": view.teacher.top_k, "hidden_dtype": ""}

    def teacher_inputs(
        self,
        join: PromptJoin,
        sequences: list[np.ndarray],
        score_from: list[int],
        records: list[dict[str, Any]] | None,
        where: list[str],
    ) -> tuple[list[np.ndarray], list[int], list[dict[str, Any]] | None]:
        """What `score` is given for one teacher: its own prompt's ids joined to the student's response ids, with
        score_from at the join (the student's own without a prompt of its own; recipe_gkd/teacher_prompt.py)."""
        joined, starts = join.join(sequences, score_from, records, where)
        return joined, starts, records

    def score(
        self,
        scorer: Scorer,
        sequences: list[np.ndarray],
        score_from: list[int],
        student_topk: list[np.ndarray | None],
        records: list[dict[str, Any]] | None,
    ) -> list[TeacherScores]:
        """The teacher's scores of every sequence from score_from on, in this kind's columns.

        student_topk: per sequence the engine's [n_scored, k_s] top ids (None: not sampled by the student).
        records: the sequences' data records (their prompts, for a teacher scored in its own tokens).
        """
        return scorer.score(sequences, score_from)

    def payload(self, scored: TeacherScores, teacher: str) -> TargetPayload | None:
        """This kind's own arrays of one response teacher `teacher` scored, for its ScoredSequence (None: the common
        teacher arrays only)."""
        return None

    def payload_bytes_per_token(self, teacher_hidden_size: int | None) -> int:
        """Bytes of this kind's payload per response token through Ray's object store (the memory plan sizes it;
        `teacher_hidden_size`: the teacher's, from its config.json, None where that cannot be read)."""
        return 0

    # ------------------------------------------------------------------ metric columns

    def sends_topk(self) -> bool:
        """Whether the replies carry a top-k over the student's vocabulary (and so a top-k mass to report)."""
        return self.cfg.teacher.top_k > 0

    def sends_logprobs(self) -> bool:
        """Whether the replies carry the sampled tokens' logprobs."""
        return True

    # ------------------------------------------------------------------ actor

    def check_before_start(self) -> None:
        """Refuse, before Ray starts, what `setup_actor` would fail on (ConfigError naming the key; nothing here)."""

    def setup_actor(self, objective: ActorSide) -> None:
        """Load what the loss needs on this rank, once (nothing for a top-k)."""

    def evaluates_kl(self) -> bool:
        """Whether evaluation can compute KL(teacher || student) (not from the sampled token alone)."""
        return bool(self.cfg.teacher.top_k)

    def loss_sum(
        self, objective: ActorSide, logits_BTv: Tensor, micro: MicroBatch, divergence: str
    ) -> tuple[Tensor, Tensor]:
        """Sum of per-token divergences over the micro-batch's loss tokens, and their count (same on all TP ranks)."""
        raise NotImplementedError(f"target kind {self.name!r} has no loss")

    def sampled_inputs(self, micro: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """The sampled-token objective's loss mask and advantage arguments (none: log t - log s_old per token)."""
        return micro.loss_mask_BT, {}
