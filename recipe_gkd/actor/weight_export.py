"""The actor's weights in HF form: gathered over TP, sent between pipeline stages, and written as an HF directory.

`WeightExporter.iter_hf_tensors` yields (HF name, tensor) one conversion unit (a decoder layer) at
a time on global rank 0 (every rank takes part): replica 0's TP ranks gather each parameter of
their stage, a later stage's TP rank 0 sends it to rank 0 point to point. A mixture of experts'
expert is gathered by the TP ranks of the expert-parallel rank holding it (data-parallel replica
`ep_rank`, expert-data-parallel rank 0) and sent to rank 0 the same way, one expert at a time (an
expert is a conversion unit of its own). `write_hf_dir` writes what it yields as config, model.safetensors and tokenizer files.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from recipe_gkd.actor import hf_convert
from recipe_gkd.actor.lora import TARGET_MODULES, LoRASettings, adapter_units, merged_views
from recipe_gkd.models import HFArch
from recipe_gkd.models.qwen3_moe import expert_number
from recipe_gkd.parallel_layout import ParallelLayout
from recipe_gkd.weight_sync.adapter import lora_names

WEIGHTS_FILE = "model.safetensors"
# Largest rank of a weight sent between pipeline stages during export (matrices and vectors).
MAX_EXPORT_NDIM = 4
# Parameter dtypes a pipeline stage may send to rank 0 in an export (their index travels in the header).
EXPORT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Files of an HF directory that hold weights or the model config (everything else is copied).
HF_NON_TOKENIZER_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".pt", ".pth")


class WeightExporter:
    """This rank's part of exporting the whole model's weights to global rank 0."""

    def __init__(
        self,
        gpt: torch.nn.Module,
        arch: HFArch,
        global_names: dict[str, str],
        layout: ParallelLayout,
        rank: int,
        device: torch.device,
        tp_group: dist.ProcessGroup,
        lora: LoRASettings | None = None,
    ) -> None:
        """`lora`: a LoRA student's adapters (recipe_gkd/actor/lora.py): the whole-model export gives each adapted
        weight merged (W + scale x B A, per shard), `iter_adapter_tensors` the adapter alone."""
        self.gpt = gpt
        self.lora = lora
        # This stage's adapted weight names -> their merged shard (computed when exported).
        self.merged = merged_views(gpt, lora) if lora is not None else {}
        self.arch = arch
        # This stage's parameter names -> names in the whole model (layers renumbered per stage).
        self.global_names = global_names
        self.layout = layout
        self.rank = rank
        self.device = device
        self.tp_group = tp_group

    def iter_hf_tensors(self, on_device: bool, fp32: bool = False) -> Iterator[tuple[str, Tensor]]:
        """The current weights as (HF name, torch tensor), unit by unit, on global rank 0 only (every rank calls).

        on_device: each tensor stays on this rank's device in the training dtype (bf16 params: bf16), as
        gathered: a GPU export for an NCCL broadcast never visits host memory. Such tensors may be the live
        parameters (TP=1): consume them before the next optimizer step. Otherwise a copy on the host, in the
        training dtype (the object store) or, with `fp32`, in fp32 (HF checkpoints).
        """
        if self.layout.expert_dp_rank != 0:  # dense models: every replica but the first
            return
        params = dict(self.gpt.named_parameters())
        # The tied embedding's copy on the last stage is the first stage's embedding: exported once.
        owned = {g: local for local, g in self.global_names.items() if local == g or g != hf_convert.EMBEDDING}
        for unit, names in hf_convert.mcore_units(self.arch).items():
            full = {
                name: self._whole_on_rank0(name, self._local(owned.get(name), params), on_device, fp32)
                for name in names
            }
            if self.rank == 0:
                whole = {name: tensor for name, tensor in full.items() if tensor is not None}
                yield from hf_convert.mcore_unit_to_hf(unit, whole, self.arch).items()

    def _local(self, local: str | None, params: dict[str, Tensor]) -> Tensor | None:
        """This stage's tensor of local name `local`: the parameter, or an adapted weight merged with its adapter."""
        if local is None:
            return None
        merged = self.merged.get(local)
        return merged() if merged is not None else params[local]

    def iter_adapter_tensors(
        self, sync_form: bool, on_device: bool, fp32: bool = False
    ) -> Iterator[tuple[str, Tensor]]:
        """The LoRA adapter under its PEFT names (recipe_gkd/weight_sync/adapter.py), layer by layer, on global rank
        0 only (every rank calls): each factor gathered over TP and sent from its pipeline stage as a weight is, a
        fused linear's pair split into its HF projections' (B's rows split as the weight's, A repeated).

        `sync_form`: B multiplied by the scale (what the engines load, scale 1); else B as trained (final_adapter/).
        """
        assert self.lora is not None, "iter_adapter_tensors needs a LoRA student (actor.lora.rank > 0)"
        if self.layout.expert_dp_rank != 0:  # every data-parallel replica but the first
            return
        params = dict(self.gpt.named_parameters())
        first = hf_convert.stage_layers(self.arch, self.layout.pp_rank, self.layout.pp_size).start
        for layer, target, a_name, b_name in adapter_units(self.arch, self.lora.targets):
            a, b = (
                self._whole_on_rank0(n, self._stage_param(n, first, params), on_device, fp32) for n in (a_name, b_name)
            )
            if self.rank != 0:
                continue
            assert a is not None and b is not None
            if sync_form:
                b = (b.float() * self.lora.scale).to(b.dtype)
            yield from hf_adapter_pairs(layer, target, a, b, self.arch)

    def _stage_param(self, name: str, first_layer: int, params: dict[str, Tensor]) -> Tensor | None:
        """Global decoder-layer parameter `name` on this stage (None on the other stages)."""
        if hf_convert.owner_stage(name, self.arch, self.layout.pp_size) != self.layout.pp_rank:
            return None
        return params[hf_convert.stage_local_name(name, first_layer)]

    def _whole_on_rank0(self, name: str, param: Tensor | None, on_device: bool, fp32: bool) -> Tensor | None:
        """Global parameter `name` unsharded on global rank 0 (None on every other rank): on this rank's
        device in the parameter's dtype (`on_device`), else a host copy in that dtype or (`fp32`) in fp32."""
        owner = hf_convert.owner_stage(name, self.arch, self.layout.pp_size)
        expert = expert_number(name)
        # The data-parallel replica holding it: an expert's expert-parallel rank, else the first.
        replica = 0 if expert is None else self.layout.expert_owner(expert, self.arch.num_experts)
        if (self.layout.pp_rank, self.layout.dp_rank) != (owner, replica):
            if self.rank != 0:
                return None
            received = self._recv_tensor(src=self.layout.global_rank(pp=owner, dp=replica))
            return received if on_device else received.to("cpu", torch.float32 if fp32 else received.dtype)
        if param is None:
            raise RuntimeError(f"weight export: {name} is missing from pipeline stage {owner}, replica {replica}")
        shards = self._gather_to_tp_rank0(param.detach())
        if shards is None:
            return None
        whole = hf_convert.unshard_from_tp(name, shards)
        if self.rank != 0:
            self._send_tensor(whole, dst=0)
            return None
        if on_device:
            # At TP=1 this is the live parameter itself: no copy, the broadcast packs it into its bucket
            # before the next optimizer step can change it.
            return whole
        # A copy: at TP=1 the shard is the live parameter, which the next step updates in place.
        return whole.to("cpu", torch.float32 if fp32 else whole.dtype, copy=True)

    def _send_tensor(self, tensor: Tensor, dst: int) -> None:
        """Point to point (default group): a fixed-size header (dtype code, rank, shape), then the tensor as is."""
        header = torch.zeros(2 + MAX_EXPORT_NDIM, dtype=torch.int64, device=self.device)
        header[0] = EXPORT_DTYPES.index(tensor.dtype)
        header[1] = tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        dist.send(header, dst)
        dist.send(tensor.to(self.device).contiguous(), dst)

    def _recv_tensor(self, src: int) -> Tensor:
        """The tensor `_send_tensor` sent, on this rank's device, in the sender's dtype."""
        header = torch.zeros(2 + MAX_EXPORT_NDIM, dtype=torch.int64, device=self.device)
        dist.recv(header, src)
        shape = header[2 : 2 + int(header[1])].tolist()
        tensor = torch.empty(shape, dtype=EXPORT_DTYPES[int(header[0])], device=self.device)
        dist.recv(tensor, src)
        return tensor

    def _gather_to_tp_rank0(self, local: Tensor) -> list[Tensor] | None:
        if self.layout.tp_size == 1:
            return [local]
        shards = [torch.empty_like(local) for _ in range(self.layout.tp_size)] if self.layout.tp_rank == 0 else None
        dst = dist.get_global_rank(self.tp_group, 0)
        dist.gather(local.contiguous(), gather_list=shards, dst=dst, group=self.tp_group)
        return shards


def hf_adapter_pairs(layer: int, target: str, a: Tensor, b: Tensor, arch: HFArch) -> Iterator[tuple[str, Tensor]]:
    """One fused linear's unsharded adapter (A [r, in], B [out, r]) as its HF projections' PEFT (lora_A, lora_B):
    B's rows split by the family table's own conversion of the linear's weight (megatron's qkv interleaved per GQA
    group, fc1's [gate; up]), A repeated."""
    weight = hf_convert.MCORE_LAYER.format(i=layer) + TARGET_MODULES[target][0] + ".weight"
    tensor = hf_convert.layer_tensor(weight, arch)
    parts = hf_convert.TO_HF[tensor.conversion](b, arch)
    for hf_weight, b_part in zip(tensor.hf, parts, strict=True):
        a_key, b_key = lora_names(hf_convert.HF_LAYER.format(i=layer) + hf_weight.removesuffix(".weight"))
        yield a_key, a
        yield b_key, b_part.contiguous()


def write_hf_dir(state: dict[str, np.ndarray], out: Path, student_path: Path, tokenizer_path: Path) -> None:
    """An HF directory in `out`: the student's config (dtype float32), `state` as model.safetensors, its tokenizer."""
    from safetensors.numpy import save_file
    from transformers import AutoConfig

    out.mkdir(parents=True, exist_ok=True)
    hf_config = AutoConfig.from_pretrained(student_path)
    hf_config.dtype = "float32"  # the exported weights are fp32 whatever the training precision
    hf_config.save_pretrained(out)
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    _copy_tokenizer_files(tokenizer_path, out)


def _copy_tokenizer_files(source: Path, out: Path) -> None:
    for path in source.iterdir():
        if path.is_file() and path.name != "config.json" and not path.name.endswith(HF_NON_TOKENIZER_SUFFIXES):
            shutil.copy2(path, out / path.name)
