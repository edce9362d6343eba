"""algorithm.cross_tokenizer (span / uld): a teacher of another tokenizer, scored in its own tokens.

The scorer is a CrossTokenizerScorer (recipe_gkd/cross_tokenizer/route.py): it sends each record's prompt and the
decoded response as text and maps the reply onto the student's tokens by byte spans. Its payload is the span
structure of the response (and its alignment counts, for the metrics); on the actor every loss is per span over
the whole vocabulary (recipe_gkd/losses/cross_tokenizer.py), and the sampled-token objective's advantage is the
span's (losses.span_advantages).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from recipe_gkd.config import GKDConfig
from recipe_gkd.cross_tokenizer.span_scores import AlignedScores
from recipe_gkd.rollout.engine import Scorer
from recipe_gkd.targets.base import Target
from teacher_server.wire.protocol import TeacherScores

if TYPE_CHECKING:
    from torch import Tensor

    from recipe_gkd.actor.collate import MicroBatch
    from recipe_gkd.rollout.prompt_join import PromptJoin
    from recipe_gkd.targets.base import ActorSide


@runtime_checkable
class RecordScorer(Protocol):
    """A teacher scored in its own tokens: the records' prompts and the responses as text."""

    def score_records(
        self, sequences: list[np.ndarray], score_from: list[int], records: list[dict[str, Any]]
    ) -> list[TeacherScores]: ...


@dataclass
class Spans:
    """The payload: per response token, > 0 at the first token of an aligned span (its token count), 0 inside one,
    -1 unaligned (recipe_gkd/cross_tokenizer/span_scores.py); the teacher arrays hold the span's values at its first
    token. `alignment`: the response's alignment counts (metrics only)."""

    span_len_N: np.ndarray  # int32 [L - response_start]
    alignment: dict[str, float] = field(default_factory=dict)

    def rows(self) -> int:
        return int(self.span_len_N.shape[0])

    def counts(self) -> dict[str, float]:
        return self.alignment

    @staticmethod
    def collate(payloads: Sequence[Any], rows: Sequence[slice], seq_len: int) -> Tensor:
        """int64 [B, T]: each sequence's span structure at its loss positions `rows[b]` (-1 off the response)."""
        import torch

        out_BT = np.full((len(payloads), seq_len), -1, dtype=np.int64)
        for b, (payload, predicted) in enumerate(zip(payloads, rows, strict=True)):
            out_BT[b, predicted] = payload.span_len_N
        return torch.from_numpy(out_BT)


class CrossTokenizerSpans(Target):
    """Targets aligned by byte spans from a teacher of another tokenizer (algorithm.cross_tokenizer=span or uld)."""

    name: ClassVar[str] = "cross_tokenizer"
    teacher_tokenizer_on_rollout: ClassVar[bool] = True
    gathers_vocabulary: ClassVar[bool] = True

    def connect(self, view: GKDConfig, tokenizer: Any, address: str | None) -> Scorer:
        """Every teacher is scored in its own tokens (any tokenizer accepted)."""
        from recipe_gkd.cross_tokenizer.route import CrossTokenizerScorer

        return CrossTokenizerScorer.connect(view, tokenizer, address)  # type: ignore[return-value]

    def teacher_inputs(
        self,
        join: PromptJoin,
        sequences: list[np.ndarray],
        score_from: list[int],
        records: list[dict[str, Any]] | None,
        where: list[str],
    ) -> tuple[list[np.ndarray], list[int], list[dict[str, Any]] | None]:
        """The teacher renders its own prompt in its own tokens and chat template (teacher_server/wire/conversation.py):
        the records go with the teacher's prompt as their prompt; the student's ids are decoded as before."""
        if records is None:
            raise ValueError("algorithm.cross_tokenizer needs each sequence's record")
        return sequences, score_from, join.records(records, where)

    def score(
        self,
        scorer: Scorer,
        sequences: list[np.ndarray],
        score_from: list[int],
        student_topk: list[np.ndarray | None],
        records: list[dict[str, Any]] | None,
    ) -> list[TeacherScores]:
        if records is None or not isinstance(scorer, RecordScorer):
            raise ValueError("algorithm.cross_tokenizer needs a CrossTokenizerScorer and each sequence's record")
        return scorer.score_records(sequences, score_from, records)

    def payload(self, scored: TeacherScores, teacher: str) -> Spans:
        if not isinstance(scored, AlignedScores) or scored.span_len is None:
            raise ValueError(
                "algorithm.cross_tokenizer but the scorer's reply carries no spans (a same-tokenizer one?)"
            )
        return Spans(scored.span_len, dict(scored.counts))

    def sends_topk(self) -> bool:
        return False  # a top-k over the student's vocabulary on shared spans only

    def loss_sum(
        self, objective: ActorSide, logits_BTv: Tensor, micro: MicroBatch, divergence: str
    ) -> tuple[Tensor, Tensor]:
        """The per-span terms of recipe_gkd/losses/cross_tokenizer.py over the whole vocabulary, the same on every
        TP rank (ActorObjective.full_vocabulary)."""
        from recipe_gkd.losses import cross_tokenizer_loss_sum

        refuse_unsampled_tokens(micro)
        if micro.payload is None:
            raise ValueError(
                "algorithm.cross_tokenizer but the micro-batch carries no spans (a same-tokenizer scorer?)"
            )
        a = self.cfg.algorithm
        return cross_tokenizer_loss_sum(
            objective.full_vocabulary(logits_BTv),
            micro.target_ids_BT,
            micro.teacher_logprobs_BTK,
            micro.teacher_ids_BTK,
            micro.teacher_tail_BT,
            micro.teacher_sampled_BT,
            micro.payload,
            micro.loss_mask_BT,
            objective=a.cross_tokenizer.value,
            divergence=divergence,  # type: ignore[arg-type]
            beta=a.beta,
            temperature=a.temperature,
        )

    def sampled_inputs(self, micro: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """Each token's advantage is its span's."""
        from recipe_gkd.losses import span_advantages

        refuse_unsampled_tokens(micro)
        if micro.payload is None:
            raise ValueError("algorithm.cross_tokenizer but the micro-batch carries no spans")
        advantage, use, mask_BT = span_advantages(
            micro.teacher_sampled_BT, micro.rollout_logprobs_BT, micro.payload, micro.loss_mask_BT
        )
        return mask_BT, {"advantage": advantage, "advantage_mask": use}


def refuse_unsampled_tokens(micro: MicroBatch) -> None:
    """Byte spans map a response the student sampled whole; a response with tokens it did not sample (a multi-turn
    rollout's tool output) is refused, never trained on as if sampled."""
    if not bool(micro.sampled_mask_BT.all()):
        unsampled = int((~micro.sampled_mask_BT).sum())
        raise ValueError(
            f"algorithm.cross_tokenizer: the micro-batch holds {unsampled} response tokens the student did not "
            "sample (multi-turn rollouts, rollout.env): spans across tokenizers do not support them yet; use a "
            "teacher of the student's tokenizer (algorithm.cross_tokenizer=none) for multi-turn rollouts"
        )
