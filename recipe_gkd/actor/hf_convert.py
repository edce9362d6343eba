"""HF <-> megatron-core GPTModel weights over a model family's tensor table: names, layout, TP and PP sharding.

Three layers, each testable on its own (the architecture they take is `recipe_gkd.models.HFArch`, whose family's
`layer` table lists each decoder layer's megatron tensors and the HF tensors they convert from):
1. `hf_to_mcore_full` / `mcore_full_to_hf`: HF names <-> megatron names over the *unsharded*
   megatron layout (fused QKV interleaved per GQA group, fused [gate; up] fc1, vocabulary
   padded to a multiple of the tensor-parallel size), one conversion per table entry. Pure torch, no megatron import.
2. `shard_for_tp` / `unshard_from_tp`: one rank's slice of an unsharded megatron tensor and
   back (column-parallel on dim 0, row-parallel on dim 1, fc1 per-rank [gate_r; up_r]).
3. `stage_param_names` / `owner_stage`: which parameters a pipeline stage holds, under which
   local names (layers numbered from 0 on each stage).

Nothing here imports megatron or tests a family: the megatron model built from an `HFArch` is
`recipe_gkd.actor.mcore_model`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from recipe_gkd.actor.hf_arch import hf_weight_files
from recipe_gkd.models import HFArch
from recipe_gkd.models.base import (
    COPY,
    EMBEDDING,
    FINAL_NORM,
    FUSED_QKV,
    GATED_FC1,
    HF_EMBEDDING,
    HF_FINAL_NORM,
    HF_LAYER,
    HF_OUTPUT_LAYER,
    MCORE_LAYER,
    OUTPUT_LAYER,
)
from recipe_gkd.models.qwen3_moe import expert_number, with_expert_number
from recipe_gkd.parallel_layout import padded_vocab_size

# ----------------------------------------------------------------------------- HF <-> megatron (unsharded)


def mcore_param_names(arch: HFArch) -> list[str]:
    """Every megatron parameter name of the model, in a fixed order."""
    names = [EMBEDDING]
    for i in range(arch.num_layers):
        names += [MCORE_LAYER.format(i=i) + tensor.mcore for tensor in arch.family.layer_tensors(arch)]
    names.append(FINAL_NORM)
    if not arch.tie_word_embeddings:
        names.append(OUTPUT_LAYER)
    return names


def hf_param_names(arch: HFArch) -> list[str]:
    """The HF parameter names (tied embeddings appear once, as `model.embed_tokens.weight`)."""
    names = [HF_EMBEDDING]
    for i in range(arch.num_layers):
        names += [HF_LAYER.format(i=i) + hf for tensor in arch.family.layer_tensors(arch) for hf in tensor.hf]
    names.append(HF_FINAL_NORM)
    if not arch.tie_word_embeddings:
        names.append(HF_OUTPUT_LAYER)
    return names


def hf_to_mcore_full(hf_state: Mapping[str, Tensor], arch: HFArch, tp_size: int) -> dict[str, Tensor]:
    """HF state dict -> unsharded megatron tensors (vocabulary padded for `tp_size`)."""
    _require_keys(hf_state, hf_param_names(arch), "HF checkpoint")
    out: dict[str, Tensor] = {}
    for unit in mcore_units(arch):
        out.update(hf_unit_to_mcore(unit, hf_state, arch, tp_size))
    return out


def hf_unit_names(unit: str, arch: HFArch) -> list[str]:
    """The HF tensors megatron unit `unit` (see `mcore_units`) is built from."""
    if unit == EMBEDDING:
        return [HF_EMBEDDING]
    if unit == FINAL_NORM:
        return [HF_FINAL_NORM]
    if unit == OUTPUT_LAYER:
        return [HF_OUTPUT_LAYER]
    prefix = HF_LAYER.format(i=layer_index(unit))
    return [prefix + hf for tensor in unit_table(unit, arch) for hf in tensor.hf]


def unit_table(unit: str, arch: HFArch) -> list[Any]:
    """The family table's entries (LayerTensor) of decoder-layer unit `unit`: its layer's tensors but the experts'
    (the attention, the norms, the router), or one expert's."""
    mc = MCORE_LAYER.format(i=layer_index(unit))
    return [t for t in arch.family.layer_tensors(arch) if mcore_unit_of(mc + t.mcore) == unit]


# Each conversion of the family tables (recipe_gkd/models/base.py), both ways: HF tensors -> the megatron tensor, and
# the megatron tensor -> its HF tensors in table order (views where no reshuffle is needed).
TO_MCORE: dict[str, Callable[[list[Tensor], HFArch], Tensor]] = {
    COPY: lambda parts, arch: parts[0],
    FUSED_QKV: lambda parts, arch: fuse_qkv(*parts, arch),
    GATED_FC1: lambda parts, arch: torch.cat(parts, dim=0),
}
TO_HF: dict[str, Callable[[Tensor, HFArch], Sequence[Tensor]]] = {
    COPY: lambda tensor, arch: (tensor,),
    FUSED_QKV: lambda tensor, arch: split_qkv(tensor, arch),
    GATED_FC1: lambda tensor, arch: tensor.chunk(2, dim=0),
}


def hf_unit_to_mcore(unit: str, hf_state: Mapping[str, Tensor], arch: HFArch, tp_size: int) -> dict[str, Tensor]:
    """One unit's HF tensors -> its unsharded megatron tensors (vocabulary padded for `tp_size`)."""
    vocab_padded = padded_vocab_size(arch.vocab_size, tp_size)
    if unit == EMBEDDING:
        return {EMBEDDING: _pad_rows(hf_state[HF_EMBEDDING], vocab_padded)}
    if unit == FINAL_NORM:
        return {FINAL_NORM: hf_state[HF_FINAL_NORM]}
    if unit == OUTPUT_LAYER:
        return {OUTPUT_LAYER: _pad_rows(hf_state[HF_OUTPUT_LAYER], vocab_padded)}
    i = layer_index(unit)
    hf, mc = HF_LAYER.format(i=i), MCORE_LAYER.format(i=i)
    return {
        mc + tensor.mcore: TO_MCORE[tensor.conversion]([hf_state[hf + name] for name in tensor.hf], arch)
        for tensor in unit_table(unit, arch)
    }


class HFCheckpointReader:
    """Reads single tensors of an HF safetensors checkpoint on demand (fp32), never the whole file.

    safetensors memory-maps each file and copies only the tensor asked for, so a rank that
    needs one pipeline stage reads that stage's bytes. `read` records every name it returned.
    """

    def __init__(self, model_dir: str | Path) -> None:
        from safetensors import safe_open

        self.model_dir = Path(model_dir)
        self._files: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        for file in hf_weight_files(self.model_dir):
            handle = safe_open(str(file), framework="pt")
            self._files[str(file)] = handle
            self._where.update({name: str(file) for name in handle.keys()})
        self.read_names: list[str] = []

    def numel(self, name: str) -> int:
        """Element count of `name`, from the file header (nothing read)."""
        return math.prod(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str) -> Tensor:
        tensor = self._handle(name).get_tensor(name).float()
        self.read_names.append(name)
        return tensor

    def _handle(self, name: str) -> Any:
        if name not in self._where:
            raise KeyError(f"HF checkpoint {self.model_dir} has no tensor {name!r} (model.student_path)")
        return self._files[self._where[name]]


def load_stage_shards(
    reader: HFCheckpointReader, arch: HFArch, global_names: Sequence[str], tp_rank: int, tp_size: int
) -> dict[str, Tensor]:
    """Global megatron name -> this TP rank's shard, for `global_names` only (one pipeline stage's, one
    expert-parallel rank's experts).

    Converts tensor by tensor, reading only the HF tensors each needs: the host holds one tensor's unsharded parts
    at a time plus the shards kept, never the whole checkpoint, and an expert-parallel rank reads its experts only.
    """
    shards: dict[str, Tensor] = {}
    for name in dict.fromkeys(global_names):  # a tied head's copy on the last stage names the embedding again
        parts = {hf: reader.read(hf) for hf in hf_tensor_names(name, arch)}
        full = hf_tensor_to_mcore(name, parts, arch, tp_size)
        # A copy: a slice would keep the whole unsharded tensor alive.
        shards[name] = shard_for_tp(name, full, tp_rank, tp_size).clone()
        del parts, full
    return shards


def layer_tensor(name: str, arch: HFArch) -> Any:
    """The family table's entry of decoder-layer tensor `name` (`decoder.layers.<i>.<tensor>`)."""
    tensor_name = name.split(".", 3)[3]
    for tensor in arch.family.layer_tensors(arch):
        if tensor.mcore == tensor_name:
            return tensor
    raise KeyError(f"{name}: no such tensor in the {arch.family} layer table")


def hf_tensor_names(name: str, arch: HFArch) -> list[str]:
    """The HF tensors megatron tensor `name` (global, unsharded) is made of."""
    if not name.startswith("decoder.layers."):
        return hf_unit_names(name, arch)
    prefix = HF_LAYER.format(i=layer_index(name))
    return [prefix + hf for hf in layer_tensor(name, arch).hf]


def hf_tensor_to_mcore(name: str, hf_state: Mapping[str, Tensor], arch: HFArch, tp_size: int) -> Tensor:
    """Megatron tensor `name` (global, unsharded; vocabulary padded for `tp_size`) from its HF tensors."""
    if not name.startswith("decoder.layers."):
        return hf_unit_to_mcore(name, hf_state, arch, tp_size)[name]
    tensor = layer_tensor(name, arch)
    prefix = HF_LAYER.format(i=layer_index(name))
    return TO_MCORE[tensor.conversion]([hf_state[prefix + hf] for hf in tensor.hf], arch)


def mcore_full_to_hf(mcore_state: Mapping[str, Tensor], arch: HFArch) -> dict[str, Tensor]:
    """Unsharded megatron tensors -> HF state dict (padding removed; tied embedding once)."""
    _require_keys(mcore_state, mcore_param_names(arch), "megatron state")
    out: dict[str, Tensor] = {}
    for unit in mcore_units(arch):
        out.update(mcore_unit_to_hf(unit, mcore_state, arch))
    return out


def mcore_units(arch: HFArch) -> dict[str, list[str]]:
    """The conversion units, in export order: each maps to the megatron names it converts together.

    A unit (the embedding, one decoder layer, the final norm, the output layer) converts to HF
    once all its tensors are present, so an export can stream unit by unit.
    """
    units: dict[str, list[str]] = {}
    for name in mcore_param_names(arch):
        units.setdefault(mcore_unit_of(name), []).append(name)
    return units


def mcore_unit_of(name: str) -> str:
    """The unit of a megatron parameter: its decoder-layer prefix (an expert's tensors: the expert's own prefix, so
    that an export holds one expert at a time, not a whole layer's), or the parameter itself."""
    if expert_number(name) is not None:  # decoder.layers.<i>.mlp.experts.local_experts.<e>
        return ".".join(name.split(".")[:7])
    if name.startswith("decoder.layers."):
        return ".".join(name.split(".")[:3])
    return name


def mcore_unit_to_hf(unit: str, mcore_state: Mapping[str, Tensor], arch: HFArch) -> dict[str, Tensor]:
    """One unit of unsharded megatron tensors -> its HF tensors (views where no reshuffle is needed)."""
    vocab = arch.vocab_size
    if unit == EMBEDDING:
        return {HF_EMBEDDING: mcore_state[EMBEDDING][:vocab]}
    if unit == FINAL_NORM:
        return {HF_FINAL_NORM: mcore_state[FINAL_NORM]}
    if unit == OUTPUT_LAYER:
        return {HF_OUTPUT_LAYER: mcore_state[OUTPUT_LAYER][:vocab]}
    i = layer_index(unit)
    hf, mc = HF_LAYER.format(i=i), MCORE_LAYER.format(i=i)
    out: dict[str, Tensor] = {}
    for tensor in unit_table(unit, arch):
        parts = TO_HF[tensor.conversion](mcore_state[mc + tensor.mcore], arch)
        out.update(zip((hf + name for name in tensor.hf), parts, strict=True))
    return out


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, arch: HFArch) -> Tensor:
    """HF q/k/v projections -> megatron's fused QKV, interleaved per GQA group.

    Row order: for each KV group g, its heads_per_group query heads, then k_g, then v_g
    (megatron splits each group's rows into q, k, v after the matmul).
    """
    groups, per_group, head_dim = arch.num_kv_heads, arch.heads_per_group, arch.head_dim
    trailing = q.shape[1:]  # (hidden,) for weights, () for biases
    q_GRD = q.reshape(groups, per_group * head_dim, *trailing)  # [nh*hd, ...] -> [ng, qpg*hd, ...]
    k_GRD = k.reshape(groups, head_dim, *trailing)  # [ng*hd, ...] -> [ng, hd, ...]
    v_GRD = v.reshape(groups, head_dim, *trailing)
    fused = torch.cat([q_GRD, k_GRD, v_GRD], dim=1)  # [ng, (qpg + 2) * hd, ...]
    return fused.reshape(groups * (per_group + 2) * head_dim, *trailing)


def split_qkv(fused: Tensor, arch: HFArch) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `fuse_qkv`: megatron's fused QKV -> HF (q, k, v)."""
    groups, per_group, head_dim = arch.num_kv_heads, arch.heads_per_group, arch.head_dim
    trailing = fused.shape[1:]
    grouped = fused.reshape(groups, (per_group + 2) * head_dim, *trailing)  # [ng, (qpg+2)*hd, ...]
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(groups * per_group * head_dim, *trailing),
        k.reshape(groups * head_dim, *trailing),
        v.reshape(groups * head_dim, *trailing),
    )


def _pad_rows(weight: Tensor, rows: int) -> Tensor:
    if weight.shape[0] == rows:
        return weight
    padding = weight.new_zeros((rows - weight.shape[0], *weight.shape[1:]))
    return torch.cat([weight, padding], dim=0)


def _require_keys(state: Mapping[str, Tensor], names: Sequence[str], what: str) -> None:
    missing = [n for n in names if n not in state]
    if missing:
        raise KeyError(f"{what} lacks {len(missing)} tensors, e.g. {missing[:3]}")


# ----------------------------------------------------------------------------- pipeline stages


def stage_layers(arch: HFArch, pp_rank: int, pp_size: int) -> range:
    """The global decoder-layer indices pipeline stage `pp_rank` holds (equal contiguous blocks, as megatron)."""
    per_stage = arch.num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def stage_param_names(arch: HFArch, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1) -> dict[str, str]:
    """Megatron's parameter names on stage `pp_rank` (expert-parallel rank `ep_rank`) -> their names in the whole
    (unsharded) model.

    Decoder layers are numbered from 0 on every stage, and a mixture of experts' local experts from 0 on every
    expert-parallel rank (rank r holds global experts r x E/EP ... (r + 1) x E/EP - 1, megatron's numbering); a rank
    lists only the experts it holds. With tied embeddings and several stages the last stage holds a copy of the
    embedding as `output_layer.weight` (megatron all-reduces its gradient with the first stage's), so it maps to
    the embedding.
    """
    layers = stage_layers(arch, pp_rank, pp_size)
    per_rank = arch.num_experts // ep_size if arch.is_moe else 0
    mine = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: dict[str, str] = {}
    for name in mcore_param_names(arch):
        if name.startswith("decoder.layers."):
            index = layer_index(name)
            if index not in layers:
                continue
            local = stage_local_name(name, layers.start)
            expert = expert_number(name)
            if expert is not None:
                if expert not in mine:
                    continue
                local = with_expert_number(local, expert - mine.start)
            out[local] = name
        elif (name == EMBEDDING and first) or (name in (FINAL_NORM, OUTPUT_LAYER) and last):
            out[name] = name
    if arch.tie_word_embeddings and pp_size > 1 and last:
        out[OUTPUT_LAYER] = EMBEDDING
    return out


def stage_local_name(name: str, first_layer: int) -> str:
    """Global decoder-layer tensor `name` under its stage's numbering (the stage's layers from 0, its first global
    layer `first_layer`)."""
    return MCORE_LAYER.format(i=layer_index(name) - first_layer) + name.split(".", 3)[3]


def owner_stage(name: str, arch: HFArch, pp_size: int) -> int:
    """The pipeline stage that exports global parameter `name` (the tied embedding: the first)."""
    if name.startswith("decoder.layers."):
        return layer_index(name) // (arch.num_layers // pp_size)
    return 0 if name == EMBEDDING else pp_size - 1


def layer_index(name: str) -> int:
    """The decoder-layer number in `decoder.layers.<i>....`."""
    return int(name.split(".")[2])


# ----------------------------------------------------------------------------- tensor-parallel sharding

# A LoRA adapter (recipe_gkd/actor/lora.py) is sharded as its linear: a column-parallel linear's B by rows (fc1's
# per rank [gate_r; up_r] as its weight), a row-parallel linear's A by columns; the other factor is replicated.
_COLUMN_PARALLEL = re.compile(r"(word_embeddings|output_layer|linear_qkv)\.(weight|bias)$|linear_qkv\.lora_B$")
_ROW_PARALLEL = re.compile(r"(linear_proj|linear_fc2)\.(weight|lora_A)$")
_GATED_FC1 = re.compile(r"linear_fc1\.(weight|lora_B)$")


def partition_dim(name: str) -> int | None:
    """The dimension megatron shards `name` along over TP ranks (None: replicated)."""
    if _COLUMN_PARALLEL.search(name) or _GATED_FC1.search(name):
        return 0
    if _ROW_PARALLEL.search(name):
        return 1
    return None


def shard_for_tp(name: str, full: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    """This rank's slice of the unsharded megatron tensor `name`."""
    dim = partition_dim(name)
    if dim is None or tp_size == 1:
        return full
    if _GATED_FC1.search(name):
        # Each rank holds [gate_r; up_r], so SwiGLU's chunk(2) works locally.
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    if full.shape[dim] % tp_size:
        raise ValueError(f"{name}: dim {dim} of size {full.shape[dim]} does not split over tp={tp_size}")
    return full.chunk(tp_size, dim=dim)[tp_rank]


def unshard_from_tp(name: str, shards: Sequence[Tensor]) -> Tensor:
    """Inverse of `shard_for_tp`: the shards of all TP ranks, in rank order -> unsharded tensor."""
    dim = partition_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if _GATED_FC1.search(name):
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards), strict=True)
        return torch.cat([*gates, *ups], dim=0)
    return torch.cat(list(shards), dim=dim)
