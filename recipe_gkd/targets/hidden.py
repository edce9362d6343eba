"""teacher.output=hidden: the teacher's final hidden states, and its output head on the actor.

The client asks for each scored position's final hidden state and no top-k (TeacherClient.from_config); every
reply must carry them. They travel as this kind's payload in the wire's 16 bits (HiddenStates); the actor turns
them into the teacher's whole distribution with the teacher's output head (this rank's rows of the ids both heads
have, loaded once on the last pipeline stage; recipe_gkd/actor/teacher_head.py, recipe_gkd/losses/hidden.py), so
every divergence is over the whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from recipe_gkd.config import GKDConfig, Precision
from recipe_gkd.config.teachers import teacher_handles
from recipe_gkd.rollout.engine import Scorer
from recipe_gkd.targets.base import Target
from teacher_server.wire.protocol import TeacherScores

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from recipe_gkd.actor.collate import MicroBatch
    from recipe_gkd.targets.base import ActorSide


def torch_dtype(name: str) -> torch.dtype:
    """torch's dtype of the wire's 16-bit hidden states ("bfloat16" / "float16")."""
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16}[name]


@dataclass(frozen=True)
class HiddenStates:
    """The payload: the teacher's final hidden states [N, H] as the wire carried them, 2 bytes a value.

    numpy has no bfloat16, so the values travel (and cross Ray's object store) as their 16 bits; the actor
    reinterprets them as torch's bfloat16 / float16 (`collate`), half the bytes of float32.
    """

    bits: np.ndarray  # uint16 [N, H]
    dtype: str  # "bfloat16" or "float16" (teacher.client.hidden_dtype)

    @staticmethod
    def from_float32(values_NH: np.ndarray, dtype: str) -> HiddenStates:
        """Values already rounded to `dtype` (the client decodes the wire to float32): re-encoded exactly."""
        from teacher_server.wire import hidden_codec

        bits = np.frombuffer(hidden_codec.encode(values_NH, dtype), dtype="<u2").reshape(values_NH.shape)
        return HiddenStates(bits, dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bits.shape)

    def to_float32(self) -> np.ndarray:
        from teacher_server.wire import hidden_codec

        return hidden_codec.decode(self.bits.tobytes(), self.dtype, self.bits.shape[-1]).reshape(self.bits.shape)

    def rows(self) -> int:
        return int(self.bits.shape[0])

    def counts(self) -> dict[str, float]:
        return {}

    def tensor(self) -> Tensor:
        """[N, H] in torch's bfloat16 / float16: the same 16 bits (copied: arrays from Ray's object store are read-only)."""
        import torch

        return torch.tensor(np.ascontiguousarray(self.bits).view(np.int16)).view(torch_dtype(self.dtype))

    @staticmethod
    def collate(payloads: Sequence[Any], rows: Sequence[slice], seq_len: int) -> Tensor:
        """[B, T, H] in the wire's 16-bit dtype until the teacher's head multiplies them (recipe_gkd/losses/hidden.py):
        each sequence's states at its loss positions `rows[b]`, 0 elsewhere."""
        import torch

        kinds = {(p.dtype, int(p.bits.shape[-1])) for p in payloads}
        if len(kinds) != 1:
            raise ValueError(f"sequences disagree on the teacher's hidden states: {kinds} (teacher.output)")
        dtype, width = kinds.pop()
        out_BTH = torch.zeros((len(payloads), seq_len, width), dtype=torch_dtype(dtype))
        for b, (payload, predicted) in enumerate(zip(payloads, rows, strict=True)):
            out_BTH[b, predicted] = payload.tensor()
        return out_BTH


class Hidden(Target):
    """The whole vocabulary from the teacher's hidden states and its output head (teacher.output=hidden)."""

    name: ClassVar[str] = "hidden"
    teacher_on_actor: ClassVar[bool] = True
    head_vH: Tensor | None = None  # this rank's rows of the teacher's head (None off the last stage)
    shard: slice | None = None  # this rank's columns of the ids both heads have (setup_actor)

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
    ) -> list[TeacherScores]:
        replies = scorer.score(sequences, score_from)
        if any(reply.hidden_states is None for reply in replies):
            raise ValueError("teacher.output=hidden but the teacher's reply carries no hidden states")
        return replies

    def payload(self, scored: TeacherScores, teacher: str) -> HiddenStates:
        """The states in the wire's 16 bits again (half the bytes of float32 through Ray's object store)."""
        assert scored.hidden_states is not None  # checked by `score`
        dtype = teacher_handles(self.cfg)[teacher].section.client.hidden_dtype
        return HiddenStates.from_float32(scored.hidden_states, dtype)

    def payload_bytes_per_token(self, teacher_hidden_size: int | None) -> int:
        """The teacher's hidden size in 16-bit values (0 when its config.json cannot be read)."""
        from teacher_server.wire.hidden_codec import HIDDEN_ITEMSIZE

        return 0 if teacher_hidden_size is None else teacher_hidden_size * HIDDEN_ITEMSIZE

    def sends_topk(self) -> bool:
        return False  # the whole vocabulary: no top-k travels

    def sends_logprobs(self) -> bool:
        return False  # the server sends hidden states only, no logprob (the loss is exact)

    def evaluates_kl(self) -> bool:
        return True

    @staticmethod
    def _head_ref(cfg: GKDConfig, vocab_size: int) -> Any:
        """The teacher's head in `cfg`'s files (the config as the reading process resolved its paths)."""
        from recipe_gkd.actor.teacher_head import find_teacher_head, tokenizer_size

        m = cfg.model
        return find_teacher_head(cfg.teacher.model_path, vocab_size, tokenizer_size(m.tokenizer_path or m.student_path))

    def check_before_start(self) -> None:
        """The teacher's head is there and covers the ids the student's tokenizer produces."""
        from recipe_gkd.actor import hf_arch

        self._head_ref(self.cfg, hf_arch.read_student_arch(self.cfg.model.student_path).vocab_size)

    def setup_actor(self, objective: ActorSide) -> None:
        """This rank's columns of the ids both heads have, and (on the last pipeline stage: the loss is there) the
        teacher's head rows for them [v, H]."""
        import torch

        from recipe_gkd.actor.teacher_head import load_teacher_head_shard

        # The actor's own config: its paths resolved on its node (the kind was built where the pools are).
        ref = self._head_ref(objective.cfg, objective.vocab_size)
        self.shard = objective.layout.local_vocab_slice(objective.vocab_size, ref.loss_vocab_size)[1]
        if not objective.layout.is_last_stage:
            return
        # The actor's compute dtype: bf16 runs multiply the teacher's hidden states in bf16, as the teacher does.
        dtype = torch.bfloat16 if self.cfg.actor.precision == Precision.bf16 else torch.float32
        rows = self.shard.stop - self.shard.start
        self.head_vH = load_teacher_head_shard(ref, objective.vocab_start, rows, dtype, objective.device)

    def loss_sum(
        self, objective: ActorSide, logits_BTv: Tensor, micro: MicroBatch, divergence: str
    ) -> tuple[Tensor, Tensor]:
        """The divergence over the whole vocabulary, the teacher's logits from its hidden states (same on all TP ranks)."""
        from recipe_gkd.losses import hidden_gkd_loss_sum

        if micro.payload is None or self.head_vH is None or self.shard is None:
            raise ValueError("teacher.output=hidden but the micro-batch carries no teacher hidden states")
        a = self.cfg.algorithm
        return hidden_gkd_loss_sum(
            logits_BTv[..., self.shard],
            micro.payload,
            self.head_vH,
            micro.loss_mask_BT,
            divergence=divergence,  # type: ignore[arg-type]
            beta=a.beta,
            temperature=a.temperature,
            group=objective.tp_group if objective.layout.tp_size > 1 else None,
        )
