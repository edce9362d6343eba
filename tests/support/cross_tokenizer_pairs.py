"""Two byte-level BPE tokenizers trained on text with multi-byte characters, for the cross-tokenizer tests.

recipe_gkd.offline_models' BPEs learn from ASCII only; real ones (SmolLM2, Qwen, Llama 3) also hold pieces that
end inside a UTF-8 character, such as " \\xe2\\x80" (a space and the first two bytes of "—"): SmolLM2's
vocabulary has 39. These two learn from lines with dashes, curly quotes, accents, combining marks, CJK and
emoji, so their vocabularies carry such pieces, with different merges on each side:

- `student`: ChatML-shaped (SmolLM2 / Qwen): eos == pad == <|im_end|>, a template injecting a system prompt;
- `teacher`: Llama-3-shaped: <|begin_of_text|> in the template, <|eot_id|> ending the turn (its EOS).

Built offline and deterministically (a fixed corpus), in well under a second.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from recipe_gkd.offline_models import (
    CHATML_SPECIAL_TOKENS,
    CHATML_TEMPLATE,
    IM_END,
    LLAMA3_SPECIAL_TOKENS,
    LLAMA3_TEMPLATE,
    _bpe_corpus,
    _byte_level_bpe,
)
from teacher_server.wire.conversation import Conversation

CORPUS_SEED = 45
STUDENT_VOCAB = 640
TEACHER_VOCAB = 430
WORDS = (
    "the answer is — and “quoted” text ‘single’ … café naïve résumé Ünïcödé e\u0301 a\u0308 日本 日本語 中文 "
    "東京 🙂 👍🏽 🎉 reverse sum hello world — yes “ok” it’s we’re"
).split()


def corpus(lines: int = 1500) -> list[str]:
    """The tiny models' English-like lines, and as many with the multi-byte words above mixed into them."""
    rng = random.Random(CORPUS_SEED)
    english = _bpe_corpus()[:lines]
    mixed = [f"{line} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) for line in english]
    return english + mixed


def _bpe(vocab_size: int, special_tokens: tuple[str, ...]) -> Any:
    """The tiny models' byte-level BPE trainer on this module's corpus (its multi-byte words)."""
    return _byte_level_bpe(vocab_size, special_tokens, corpus())


def build_pair(root: Path) -> dict[str, Any]:
    """{"student": ChatML-shaped, "teacher": Llama-3-shaped} PreTrainedTokenizerFast, saved under `root`."""
    from transformers import PreTrainedTokenizerFast

    student = PreTrainedTokenizerFast(
        tokenizer_object=_bpe(STUDENT_VOCAB, CHATML_SPECIAL_TOKENS),
        eos_token=IM_END,
        pad_token=IM_END,
        padding_side="left",
    )
    student.chat_template = CHATML_TEMPLATE
    teacher = PreTrainedTokenizerFast(
        tokenizer_object=_bpe(TEACHER_VOCAB, LLAMA3_SPECIAL_TOKENS),
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
        padding_side="left",
    )
    teacher.chat_template = LLAMA3_TEMPLATE
    for name, tok in (("student", student), ("teacher", teacher)):
        tok.save_pretrained(str(root / name))
    return {"student": student, "teacher": teacher}


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode inverted (openai/gpt-2 src/encoder.py), written out here, not imported."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in keep]
    table = {chr(b): b for b in keep}
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


def piece_bytes(tok: Any, token_id: int) -> bytes | None:
    """A token's bytes read from its vocabulary string (None: a special token, no text)."""
    if token_id in set(tok.all_special_ids):
        return None
    decoder = gpt2_byte_decoder()
    return bytes(decoder[c] for c in tok.convert_ids_to_tokens(token_id))


CONVERSATIONS = [
    Conversation([{"role": "user", "content": "rev:hello"}], "", "olleh", True),
    Conversation(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "naïve?"}], "", "日本 🙂", False
    ),
    Conversation([], "rev:abc", "c b  a", True),
    Conversation([{"role": "user", "content": "x"}], "", "", True),
]
