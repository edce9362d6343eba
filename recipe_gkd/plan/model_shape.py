"""A model's shape as its config.json gives it (no weights read): what the memory plan sizes each role from.

The one reader of a model's config: `shape_from_config` takes the json dict or a transformers config object; the
actor's architecture (actor/hf_arch.py `read_hf_arch`) takes its dense-transformer numbers from it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from teacher_server.config.model_refs import HUB_ID


@dataclass(frozen=True)
class Shape:
    """The numbers of a dense decoder-only transformer the plan needs (from its config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_layernorm: bool = False
    max_position_embeddings: int = 0

    def layer_params(self, tp: int = 1) -> float:
        """Parameters of one decoder layer on one of `tp` tensor-parallel ranks."""
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        sharded = self.hidden_size * qkv_rows + self.num_heads * self.head_dim * self.hidden_size
        sharded += 3 * self.hidden_size * self.intermediate_size + (qkv_rows if self.qkv_bias else 0)
        replicated = 2 * self.hidden_size + (2 * self.head_dim if self.qk_layernorm else 0)
        return sharded / tp + replicated

    def num_params(self) -> float:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.layer_params() + embeddings + self.hidden_size

    def largest_module_params(self, tp: int) -> float:
        """The parameters of the largest module on one of `tp` ranks: embedding / lm_head, fused gate_up, qkv."""
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        per_rank = [self.vocab_size, 2 * self.intermediate_size, qkv_rows, self.intermediate_size]
        return max(rows * self.hidden_size for rows in per_rank) / tp

    def kv_bytes_per_token(self, tp: int, dtype_bytes: int) -> float:
        """K and V of every layer for one token on one of `tp` ranks (vLLM keeps >= 1 KV head per rank)."""
        return 2 * self.num_layers * max(1.0, self.num_kv_heads / tp) * self.head_dim * dtype_bytes


_REQUIRED = object()


def _field(config: Mapping[str, Any] | Any, key: str, default: Any = _REQUIRED) -> Any:
    """`key` of a config.json dict or of a transformers config object; KeyError naming it when required and absent."""
    value = config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)
    if value is _REQUIRED:
        raise KeyError(key)
    return value


def shape_from_config(config: Mapping[str, Any] | Any) -> Shape:
    """A Shape from a config.json dict or a transformers config (Llama / Qwen2 / Qwen3 / Mistral field names).

    The one reading of a model's dense-transformer numbers: the memory plan's and the actor's (actor/hf_arch.py
    `read_hf_arch` adds the fields only the actor needs, after its checks).
    """
    heads = int(_field(config, "num_attention_heads"))
    hidden = int(_field(config, "hidden_size"))
    model_type = _field(config, "model_type", "")
    return Shape(
        vocab_size=int(_field(config, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_field(config, "intermediate_size")),
        num_layers=int(_field(config, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(_field(config, "num_key_value_heads", None) or heads),
        head_dim=int(_field(config, "head_dim", None) or hidden // heads),
        # transformers' own default for these families is false when the key is absent.
        tie_word_embeddings=bool(_field(config, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(_field(config, "attention_bias", False)),
        qk_layernorm=model_type == "qwen3",
        max_position_embeddings=int(_field(config, "max_position_embeddings", None) or 0),
    )


def find_config_json(ref: str) -> Path | None:
    """config.json of a model reference: a local directory's, or a hub id's in the HF cache (no download)."""
    if not ref:
        return None
    local = Path(ref) / "config.json"
    if local.is_file():
        return local
    match = HUB_ID.match(ref)
    if match is None:
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(match["repo"], "config.json", revision=match["revision"])
    return Path(found) if isinstance(found, str) else None


def read_shape(ref: str, key: str, skipped: list[str]) -> Shape | None:
    """The Shape behind model reference `ref`, or None (with the reason appended to `skipped`)."""
    path = find_config_json(ref)
    if path is None:
        skipped.append(
            f"{key}={ref!r}: no config.json here or in the Hugging Face cache (hf download {ref} config.json)"
        )
        return None
    config = json.loads(path.read_text())
    if any(k in config for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        skipped.append(f"{key}={ref!r}: a mixture-of-experts model; the plan covers dense models only")
        return None
    try:
        return shape_from_config(config)
    except KeyError as err:
        skipped.append(f"{key}={ref!r}: config.json lacks {err.args[0]}")
        return None
