"""Hand-written teachers obeying the rollout worker's Scorer interface, in-process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from recipe_gkd.runtime.local_pools import InProcessTeacher
from teacher_server.wire.protocol import TeacherScores, scores_from_logprobs


class HFTopKScorer:
    """A hand-written teacher obeying the Scorer interface: an HF model scored in-process."""

    def __init__(self, model_dir: Path, top_k: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
        self.top_k = top_k
        self.calls: list[tuple[list[np.ndarray], list[int]]] = []

    @torch.no_grad()
    def score(self, sequences: list[np.ndarray], score_from: list[int]) -> list[TeacherScores]:
        self.calls.append((sequences, score_from))
        out = []
        for seq, first in zip(sequences, score_from, strict=True):
            ids = torch.as_tensor(seq, dtype=torch.long)[None]
            logprobs_LV = torch.log_softmax(self.model(input_ids=ids).logits[0], dim=-1)
            # Row j describes token first + j, predicted from position first + j - 1.
            out.append(scores_from_logprobs(logprobs_LV[first - 1 : len(seq) - 1].numpy(), seq[first:], self.top_k))
        return out


class RecordingScorer:
    """The in-process teacher, keeping what it was asked to score (a Scorer, like the server's client)."""

    def __init__(self, teacher: InProcessTeacher) -> None:
        self.teacher = teacher
        self.asked: list[tuple[list[int], int]] = []

    def score(self, sequences: list[np.ndarray], score_from: list[int]) -> list[TeacherScores]:
        self.asked += [(s.tolist(), start) for s, start in zip(sequences, score_from, strict=True)]
        return self.teacher.score(sequences, score_from)
