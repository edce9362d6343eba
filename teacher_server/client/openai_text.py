"""A teacher of another tokenizer on a vLLM OpenAI-compatible server (teacher.backend=openai with
algorithm.cross_tokenizer): the client renders the conversation in the teacher's tokens.

The ZeroMQ server renders text requests in its replica (teacher_server/server/replica.py `_render`); an
OpenAI-compatible server cannot: its `/completions` with a text prompt re-tokenizes the text itself and
its `/chat/completions` applies the server's template, and neither returns where each of its tokens lies
in the response text. So the client renders here, with the very same `Renderer`
(teacher_server/wire/conversation.py) the replica uses: the teacher's chat template (or teacher.chat_template),
the prompt and the response tokenized apart, the end of turn appended. It sends the teacher's token ids to
`/completions` with `prompt_logprobs` (OpenAITeacherClient.score: no re-tokenization) and attaches to each
reply the scored ids and their byte ranges, as the ZeroMQ server's reply carries them. Both routes render
alike (one renderer), so recipe_gkd/cross_tokenizer/route.py aligns either reply the same way.

teacher.model_path must be a local directory holding the teacher's tokenizer files (the renderer's
tokenizer); at connect time the served tokenizer is checked against it through the server's `/tokenize`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from teacher_server.client.openai_client import TOKENIZER_FILES, OpenAITeacherClient
from teacher_server.client.zmq_client import TeacherMismatchError
from teacher_server.config.errors import ConfigError
from teacher_server.wire import protocol as P
from teacher_server.wire.conversation import Conversation, Renderer, RenderError

if TYPE_CHECKING:
    from teacher_server.config.teacher import TeacherConfig


class OpenAITextTeacher:
    """Scores conversations (the TextTeacher protocol of recipe_gkd/cross_tokenizer/route.py) on an OpenAI-compatible
    server, rendered here with the teacher's tokenizer."""

    def __init__(self, client: OpenAITeacherClient, renderer: Renderer) -> None:
        self.client = client
        self.renderer = renderer

    @classmethod
    def connect(cls, teacher: TeacherConfig) -> OpenAITextTeacher:
        """The client for `teacher` (teacher.backend=openai), its served tokenizer checked against teacher.model_path's."""
        tokenizer = load_teacher_tokenizer(teacher.model_path)
        template = Path(teacher.chat_template).read_text() if teacher.chat_template else ""
        renderer = Renderer(tokenizer, template)
        client = OpenAITeacherClient.from_config(teacher)
        try:
            client.connect()  # the served model and teacher.top_k (no student tokenizer to compare: any is accepted)
            client.check_served_tokenizer(
                tokenizer,
                "teacher.model_path must hold the tokenizer files of the model served at teacher.address={address} "
                "(the client renders conversations with them)",
            )
        except BaseException:
            client.close()
            raise
        return cls(client, renderer)

    def score_conversations(self, conversations: Sequence[Conversation]) -> list[P.TeacherScores]:
        """Each conversation's response scored in the teacher's tokens, with its token ids and their byte ranges in the
        response text. A conversation the teacher cannot render raises TeacherMismatchError (exit 2), as the ZeroMQ
        route's `render_failed` does."""
        try:
            rendered = [self.renderer.render(c) for c in conversations]
        except RenderError as err:
            raise TeacherMismatchError(str(err)) from None
        replies = self.client.score([r.ids for r in rendered], [r.score_from for r in rendered])
        return [
            dataclasses.replace(reply, token_ids=r.ids[r.score_from :].copy(), byte_offsets=r.byte_offsets)
            for reply, r in zip(replies, rendered, strict=True)
        ]

    def close(self) -> None:
        self.client.close()


def load_teacher_tokenizer(model_path: str) -> Any:
    """teacher.model_path's tokenizer: the files the client renders with must be here (a served model name is not)."""
    local = Path(model_path) if model_path else None
    if local is None or not local.is_dir() or not any((local / f).exists() for f in TOKENIZER_FILES):
        raise ConfigError(
            "teacher.model_path",
            f"is {model_path!r}, but with teacher.backend=openai and algorithm.cross_tokenizer the client renders each "
            "conversation with the teacher's tokenizer and chat template: set it to a local directory holding the "
            f"served model's tokenizer files ({', '.join(TOKENIZER_FILES[:2])})",
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(local)
