"""LoRA students: low-rank adapters on megatron's linears, the base frozen (actor.lora; docs/lora.md).

megatron-core 0.16.1 has no LoRA, so the adapters are the project's own: each targeted linear of a decoder layer
(`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`) gets two parameters of its own, `lora_A` [rank, in] and
`lora_B` [out, rank], and a forward hook adding (alpha / rank) x B A x to its output. The linear keeps its name, so
the base weights load, export and convert as for a full student; megatron trains only what requires a gradient
(its DDP buffers and its optimizer skip frozen parameters: distributed/distributed_data_parallel.py,
optimizer/__init__.py `_get_param_groups`), and its frozen-weight linear still all-reduces the input's gradient
(tensor_parallel/layers.py `linear_with_frozen_weight`).

Tensor parallelism, with megatron's own regions (tensor_parallel/mappings.py):
- column-parallel (qkv, fc1; output sharded): A replicated, B sharded as the weight's rows; h = A x on every rank,
  then `copy_to_tensor_model_parallel_region(h)` (identity forward, all-reduce backward), so A's gradient is the sum
  over the TP ranks' B shards, the same on every rank, like a norm's;
- row-parallel (proj, fc2; input sharded): A sharded as the weight's columns, B replicated; the rank-r partial
  products are summed by `reduce_from_tensor_model_parallel_region` (all-reduce forward, identity backward).
Initialisation is PEFT's (A: kaiming-uniform, a = sqrt(5), drawn for the whole tensor from the run's seed and the
layer, then sharded, so any TP size starts from the same adapter; B = 0: step 0 is the base model).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from recipe_gkd.actor.mcore_model import mark_tensor_parallel_params
from recipe_gkd.config import GKDConfig
from recipe_gkd.models import HFArch
from recipe_gkd.models.base import MCORE_LAYER

# actor.lora.targets -> the linear's path in a megatron decoder layer and whether it is column-parallel.
TARGET_MODULES: dict[str, tuple[str, bool]] = {
    "qkv": ("self_attention.linear_qkv", True),
    "proj": ("self_attention.linear_proj", False),
    "fc1": ("mlp.linear_fc1", True),
    "fc2": ("mlp.linear_fc2", False),
}
ADAPTER_PARAMS = ("lora_A", "lora_B")
# PEFT's initialisation of A (peft/tuners/lora/layer.py reset_lora_parameters: kaiming_uniform_ with a = sqrt(5)).
KAIMING_A = math.sqrt(5)


@dataclass(frozen=True)
class LoRASettings:
    """actor.lora as the actor uses it."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, cfg: GKDConfig) -> LoRASettings | None:
        lora = cfg.actor.lora
        if lora.rank == 0:
            return None
        return cls(lora.rank, lora.alpha, tuple(lora.targets), lora.dropout)


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is an adapter's (`....lora_A` / `....lora_B`)."""
    return name.rsplit(".", 1)[-1] in ADAPTER_PARAMS


def add_adapters(gpt: torch.nn.Module, settings: LoRASettings, first_layer: int, seed: int, tp_rank: int) -> int:
    """Freeze every parameter of `gpt` (this pipeline stage) and give each targeted linear its adapter; returns the
    number of adapter parameters added. `first_layer`: this stage's first global layer (the seed of each A)."""
    for param in gpt.parameters():
        param.requires_grad_(False)
    added = 0
    for local, layer in enumerate(gpt.decoder.layers):
        for target in settings.targets:
            linear = layer.get_submodule(TARGET_MODULES[target][0])
            _attach(linear, settings, target, seed_of(seed, first_layer + local, target), tp_rank)
            added += linear.lora_A.numel() + linear.lora_B.numel()
    # The sharded factor's TP attributes from the converter's table (hf_convert.partition_dim), as every weight's.
    mark_tensor_parallel_params(gpt)
    if getattr(gpt, "pre_process", False):
        gpt.embedding.register_forward_hook(_input_requires_grad)
    return added


def _input_requires_grad(module: torch.nn.Module, args: tuple, output: Tensor) -> Tensor:
    """The frozen embedding's output as a tensor that requires a gradient (PEFT's `enable_input_require_grads`).

    megatron's activation recompute (tensor_parallel.random.CheckpointFunction: full, every layer; selective, the
    MLP) runs the checkpointed block without autograd and gives its output a gradient only when an input requires
    one: with the whole base frozen the first layer's input does not, and the adapters behind it would get no
    gradient at all (measured: a grad norm of exactly 0 with actor.megatron.recompute=full)."""
    return output.requires_grad_(True) if not output.requires_grad else output


def seed_of(seed: int, layer: int, target: str) -> int:
    """The seed of one adapter's A: the run's seed, the global layer, the target (the same at any TP / PP)."""
    return (seed * 1_000_003 + layer * 101 + list(TARGET_MODULES).index(target)) % (2**31)


def _attach(linear: torch.nn.Module, settings: LoRASettings, target: str, seed: int, tp_rank: int) -> None:
    """Give one megatron linear its adapter parameters, its forward hook and its checkpoint sharding."""
    column = TARGET_MODULES[target][1]
    weight = linear.weight
    out_local, in_local = weight.shape
    tp = _tp_size()
    in_full = in_local if column else in_local * tp
    generator = torch.Generator().manual_seed(seed)
    a_full = torch.empty(settings.rank, in_full)
    torch.nn.init.kaiming_uniform_(a_full, a=KAIMING_A, generator=generator)
    a_local = a_full if column else a_full.chunk(tp, dim=1)[tp_rank]
    linear.lora_A = torch.nn.Parameter(a_local.to(weight.device, weight.dtype).contiguous())
    linear.lora_B = torch.nn.Parameter(torch.zeros(out_local, settings.rank, device=weight.device, dtype=weight.dtype))
    linear.register_forward_hook(_hook(settings, column), with_kwargs=True)
    linear.sharded_state_dict = _sharded_state_dict(linear, column, gated=target == "fc1")


def _tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def _hook(settings: LoRASettings, column: bool) -> Callable[..., Any]:
    """The forward hook adding the adapter's update to the linear's (output, bias)."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    scale, dropout = settings.scale, settings.dropout

    def add_update(module: torch.nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        if dropout > 0 and module.training:
            x = torch.nn.functional.dropout(x, p=dropout, training=True)
        h = torch.nn.functional.linear(x, module.lora_A)
        # Column-parallel: h is whole on every rank, its gradient summed over TP; row-parallel: partial, summed.
        h = copy_to_tensor_model_parallel_region(h) if column else reduce_from_tensor_model_parallel_region(h)
        return out + scale * torch.nn.functional.linear(h, module.lora_B), bias

    return add_update


def _sharded_state_dict(linear: torch.nn.Module, column: bool, gated: bool) -> Callable[..., dict[str, Any]]:
    """The linear's checkpoint entries with its adapter sharded as it is over TP (megatron's own lists only the
    weight and bias), fc1's B split into its gate and up halves as megatron's MLP does for the weight."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    axes = {"weight": 0, "bias": 0, "lora_B": 0} if column else {"weight": 1, "lora_A": 1}

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        state = linear.state_dict(prefix="", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(
            state,
            prefix,
            axes,
            sharded_offsets,
            tp_group=linear.tp_group,
            dp_cp_group=(metadata or {})["dp_cp_group"],
        )
        if gated:
            singleton = (metadata or {}).get("singleton_local_shards", False)
            out[f"{prefix}lora_B"] = apply_swiglu_sharded_factory(out[f"{prefix}lora_B"], sharded_offsets, singleton)
        return out

    return sharded_state_dict


def merged_weight(linear: torch.nn.Module, scale: float) -> Tensor:
    """This rank's shard of W + scale x B A in fp32 (column: B's rows x A; row: B x A's columns; both local)."""
    return linear.weight.float() + scale * (linear.lora_B.float() @ linear.lora_A.float())


def merged_views(gpt: torch.nn.Module, settings: LoRASettings) -> dict[str, Callable[[], Tensor]]:
    """Stage-local weight name -> a function giving its merged shard, for every adapted linear of this stage."""
    views: dict[str, Callable[[], Tensor]] = {}
    for local, layer in enumerate(gpt.decoder.layers):
        for target in settings.targets:
            path = TARGET_MODULES[target][0]
            linear = layer.get_submodule(path)
            views[MCORE_LAYER.format(i=local) + path + ".weight"] = _merge_fn(linear, settings.scale)
    return views


def _merge_fn(linear: torch.nn.Module, scale: float) -> Callable[[], Tensor]:
    return lambda: merged_weight(linear, scale)


def adapter_units(arch: HFArch, targets: tuple[str, ...]) -> Iterator[tuple[int, str, str, str]]:
    """(global layer, target, megatron name of A, of B) for every adapter of the model, in export order."""
    for i in range(arch.num_layers):
        for target in targets:
            base = MCORE_LAYER.format(i=i) + TARGET_MODULES[target][0]
            yield i, target, base + ".lora_A", base + ".lora_B"
