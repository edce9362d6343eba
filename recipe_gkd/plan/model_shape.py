"""Where the plan finds a model's config.json (a local directory, or a hub id in the HF cache) and its Shape from it.

The Shape itself is read by the model's family (recipe_gkd/models `shape_from_config`: the one reader of a config,
the actor's architecture included; a mixture of experts' experts by its family, Qwen3-MoE); `read_shape` turns what
the plan cannot size (no config.json, a mixture of experts no family reads, a missing field) into a reason it skips,
instead of an error.
"""

from __future__ import annotations

import json
from pathlib import Path

from recipe_gkd.models import Shape, shape_from_config
from teacher_server.config.model_refs import HUB_ID

# The config.json keys of a mixture of experts' expert count (Qwen, Mixtral and transformers 5, DeepSeek).
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


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
    try:
        shape = shape_from_config(config)
    except KeyError as err:
        skipped.append(f"{key}={ref!r}: config.json lacks {err.args[0]}")
        return None
    if not shape.is_moe and any(k in config for k in EXPERT_KEYS):
        skipped.append(
            f"{key}={ref!r}: a mixture-of-experts model whose experts no family of recipe_gkd/models reads "
            f"(model_type {config.get('model_type')!r})"
        )
        return None
    if shape.is_moe and (config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1):
        skipped.append(f"{key}={ref!r}: a mixture of experts with dense layers; the plan counts experts in every layer")
        return None
    return shape
