"""The teacher server as the rollout worker uses it: a client checked against the student's tokenizer."""

from __future__ import annotations

from typing import Any

import numpy as np

from recipe_gkd.config import GKDConfig
from teacher_server.config.teacher import TeacherBackend
from teacher_server.wire.protocol import TeacherScores


class TeacherScorer:
    """A teacher client (the ZeroMQ server's, or teacher.backend=openai's) checked against the student's tokenizer
    at connect time.

    The vocabularies are compared through the tokenizer hash, not the embedding sizes: models of
    one family often pad their embeddings differently (Qwen2.5 0.5B vs 7B) over one tokenizer.
    """

    def __init__(self, cfg: GKDConfig, tokenizer: Any, address: str | None = None) -> None:
        from teacher_server.wire.protocol import tokenizer_fingerprint

        self.client: Any
        if cfg.teacher.backend == TeacherBackend.openai:
            # A vLLM OpenAI-compatible server the user runs (teacher.address=http://host:port/v1).
            from teacher_server.client.openai_client import OpenAITeacherClient

            self.client = OpenAITeacherClient.from_config(
                cfg.teacher, student_tokenizer=tokenizer, tokenizer_hash=tokenizer_fingerprint(tokenizer)
            )
        else:
            from teacher_server.client.zmq_client import TeacherClient

            self.client = TeacherClient.from_config(
                cfg.teacher, tokenizer_hash=tokenizer_fingerprint(tokenizer), address=address
            )
        self.client.connect()

    def score(
        self, sequences: list[np.ndarray], score_from: list[int], named_ids: list[np.ndarray] | None = None
    ) -> list[TeacherScores]:
        if named_ids is None:
            return self.client.score(sequences, score_from)
        # Only the zeromq client names ids (config.validate refuses union with teacher.backend=openai).
        return self.client.score(sequences, score_from, named_ids=named_ids)

    def close(self) -> None:
        self.client.close()
