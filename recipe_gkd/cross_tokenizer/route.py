"""One teacher of another tokenizer as the rollout worker scores with it (algorithm.cross_tokenizer).

Chosen once, when the worker connects (recipe_gkd/rollout/teacher_set.py): each response is decoded
to text in the student's tokens (align.student_text), sent with its record's prompt as a conversation,
rendered and scored by the teacher in its own tokens (teacher_server/wire/conversation.py), then aligned
span by span and mapped back onto the student's response positions (targets.aligned_scores). The loop
and the actor see one scored Sequence per response, as with any teacher.

The worker reads the teacher's tokenizer from teacher.model_path for one thing only: which teacher
pieces are student pieces (GOLD's shared-vocabulary map). Its fingerprint must be the server's
(the handshake's tokenizer hash), so the map is the one the server scores with. With
teacher.backend=openai the worker also renders with it (teacher_server/client/openai_text.py), checked against
the served tokenizer through the server's /tokenize.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from recipe_gkd.cross_tokenizer.align import align_spans, student_text
from recipe_gkd.cross_tokenizer.span_scores import AlignedScores, aligned_scores, conversation_of, vocabulary_map
from recipe_gkd.stop_set import StopSet, stop_set_of, student_stop_set
from teacher_server.wire.conversation import Conversation, token_byte_table
from teacher_server.wire.protocol import TeacherScores, tokenizer_fingerprint


class TextTeacher(Protocol):
    """What scores conversations: the ZeroMQ client, or an in-process renderer + backend in tests."""

    def score_conversations(self, conversations: Sequence[Conversation]) -> list[TeacherScores]: ...


class CrossTokenizerScorer:
    """A teacher scored in its own tokens, its replies mapped onto the student's response tokens."""

    def __init__(
        self,
        teacher: TextTeacher,
        student_tokenizer: Any,
        teacher_tokenizer: Any,
        top_k: int,
        data: Any,
        student_stop: StopSet | None = None,
    ):
        """`student_stop`: where the student's turns end (the engine's stop set; default: its tokenizer's EOS and
        chat template's turn end, without a generation_config.json)."""
        self.teacher = teacher
        self.top_k = top_k
        self.data = data
        self.student_table, student_controls = token_byte_table(student_tokenizer, "model.student_path")
        teacher_table, teacher_controls = token_byte_table(teacher_tokenizer, "teacher.model_path")
        self.student_stop = student_stop or stop_set_of(
            student_tokenizer, None, chat_template=data.apply_chat_template, what="model.student_path"
        )
        # The teacher's end of turn maps to the id the student closes a turn with.
        self.mapping = vocabulary_map(
            self.student_table,
            teacher_table,
            self.student_stop.closing_id,
            teacher_tokenizer.eos_token_id,
            _names(student_tokenizer, student_controls),
            _names(teacher_tokenizer, teacher_controls),
        )

    @classmethod
    def connect(cls, cfg: Any, student_tokenizer: Any, address: str | None) -> CrossTokenizerScorer:
        """The teacher's client for `cfg.teacher` (any tokenizer accepted), checked against teacher.model_path's
        tokenizer: the ZeroMQ server renders the conversations itself; with teacher.backend=openai the client renders
        them with the same code (teacher_server/client/openai_text.py), an OpenAI-compatible server giving no byte offsets."""
        from transformers import AutoTokenizer

        from teacher_server.client.zmq_client import TeacherClient, TeacherMismatchError
        from teacher_server.config.teacher import TeacherBackend

        if cfg.teacher.backend == TeacherBackend.openai:
            from teacher_server.client.openai_text import OpenAITextTeacher

            text_teacher = OpenAITextTeacher.connect(cfg.teacher)
            try:
                return cls(
                    text_teacher,
                    student_tokenizer,
                    text_teacher.renderer.tokenizer,
                    cfg.teacher.top_k,
                    cfg.data,
                    student_stop_set(cfg, student_tokenizer),
                )
            except BaseException:
                text_teacher.close()
                raise
        client = TeacherClient.from_config(cfg.teacher, address=address)
        try:
            server = client.connect()
            if not server.text_requests:
                raise TeacherMismatchError(
                    f"the teacher server at teacher.address={client.address} predates text requests, which "
                    "algorithm.cross_tokenizer sends: restart it with this version (launch/start_teacher.sh)"
                )
            teacher_tokenizer = AutoTokenizer.from_pretrained(cfg.teacher.model_path)
            if server.tokenizer_hash != tokenizer_fingerprint(teacher_tokenizer):
                raise TeacherMismatchError(
                    f"the tokenizer at teacher.model_path={cfg.teacher.model_path} is not the one the teacher server "
                    "scores with (tokenizer hashes differ): point teacher.model_path at the served model's files"
                )
            stop = student_stop_set(cfg, student_tokenizer)
            return cls(client, student_tokenizer, teacher_tokenizer, cfg.teacher.top_k, cfg.data, stop)
        except BaseException:
            client.close()
            raise

    def score_records(
        self, sequences: list[np.ndarray], score_from: list[int], records: list[dict[str, Any]]
    ) -> list[AlignedScores]:
        """Per sequence (prompt + response in student ids) the teacher's scores on its response tokens."""
        texts = [
            student_text(seq[start:], self.student_table, self.student_stop.ids)
            for seq, start in zip(sequences, score_from, strict=True)
        ]
        conversations = [conversation_of(r, self.data, t) for r, t in zip(records, texts, strict=True)]
        replies = self.teacher.score_conversations(conversations)
        out = []
        for text, reply in zip(texts, replies, strict=True):
            if reply.byte_offsets is None:
                raise ValueError("the teacher's reply to a text request carries no byte offsets (an older server?)")
            spans = align_spans(text, reply.byte_offsets)
            out.append(aligned_scores(text, spans, reply, self.mapping, self.top_k))
        return out

    def close(self) -> None:
        close = getattr(self.teacher, "close", None)
        if close is not None:
            close()


def _names(tokenizer: Any, ids: frozenset[int]) -> dict[str, int]:
    """The control tokens' names (e.g. "<|im_end|>") -> their ids (ids the tokenizer has a name for)."""
    names = {}
    for i in sorted(ids):
        name = tokenizer.convert_ids_to_tokens(i)
        if isinstance(name, str):
            names.setdefault(name, i)
    return names
