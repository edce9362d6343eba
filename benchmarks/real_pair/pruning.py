"""Depth pruning of a Llama-family HF causal LM: keep some decoder layers, renumber them, copy the rest.

Pure functions on a config dict and a state dict, so the choice of layers and the renaming are
tested on a tiny model (tests/benchmarks/real_pair/test_real_pair.py) and applied unchanged to the real teacher.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

STRATEGIES = ("every_other", "ends")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def kept_layers(num_layers: int, keep: int, strategy: str) -> list[int]:
    """Indices (ascending) of the `keep` layers a depth-pruned student keeps out of `num_layers`.

    every_other: layers 0, 2, 4, ... (evenly spread; for keep = num_layers / 2 exactly the even ones).
    ends: the first ceil(keep / 2) and the last floor(keep / 2) layers, dropping one contiguous
    block in the middle (the first and last layers matter most in Minitron's layer-importance scan).
    """
    if not 1 <= keep <= num_layers:
        raise ValueError(f"keep={keep} must be in [1, {num_layers}]")
    if strategy == "every_other":
        # Evenly spaced over [0, num_layers - 1], starting at 0: i * num_layers // keep.
        return [i * num_layers // keep for i in range(keep)]
    if strategy == "ends":
        head = (keep + 1) // 2
        return [*range(head), *range(num_layers - (keep - head), num_layers)]
    raise ValueError(f"unknown pruning strategy {strategy!r}; one of {STRATEGIES}")


def pruned_state_dict(state: Mapping[str, torch.Tensor], keep: Sequence[int]) -> dict[str, torch.Tensor]:
    """The state dict of the model with only layers `keep`, renumbered 0..len(keep)-1; other tensors copied.

    Every tensor is cloned (the student owns its memory; the teacher's is untouched).
    """
    new_index = {old: new for new, old in enumerate(keep)}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = _LAYER_KEY.match(name)
        if match is None:
            out[name] = tensor.detach().clone()
            continue
        old = int(match.group(1))
        if old in new_index:
            out[f"model.layers.{new_index[old]}.{match.group(2)}"] = tensor.detach().clone()
    return out


def pruned_config(config: dict[str, Any], keep: Sequence[int]) -> dict[str, Any]:
    """The HF config dict with `num_hidden_layers` (and per-layer lists, if any) cut to the kept layers."""
    out = dict(config)
    out["num_hidden_layers"] = len(keep)
    if isinstance(out.get("layer_types"), list):
        out["layer_types"] = [config["layer_types"][i] for i in keep]
    return out


def prune_model(model: Any, keep: Sequence[int]) -> Any:
    """A new HF model of the same class holding only layers `keep` of `model` (float32, eval mode)."""
    config_dict = pruned_config(model.config.to_dict(), keep)
    config = type(model.config).from_dict(config_dict)
    student = type(model)(config)
    missing, unexpected = student.load_state_dict(pruned_state_dict(model.state_dict(), keep), strict=False)
    # Tied embeddings: lm_head.weight is the embedding itself and may be absent from the state dict.
    if unexpected or [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]:
        raise RuntimeError(f"pruned state dict does not fit: missing {missing}, unexpected {unexpected}")
    return student.eval()
