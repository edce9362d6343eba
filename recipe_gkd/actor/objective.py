"""The actor's loss driving: what the last pipeline stage computes from its logits shard per micro-batch.

The configured divergence over the run's target kind (recipe_gkd/targets: the teacher's top-k vocabulary-parallel
over TP, the whole vocabulary from the teacher's hidden states, spans across tokenizers; the kind computes its own
sum), or the sampled-token reverse KL with its policy statistics; each micro-batch gives a token *sum*, which
megatron's schedule backpropagates and `finalize_model_grads` divides by the global token count.

Several teachers (docs/teachers.md): the same loss is also summed over each teacher's rows alone, without
gradient (one more loss forward over the micro-batch's tokens, no model pass), for the per-teacher
`teacher_<name>_loss` metrics.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from recipe_gkd.actor.collate import MicroBatch
from recipe_gkd.config import GKDConfig
from recipe_gkd.config.teachers import split_teachers
from recipe_gkd.parallel_layout import ParallelLayout


class LossTarget(Protocol):
    """What the actor calls on the run's target kind (recipe_gkd/targets builds it; the pools hand it down)."""

    def setup_actor(self, objective: Any) -> None: ...

    def loss_sum(
        self, objective: Any, logits_BTv: Tensor, micro: MicroBatch, divergence: str
    ) -> tuple[Tensor, Tensor]: ...

    def evaluates_kl(self) -> bool: ...


class LossObjective(Protocol):
    """What the actor calls on the run's objective (the divergence, or the sampled-token reverse KL)."""

    policy_statistics: bool

    def loss_sum(self, actor: Any, logits_BTv: Tensor, micro: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]: ...


@dataclass(frozen=True)
class ActorKinds:
    """The run's target kind and objective as one actor rank holds them: built once above the actor
    (recipe_gkd/targets actor_kinds) and handed to MegatronActor, which imports no factory."""

    target: LossTarget
    objective: LossObjective


class ActorObjective:
    """The loss of one micro-batch from this rank's logits shard [B, T, V_padded / tp], same on all TP ranks."""

    def __init__(
        self,
        cfg: GKDConfig,
        vocab_size: int,
        layout: ParallelLayout,
        device: torch.device,
        *,
        tp_group: dist.ProcessGroup,
        pp_group: dist.ProcessGroup,
        dp_group: dist.ProcessGroup,
        target: LossTarget,
        objective: LossObjective,
    ) -> None:
        """`target`, `objective`: the run's target kind and objective, built once by the actor and handed here."""
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.layout = layout
        self.device = device
        self.tp_group, self.pp_group, self.dp_group = tp_group, pp_group, dp_group
        self.vocab_start, self.vocab_shard = layout.local_vocab_slice(vocab_size)
        # The target kind's loss (and what it loads once, e.g. the teacher's output head).
        self.target = target
        self.target.setup_actor(self)
        # What is minimised over the kind's targets (the divergence, or the sampled-token reverse KL).
        self.objective = objective
        # Several teachers: the names whose rows the loss is also summed over (collate's teacher_index_B order).
        self.teacher_names: list[str] = split_teachers(cfg)

    def train_loss(self, micro: MicroBatch, logits_BTv: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """megatron's loss function in training: (loss sum, loss tokens, logged sums)."""
        # (loss sum, loss tokens, logged): with calculate_per_token_loss megatron keeps the sum as is.
        num_tokens = torch.tensor(micro.num_tokens, dtype=torch.int, device=self.device)
        per_teacher = {"teacher_sums": self.teacher_sums(logits_BTv, micro)} if self.teacher_names else {}
        loss_sum, logged = self.objective.loss_sum(self, logits_BTv, micro)
        return loss_sum, num_tokens, {"loss_sum": loss_sum.detach().double(), **logged, **per_teacher}

    def teacher_sums(self, logits_BTv: Tensor, micro: MicroBatch) -> Tensor:
        """[2 x teachers] float64: the objective's sum over each teacher's loss tokens, then their token counts.

        Without gradient, the same loss with the mask cut to one teacher's rows; a teacher without rows here is
        skipped (every TP rank holds the same micro-batch, so all skip alike and the collectives stay matched).
        """
        if micro.teacher_index_B is None:
            raise ValueError("several teachers but the micro-batch carries no teacher index (collate's teacher_names)")
        n = len(self.teacher_names)
        sums = torch.zeros(2 * n, dtype=torch.float64, device=self.device)
        with torch.no_grad():
            for i in range(n):
                mask_BT = micro.loss_mask_BT & (micro.teacher_index_B == i)[:, None]
                tokens = int(mask_BT.sum())
                if not tokens:
                    continue
                mine = dataclasses.replace(micro, loss_mask_BT=mask_BT, num_tokens=tokens)
                value = self.objective.loss_sum(self, logits_BTv, mine)[0]
                sums[i], sums[n + i] = value.double(), float(tokens)
        return sums

    def teacher_losses(self, outputs: list[dict[str, Tensor]]) -> dict[str, float]:
        """teacher_<name>_loss: the objective's token mean over each teacher's tokens of the global batch (teachers
        with tokens in it); empty with one teacher."""
        if not self.teacher_names:
            return {}
        n = len(self.teacher_names)
        sums = sum_from_last_stage(
            [out["teacher_sums"] for out in outputs], 2 * n, self.layout, self.pp_group, self.device
        )
        dist.all_reduce(sums, group=self.dp_group)
        return {
            f"teacher_{name}_loss": float(sums[i]) / float(sums[n + i])
            for i, name in enumerate(self.teacher_names)
            if sums[n + i] > 0
        }

    def eval_loss(self, micro: MicroBatch, logits_BTv: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """megatron's loss function in evaluation: the objective's sum and the forward KL's (0 with teacher.top_k=0)."""
        loss_sum = self.objective.loss_sum(self, logits_BTv, micro)[0]
        kl_sum = torch.zeros((), dtype=loss_sum.dtype, device=self.device)
        if self.target.evaluates_kl():
            kl_sum, _ = self.loss_sum(logits_BTv, micro, divergence="forward_kl")
        num_tokens = torch.tensor(micro.num_tokens, dtype=torch.int, device=self.device)
        return loss_sum, num_tokens, {"sums": torch.stack([loss_sum, kl_sum]).double()}

    def policy_stats(self, outputs: list[dict[str, Tensor]], global_tokens: int) -> dict[str, float]:
        """Token means of the advantage and ratio, the clipped fraction, the ratio's range, over the global batch
        ({} for an objective without them)."""
        if not self.objective.policy_statistics:
            return {}
        sums = sum_from_last_stage([out["policy_sums"] for out in outputs], 3, self.layout, self.pp_group, self.device)
        dist.all_reduce(sums, group=self.dp_group)
        extremes = torch.full((2,), -math.inf, dtype=torch.float64, device=self.device)
        for out in outputs:
            extremes = torch.maximum(extremes, out["policy_extremes"].reshape(2))
        if self.layout.pp_size > 1:
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.pp_group)  # -inf except on the last stage
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.dp_group)
        advantage, ratio, clipped = (float(x) / global_tokens for x in sums.tolist())
        return {
            "advantage_mean": advantage,
            "ratio_mean": ratio,
            "ratio_max": float(extremes[0].item()),
            "ratio_min": -float(extremes[1].item()),
            "ratio_clipped_frac": clipped,
        }

    def loss_sum(self, logits_BTv: Tensor, micro: MicroBatch, divergence: str | None = None) -> tuple[Tensor, Tensor]:
        """Sum of per-token divergences over the micro-batch's loss tokens (same on all TP ranks)."""
        return self.target.loss_sum(self, logits_BTv, micro, divergence or self.cfg.algorithm.divergence.value)

    def full_vocabulary(self, logits_BTv: Tensor) -> Tensor:
        """[B, T, V] logits over the whole (unpadded) vocabulary from this rank's shard [B, T, V_padded / tp].

        At TP > 1 the shards are gathered with megatron-core's `gather_from_tensor_model_parallel_region`
        (megatron/core/tensor_parallel/mappings.py, 0.16.1: `_GatherFromModelParallelRegion.forward` all-gathers
        and concatenates along the last dimension; its `backward` is `_split_along_last_dim`, which keeps this
        rank's slice of the gradient). Every TP rank then computes the same loss over the same full logits, so each
        rank's gradient of it is the full one and the split hands each shard exactly its columns, as megatron's own
        vocab-parallel cross entropy gives them. Memory: the whole vocabulary's logits of the micro-batch on every
        rank (B x T x V_padded in the logits' dtype, plus the loss's fp32 log-softmax), as at TP = 1.
        """
        if self.layout.tp_size == 1:
            return logits_BTv[..., self.vocab_shard]
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        # The shards are of equal (padded) width: concatenated they are [.., V_padded]; the padding is cut off.
        return gather_from_tensor_model_parallel_region(logits_BTv, group=self.tp_group)[..., : self.vocab_size]


def sum_from_last_stage(
    values: list[Tensor], width: int, layout: ParallelLayout, pp_group: dist.ProcessGroup, device: torch.device
) -> Tensor:
    """The sum of the last stage's per-micro-batch values [width], on every stage of the pipeline."""
    total = torch.zeros(width, dtype=torch.float64, device=device)
    for value in values:
        total += value.reshape(width)
    if layout.pp_size > 1:
        dist.all_reduce(total, group=pp_group)  # zeros except on the last stage
    return total
