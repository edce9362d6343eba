"""Target kinds: what a teacher is asked for and what the loss makes of it, one class per kind.

`build_target(cfg)` is the one place the run's kind is chosen from the config (teacher.output,
algorithm.cross_tokenizer, algorithm.support); the rollout worker, the collator, the actor's objective and the
loop's metric rows hold the object and never test the kind. Adding a kind: its own module and one line in KINDS.

| kind | module | the teacher sends | payload | loss on the actor |
|---|---|---|---|---|
| teacher_topk | topk.py | top-k + exact tail + sampled logprob | none | over the top-k + tail (TP: vocab-parallel) |
| union | union.py | also logprobs at the student's top-k ids | none | the same over K + k_s columns |
| hidden | hidden.py | final hidden states | HiddenStates | over the whole vocabulary (teacher head) |
| cross_tokenizer | spans.py | a text reply in its own tokens, aligned | Spans | per span over the whole vocabulary |

The sampled-token reverse KL (algorithm.divergence=sampled_reverse_kl) is an objective, not a kind: it combines
with every kind that sends the sampled token's logprob (objectives.py: one class per objective, built once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recipe_gkd.config import CrossTokenizer, GKDConfig, Support, TeacherOutput
from recipe_gkd.targets.base import Target
from recipe_gkd.targets.hidden import Hidden
from recipe_gkd.targets.objectives import Objective, build_objective
from recipe_gkd.targets.spans import CrossTokenizerSpans
from recipe_gkd.targets.topk import TopK
from recipe_gkd.targets.union import UnionSupport

if TYPE_CHECKING:
    from recipe_gkd.actor.objective import ActorKinds

KINDS: dict[str, type[Target]] = {
    TopK.name: TopK,
    UnionSupport.name: UnionSupport,
    Hidden.name: Hidden,
    CrossTokenizerSpans.name: CrossTokenizerSpans,
}


def target_kind(cfg: GKDConfig) -> str:
    """The run's target kind (config validation, config/rules.py, has refused the combinations that mix them)."""
    if cfg.algorithm.cross_tokenizer != CrossTokenizer.none:
        return CrossTokenizerSpans.name
    if cfg.teacher.output == TeacherOutput.hidden:
        return Hidden.name
    if cfg.algorithm.support == Support.union:
        return UnionSupport.name
    return TopK.name


def build_target(cfg: GKDConfig) -> Target:
    """The run's target kind, built once."""
    return KINDS[target_kind(cfg)](cfg)


__all__ = ["KINDS", "Objective", "Target", "build_objective", "build_target", "target_kind"]


def actor_kinds(cfg: GKDConfig) -> ActorKinds:
    """The target kind and objective an actor rank computes its loss with, built once (by the pools, the export, the
    self-check) and handed to MegatronActor."""
    from recipe_gkd.actor.objective import ActorKinds

    return ActorKinds(target=build_target(cfg), objective=build_objective(cfg))
