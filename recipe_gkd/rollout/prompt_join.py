"""One teacher's prompt per record joined to the student's response ids (privileged context; recipe_gkd/teacher_prompt.py).

The rollout worker's teacher set holds one per teacher; a target kind's `teacher_inputs` calls it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np

from recipe_gkd.config.teachers import TeacherHandle
from teacher_server.config.errors import ConfigError
from teacher_server.wire.protocol import tokenizer_fingerprint


class PromptJoin:
    """One teacher's prompt per record joined to the student's response ids (recipe_gkd/teacher_prompt.py).

    A teacher with a prompt of its own renders it with its own tokenizer and chat template (teacher.model_path,
    teacher.chat_template), read once on first use; its vocabulary must be the student's (the ids after the join
    are the student's sampled ids), checked then through the tokenizer hash the server handshake uses.
    """

    def __init__(self, handle: TeacherHandle, bound: int, student_tokenizer: Any) -> None:
        self.handle = handle
        self.rule = handle.prompt
        self.bound = bound
        self.student_tokenizer = student_tokenizer
        self._tokenizer: Any = None
        self._template: str | None = None
        self._lock = threading.Lock()

    def tokenizer(self) -> tuple[Any, str | None]:
        """The teacher's tokenizer and its chat template file's text (None: the tokenizer's own)."""
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                section = self.handle.section
                tokenizer = AutoTokenizer.from_pretrained(section.model_path)
                if self.student_tokenizer is not None and tokenizer_fingerprint(tokenizer) != tokenizer_fingerprint(
                    self.student_tokenizer
                ):
                    raise ConfigError(
                        self.handle.key("model_path"),
                        f"{section.model_path}'s tokenizer is not the student's, but {self.rule.key} joins "
                        f"{self.handle.who}'s own prompt to the student's response ids: the vocabularies must be one",
                    )
                self._template = Path(section.chat_template).read_text() if section.chat_template else None
                self._tokenizer = tokenizer
            return self._tokenizer, self._template

    def records(self, records: list[dict[str, Any]], where: list[str]) -> list[dict[str, Any]]:
        """The records as a teacher that renders prompts itself reads them: its own prompt as their prompt."""
        return [self.rule.teacher_record(r, w) for r, w in zip(records, where, strict=True)]

    def join(
        self,
        sequences: list[np.ndarray],
        score_from: list[int],
        records: list[dict[str, Any]] | None,
        where: list[str],
    ) -> tuple[list[np.ndarray], list[int]]:
        """The ids the teacher scores and where its scores start, per sequence (the student's own without a rule)."""
        rows = [None] * len(sequences) if records is None else records
        out = [
            self.rule.join(self.tokenizer, r, seq, start, w, self.bound)
            for seq, start, r, w in zip(sequences, score_from, rows, where, strict=True)
        ]
        return [ids for ids, _ in out], [start for _, start in out]
