"""algorithm.support=teacher_topk: the teacher's top-k (+ its exact tail) over the student's vocabulary.

One request per step returns, per scored position, the top-k logprobs and ids, the server's exact tail log-mass
and the sampled token's logprob; the loss is the configured divergence over the K + 1 outcomes (vocabulary-parallel
at TP > 1: recipe_gkd/losses/topk.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from recipe_gkd.targets.base import Target

if TYPE_CHECKING:
    from torch import Tensor

    from recipe_gkd.actor.collate import MicroBatch
    from recipe_gkd.targets.base import ActorSide


class TopK(Target):
    """The teacher's top-k over the student's vocabulary, plus one tail bucket."""

    name: ClassVar[str] = "teacher_topk"

    def loss_sum(
        self, objective: ActorSide, logits_BTv: Tensor, micro: MicroBatch, divergence: str
    ) -> tuple[Tensor, Tensor]:
        """Sum of per-token divergences over the micro-batch's loss tokens (same on all TP ranks)."""
        from recipe_gkd.losses import gkd_loss_sum, vocab_parallel_gkd_loss_sum

        a = self.cfg.algorithm
        kwargs: dict[str, Any] = {
            "divergence": divergence,
            "beta": a.beta,
            "temperature": a.temperature,
            "tail": a.tail,
            "teacher_tail_logmass": micro.teacher_tail_BT,
        }
        # Padded vocabulary columns are not tokens: they are cut off, never given mass.
        logits_BTv = logits_BTv[..., objective.vocab_shard]
        batch = (micro.teacher_logprobs_BTK, micro.teacher_ids_BTK, micro.loss_mask_BT)
        if objective.layout.tp_size == 1:
            return gkd_loss_sum(logits_BTv, *batch, **kwargs)
        return vocab_parallel_gkd_loss_sum(
            logits_BTv,
            *batch,
            vocab_start=objective.vocab_start,
            vocab_size=objective.vocab_size,
            group=objective.tp_group,
            **kwargs,
        )
