"""teacher.output=hidden: the teacher's final hidden states, and its output head on the actor.

The client asks for each scored position's final hidden state and no top-k (TeacherClient.from_config); every
reply must carry them. They travel as this kind's payload; the actor turns them into the teacher's whole
distribution with the teacher's output head (this rank's vocabulary rows, loaded once on the last pipeline stage;
recipe_gkd/losses/hidden.py), so every divergence is over the whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from recipe_gkd.config import GKDConfig, Precision
from recipe_gkd.rollout.engine import Scorer
from recipe_gkd.targets.base import Target
from teacher_server.protocol import TeacherTopK

if TYPE_CHECKING:
    from torch import Tensor

    from recipe_gkd.actor.collate import MicroBatch
    from recipe_gkd.actor.objective import ActorObjective


@dataclass
class HiddenStates:
    """The payload: the teacher's final hidden state predicting each response token (bf16/fp16 values)."""

    hidden_NH: np.ndarray  # float32 [L - response_start, H]

    def rows(self) -> int:
        return int(self.hidden_NH.shape[0])

    def counts(self) -> dict[str, float]:
        return {}

    @staticmethod
    def collate(payloads: SequenceOf[Any], rows: SequenceOf[slice], seq_len: int) -> Tensor:
        """float32 [B, T, H]: each sequence's hidden states at its loss positions `rows[b]` (0 elsewhere)."""
        import torch

        sizes = {int(p.hidden_NH.shape[-1]) for p in payloads}
        if len(sizes) != 1:
            raise ValueError(f"sequences disagree on the teacher's hidden states: widths {sizes} (teacher.output)")
        out_BTH = np.zeros((len(payloads), seq_len, sizes.pop()), dtype=np.float32)
        for b, (payload, predicted) in enumerate(zip(payloads, rows, strict=True)):
            out_BTH[b, predicted] = payload.hidden_NH
        return torch.from_numpy(out_BTH)


class Hidden(Target):
    """The whole vocabulary from the teacher's hidden states and its output head (teacher.output=hidden)."""

    name: ClassVar[str] = "hidden"
    teacher_on_actor: ClassVar[bool] = True
    head_vH: Tensor | None = None  # this rank's rows of the teacher's head (None off the last stage)

    def request_options(self, view: GKDConfig) -> dict[str, Any]:
        """The hidden states in the client's wire dtype, and no top-k."""
        return {"top_k": 0, "hidden_dtype": view.teacher.client.hidden_dtype}

    def score(
        self,
        scorer: Scorer,
        sequences: list[np.ndarray],
        score_from: list[int],
        student_topk: list[np.ndarray | None],
        records: list[dict[str, Any]] | None,
    ) -> list[TeacherTopK]:
        replies = scorer.score(sequences, score_from)
        if any(reply.hidden_states is None for reply in replies):
            raise ValueError("teacher.output=hidden but the teacher's reply carries no hidden states")
        return replies

    def payload(self, scored: TeacherTopK) -> HiddenStates:
        assert scored.hidden_states is not None  # checked by `score`
        return HiddenStates(scored.hidden_states)

    def sends_topk(self) -> bool:
        return False  # the whole vocabulary: no top-k travels

    def sends_logprobs(self) -> bool:
        return False  # the server sends hidden states only, no logprob (the loss is exact)

    def evaluates_kl(self) -> bool:
        return True

    def check_before_start(self) -> None:
        """The teacher's head is there and covers the student's vocabulary."""
        from recipe_gkd.actor import hf_arch
        from recipe_gkd.actor.teacher_head import find_teacher_head

        find_teacher_head(
            self.cfg.teacher.model_path, hf_arch.read_student_arch(self.cfg.model.student_path).vocab_size
        )

    def setup_actor(self, objective: ActorObjective) -> None:
        """This rank's rows of the teacher's output head [v, H] (None off the last pipeline stage: no loss there)."""
        import torch

        from recipe_gkd.actor.teacher_head import find_teacher_head, load_teacher_head_shard

        ref = find_teacher_head(self.cfg.teacher.model_path, objective.vocab_size)
        if not objective.layout.is_last_stage:
            return
        # The actor's compute dtype: bf16 runs multiply the teacher's hidden states in bf16, as the teacher does.
        dtype = torch.bfloat16 if self.cfg.actor.precision == Precision.bf16 else torch.float32
        shard = objective.vocab_shard
        rows = shard.stop - shard.start
        self.head_vH = load_teacher_head_shard(ref, objective.vocab_start, rows, dtype, objective.device)

    def loss_sum(
        self, objective: ActorObjective, logits_BTv: Tensor, micro: MicroBatch, divergence: str
    ) -> tuple[Tensor, Tensor]:
        """The divergence over the whole vocabulary, the teacher's logits from its hidden states (same on all TP ranks)."""
        from recipe_gkd.losses import hidden_gkd_loss_sum

        if micro.payload is None or self.head_vH is None:
            raise ValueError("teacher.output=hidden but the micro-batch carries no teacher hidden states")
        a = self.cfg.algorithm
        return hidden_gkd_loss_sum(
            logits_BTv[..., objective.vocab_shard],
            micro.payload,
            self.head_vH,
            micro.loss_mask_BT,
            divergence=divergence,  # type: ignore[arg-type]
            beta=a.beta,
            temperature=a.temperature,
            group=objective.tp_group if objective.layout.tp_size > 1 else None,
        )
