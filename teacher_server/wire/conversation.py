"""Scoring a conversation as text (algorithm.cross_tokenizer): the teacher renders it in its own tokens.

A teacher whose tokenizer differs from the student's cannot score the student's token ids. The
rollout worker sends instead, per sequence, the prompt (the record's messages, or its plain text)
and the student's response decoded to text. The replica renders the prompt with **its own** chat
template (its special tokens, its default system prompt), tokenizes the response text with its own
tokenizer, appends its end-of-turn token when the student's response ended with the student's EOS,
and scores those response tokens. The reply carries, besides the usual top-k, the teacher's token
ids at the scored positions and their UTF-8 byte ranges within the response text, so the worker can
group student and teacher tokens into spans covering the same bytes (recipe_gkd/cross_tokenizer).

Prompt and response are tokenized apart, as the student's prompt ids and sampled ids are (TRL's
GOLD trainer does the same: trl/experimental/gold/gold_trainer.py `build_teacher_inputs_from_texts`),
so no teacher token straddles the prompt/response boundary.

Byte ranges, not character ranges: a byte-level BPE token can hold part of a UTF-8 character, which
no character offset can describe. `token_byte_table` reads each token's bytes from the tokenizer
itself: byte-level BPE (GPT-2 / Llama 3 / Qwen / DeepSeek style, the ByteLevel decoder) or a
vocabulary of plain strings (WordLevel, the demo's char tokenizer). Other tokenizers (SentencePiece
with byte fallback) are refused with a message naming teacher.model_path / model.student_path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import msgspec
import numpy as np


class Conversation(msgspec.Struct):
    """One sequence of a text score request."""

    # The prompt's chat messages ({"role", "content"}), rendered with the teacher's chat template; empty: `prompt`.
    messages: list[dict[str, str]]
    # The plain prompt text (data.apply_chat_template=false), tokenized with the teacher's special tokens.
    prompt: str
    # The student's response as text (its special tokens left out).
    response: str
    # The student's response ended with its EOS: score the teacher's end of turn after the response too.
    end_of_turn: bool

    def text_bytes(self) -> int:
        """UTF-8 bytes of its text (messages, prompt, response)."""
        contents = (m.get("content", "") for m in self.messages)
        return sum(len(t.encode()) for t in (*contents, self.prompt, self.response))


# A byte-level BPE token holds ~4 bytes of English text on average (Llama 3's, Qwen's tokenizers).
TEXT_BYTES_PER_TOKEN = 4


def estimated_tokens(conversations: list[Conversation]) -> int:
    """Tokens of text requests before the replica renders them (the frontend sends each request to the replica with the
    fewest outstanding tokens; counted as 0, every text request went to the same replica): bytes / 4, +1 each for the
    end of turn."""
    return sum(c.text_bytes() // TEXT_BYTES_PER_TOKEN + 1 for c in conversations)


class RenderError(ValueError):
    """The teacher cannot render a conversation (no chat template, a role its template refuses)."""


@dataclass(frozen=True)
class Rendered:
    """A conversation in the teacher's tokens: the whole sequence, where its response starts, and the
    byte range within the response text of every scored token ([n, 2], the end of turn zero-width at the end)."""

    ids: np.ndarray  # int32 [L]
    score_from: int
    byte_offsets: np.ndarray  # int32 [L - score_from, 2]


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode table (openai/gpt-2 encoder.py), which byte-level BPE shares."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    shift = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + shift)
            shift += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_kinds(spec: dict[str, Any]) -> set[str]:
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return {str(p.get("type")) for p in parts if p}


def token_byte_table(tokenizer: Any, key: str) -> tuple[list[bytes | None], frozenset[int]]:
    """Every id's bytes (None: no token) and the special ids (control tokens, no text of their own).

    `key` names the config key of the tokenizer's model, for the error on a tokenizer this cannot read.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{key}: algorithm.cross_tokenizer needs a fast (tokenizers) tokenizer")
    spec = json.loads(backend.to_str())
    kinds = _decoder_kinds(spec)
    model = spec.get("model", {}).get("type")
    byte_level = "ByteLevel" in kinds
    if not byte_level and not (model == "WordLevel" and kinds <= {"Fuse", "None"}):
        raise ValueError(
            f"{key}: algorithm.cross_tokenizer aligns byte-level BPE tokenizers (ByteLevel decoder) or plain "
            f"string vocabularies; this one has a {model} model with decoders {sorted(kinds)}"
        )
    to_byte = _unicode_to_byte()
    special = frozenset(int(i) for i in tokenizer.all_special_ids)
    added = {int(i): t for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    table: list[bytes | None] = [None] * len(tokenizer)
    for piece, idx in tokenizer.get_vocab().items():
        if idx >= len(table):
            table.extend([None] * (idx + 1 - len(table)))
        if idx in special or (idx in added and getattr(added[idx], "special", False)):
            continue
        if byte_level and idx not in added:
            table[idx] = bytes(to_byte[c] for c in piece)
        else:
            table[idx] = piece.encode("utf-8")
    control = frozenset(i for i, b in enumerate(table) if b is None)
    return table, control


def byte_offsets(ids: list[int] | np.ndarray, table: list[bytes | None]) -> np.ndarray:
    """[n, 2] int32 byte range of each token in the concatenation of their bytes (a control token: zero-width)."""
    out = np.zeros((len(ids), 2), dtype=np.int32)
    pos = 0
    for j, idx in enumerate(ids):
        piece = table[int(idx)] if int(idx) < len(table) else None
        out[j] = (pos, pos + (len(piece) if piece else 0))
        pos = int(out[j, 1])
    return out


class Renderer:
    """The teacher's side: conversations -> its token ids, where the response starts, byte offsets."""

    def __init__(self, tokenizer: Any, chat_template: str = "") -> None:
        self.tokenizer = tokenizer
        # teacher.chat_template: a template file the operator supplies (a tokenizer that ships none).
        self.chat_template = chat_template or None
        self.table, _ = token_byte_table(tokenizer, "teacher.model_path")
        eos = tokenizer.eos_token_id
        self.end_of_turn = None if eos is None else int(eos)

    def render(self, conversation: Conversation) -> Rendered:
        tok = self.tokenizer
        if conversation.messages:
            if self.chat_template is None and not getattr(tok, "chat_template", None):
                raise RenderError(
                    "the teacher's tokenizer has no chat template to render the conversation with: set "
                    "teacher.chat_template to a Jinja template file for it (or data.apply_chat_template=false "
                    "to send plain prompts)"
                )
            from jinja2 import TemplateError

            try:
                prompt_text = tok.apply_chat_template(
                    conversation.messages,
                    chat_template=self.chat_template,
                    add_generation_prompt=True,
                    tokenize=False,
                )
            except (TemplateError, KeyError, TypeError, ValueError) as err:  # the template refuses the input
                roles = sorted({m.get("role", "?") for m in conversation.messages})
                raise RenderError(
                    f"the teacher's chat template cannot render a conversation with roles {roles}: {err}; set "
                    "teacher.chat_template to a template that renders them (or change data.prompt_key's messages)"
                ) from None
            prompt_ids = tok(prompt_text, add_special_tokens=False)["input_ids"]
        else:
            prompt_ids = tok(conversation.prompt, add_special_tokens=True)["input_ids"]
        response_ids = list(
            tok(conversation.response, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        )
        offsets = byte_offsets(response_ids, self.table)
        text_bytes = conversation.response.encode("utf-8")
        if b"".join(self.table[i] or b"" for i in response_ids) != text_bytes:
            raise RenderError(
                "the teacher's tokenizer does not reproduce the response text byte for byte (a normalizer?): "
                "algorithm.cross_tokenizer needs a lossless teacher tokenizer (teacher.model_path)"
            )
        if conversation.end_of_turn:
            if self.end_of_turn is None:
                raise RenderError("the teacher's tokenizer has no EOS token to end the turn with (teacher.model_path)")
            response_ids.append(self.end_of_turn)
            end = len(text_bytes)
            offsets = np.concatenate([offsets, np.asarray([[end, end]], dtype=np.int32)])
        if not prompt_ids:
            raise RenderError("the teacher rendered an empty prompt: nothing predicts the first response token")
        ids = np.asarray(list(prompt_ids) + response_ids, dtype=np.int32)
        return Rendered(ids, len(prompt_ids), offsets.astype(np.int32))
