"""What the actor minimises over a target kind's targets, one class per objective, chosen once from the config.

- `TargetDivergence`: the configured divergence (forward KL, reverse KL, JSD) over the kind's targets (recipe_gkd/targets).
- `SampledReverseKL` (algorithm.divergence=sampled_reverse_kl): a policy-gradient step on the reverse KL from the
  teacher's logprob of each sampled token (recipe_gkd/losses/sampled.py); it combines with every kind that sends
  that logprob, and reports its policy statistics (advantage, importance ratio).

Each class holds its loss sum over a micro-batch (on the actor), and what the divergence watch reads of it in a
metrics row (on the driver: nothing here imports torch at module level).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from recipe_gkd.config import Divergence as DivergenceKey
from recipe_gkd.config import GKDConfig

if TYPE_CHECKING:
    from torch import Tensor

    from recipe_gkd.actor.collate import MicroBatch
    from recipe_gkd.targets.base import ActorSide


class Objective:
    """The trained objective (a subclass per objective, OBJECTIVES)."""

    # Whether the actor reports the policy statistics (observe/rows.py POLICY_KEYS) of this objective.
    policy_statistics: ClassVar[bool] = False
    # The figure the divergence watch follows (observe/divergence_watch.py), as its line names it.
    watched: ClassVar[str] = "the loss"

    def __init__(self, cfg: GKDConfig) -> None:
        self.cfg = cfg

    def loss_sum(self, actor: ActorSide, logits_BTv: Tensor, micro: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """The objective's sum over the micro-batch's loss tokens, and its logged sums (same on all TP ranks)."""
        raise NotImplementedError

    def watched_figure(self, row: dict[str, Any]) -> float:
        """The watched figure in a metrics.jsonl row."""
        return float(row["loss"])

    def settings_to_change(self) -> str:
        """Beyond the learning rate, what the divergence line tells a user to change ("" for nothing)."""
        return ""


class TargetDivergence(Objective):
    """The configured divergence (algorithm.divergence) over the target kind's targets."""

    def loss_sum(self, actor: ActorSide, logits_BTv: Tensor, micro: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        return actor.loss_sum(logits_BTv, micro)[0], {}


class SampledReverseKL(Objective):
    """The sampled-token reverse KL: per sampled token, -ratio x (log t - log s_old) (recipe_gkd/losses/sampled.py)."""

    policy_statistics: ClassVar[bool] = True
    watched: ClassVar[str] = "the sampled reverse KL estimate (-advantage_mean)"

    def loss_sum(self, actor: ActorSide, logits_BTv: Tensor, micro: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """The surrogate's sum over the loss tokens, and its policy sums and extremes (ActorObjective.policy_stats)."""
        import torch

        from recipe_gkd.losses import sampled_reverse_kl_loss_sum

        logits_BTv = logits_BTv[..., actor.vocab_shard]
        tp = actor.layout.tp_size > 1
        mask_BT, advantage = actor.target.sampled_inputs(micro)
        loss_sum, _, stats = sampled_reverse_kl_loss_sum(
            logits_BTv,
            micro.target_ids_BT,
            micro.rollout_logprobs_BT,
            micro.teacher_sampled_BT,
            mask_BT,
            ratio_clip=self.cfg.algorithm.ratio_clip,
            vocab_start=actor.vocab_start if tp else 0,
            vocab_size=actor.vocab_size if tp else None,
            group=actor.tp_group if tp else None,
            **advantage,
        )
        sums = torch.stack([stats.advantage_sum, stats.ratio_sum, stats.clipped])
        return loss_sum, {"policy_sums": sums, "policy_extremes": torch.stack([stats.ratio_max, -stats.ratio_min])}

    def watched_figure(self, row: dict[str, Any]) -> float:
        # -advantage_mean = mean(log s_old - log t): metrics' sampled_reverse_kl, also when that is None
        # (sampling temperature != 1 makes it no unbiased KL estimate, but it is still what the loss lowers).
        return -float(row["advantage_mean"])

    def settings_to_change(self) -> str:
        clip = self.cfg.algorithm.ratio_clip
        if clip:
            return f"lower algorithm.ratio_clip (now {clip:g})"
        return "set algorithm.ratio_clip (now 0, no clip; e.g. 0.1)"


def build_objective(cfg: GKDConfig) -> Objective:
    """The run's objective, built once (algorithm.divergence)."""
    if cfg.algorithm.divergence == DivergenceKey.sampled_reverse_kl:
        return SampledReverseKL(cfg)
    return TargetDivergence(cfg)
