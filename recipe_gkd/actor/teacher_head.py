"""The teacher's output head on the actor (teacher.output=hidden): read once from teacher.model_path.

The actor multiplies the teacher's final hidden states (sent by the teacher server) by this head to
get the teacher's logits over the whole vocabulary (recipe_gkd/losses/hidden.py). Each tensor-parallel
rank holds the rows of its own vocabulary shard, the same ids as its shard of the student's logits.
The head is the checkpoint's `lm_head.weight`, or for a tied teacher its input embedding.

Models of one family pad their heads differently over one tokenizer (Qwen2.5: 152064 rows from 7B up,
151936 below): the loss compares the rows both heads have, which must hold every id the tokenizer can
produce (`len(tokenizer)`, its added tokens included); the rows past the shorter head are padding no text
maps to. Refused at start (ConfigError naming teacher.output, exit 2): a head shorter than the tokenizer,
and a head that is more than a bias-free matmul (logit_scale, final_logit_softcapping), whose logits the
hidden states alone would not give.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from recipe_gkd.actor.hf_arch import hf_weight_files
from recipe_gkd.config import ConfigError

HEAD_NAME = "lm_head.weight"
# Where causal LMs keep the input embedding a tied head shares (Llama, Qwen, Mistral, Gemma families).
TIED_EMBEDDING_SUFFIX = "embed_tokens.weight"


@dataclass(frozen=True)
class TeacherHeadRef:
    """Where the teacher's head lives, its shape [vocab, hidden], and the vocabulary rows the loss compares."""

    file: Path
    name: str
    vocab_size: int
    hidden_size: int
    # The first `loss_vocab_size` ids: the rows both heads have (every id the tokenizer produces among them).
    loss_vocab_size: int


def find_teacher_head(model_path: str, student_vocab_size: int, tokenizer_size: int) -> TeacherHeadRef:
    """The teacher's head tensor, checked against the student's vocabulary (`student_vocab_size` embedding rows)
    and its tokenizer (`tokenizer_size` ids). Raises ConfigError (teacher.output)."""
    model_dir = Path(model_path)
    config = json.loads((model_dir / "config.json").read_text())
    text_config = config.get("text_config", config)
    for key in ("logit_scale", "final_logit_softcapping"):
        if text_config.get(key) not in (None, 1.0):
            raise ConfigError(
                "teacher.output",
                f"=hidden rebuilds the teacher's logits as hidden @ head, but {model_path} sets {key}="
                f"{text_config[key]}: set teacher.output=topk",
            )
    tensors: dict[str, tuple[Path, list[int]]] = {}
    for file in hf_weight_files(model_dir):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if name == HEAD_NAME or name.endswith(TIED_EMBEDDING_SUFFIX):
                    tensors[name] = (file, list(handle.get_slice(name).get_shape()))
    tied = bool(text_config.get("tie_word_embeddings", config.get("tie_word_embeddings", True)))
    # An untied teacher's head is its own tensor: its input embedding is another matrix.
    embeddings = sorted(n for n in tensors if n != HEAD_NAME) if tied else []
    name = HEAD_NAME if HEAD_NAME in tensors else next(iter(embeddings), "")
    if not name:
        raise ConfigError(
            "teacher.output",
            f"=hidden needs the teacher's output head, but {model_path} holds neither {HEAD_NAME} nor (tied) an "
            f"input embedding *{TIED_EMBEDDING_SUFFIX}: set teacher.output=topk",
        )
    file, (vocab, hidden) = tensors[name]
    shared = min(vocab, student_vocab_size)
    if tokenizer_size > shared:
        raise ConfigError(
            "teacher.output",
            f"=hidden compares the two distributions id by id over one vocabulary, but the teacher's head has {vocab} "
            f"rows and the student's {student_vocab_size}, fewer than the {tokenizer_size} ids of the student's "
            "tokenizer: use a teacher with the student's tokenizer and vocabulary, or teacher.output=topk",
        )
    return TeacherHeadRef(file, name, vocab, hidden, shared)


def tokenizer_size(path: str) -> int:
    """The ids the tokenizer at `path` can produce (its vocabulary and added tokens)."""
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(path))


def load_teacher_head_shard(
    ref: TeacherHeadRef, vocab_start: int, shard_rows: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """This rank's rows [vocab_start, vocab_start + shard_rows) of the teacher's head [shard_rows, hidden]."""
    with safe_open(str(ref.file), framework="pt") as handle:
        rows_vH = handle.get_slice(ref.name)[vocab_start : vocab_start + shard_rows]
    return rows_vH.to(device=device, dtype=dtype).contiguous()


def teacher_head_bytes(hidden_size: int, shard_rows: int, dtype_bytes: int) -> int:
    """The bytes one actor rank holds for its rows of the teacher's head."""
    return hidden_size * shard_rows * dtype_bytes
