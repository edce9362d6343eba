"""The student trainer: one megatron-core GPTModel rank (TP x CP x PP x DP, EP inside DP for experts), a plain class.

The driver applies `ray.remote` and calls every method on every actor rank (they all take part
in collectives); tests construct it directly, one process per rank. One step:

1. split this rank's sequences into micro-batches (`actor.micro_batch_size` sequences, or by
   tokens: `actor.max_tokens_per_micro_batch`), each collated (right-padded) and moved to the
   device only when the schedule takes it; every TP and PP rank of a data-parallel replica holds
   the same sequences,
2. megatron's schedule runs the micro-batches through the pipeline stages (1F1B when PP > 1,
   activation shapes exchanged per micro-batch); the last stage sums the GKD divergence over
   each micro-batch's loss tokens (vocab-parallel over TP) and backpropagates that sum,
3. megatron's `finalize_model_grads` all-reduces the gradients over DP and the tied embedding's
   over the first and last stage, then divides them by the global count of loss tokens
   (`calculate_per_token_loss`): d(global token-mean loss), whatever the micro-batch split,
4. clip by the global grad norm (torch ops: runs on CPU and GPU), warmup lr, Adam(W) step
   (bf16: megatron keeps fp32 master weights; `actor.megatron.distributed_optimizer` shards them
   and the Adam moments over data parallel).

Weights load stage by stage: a rank reads only its pipeline stage's tensors from the HF
safetensors files, converting one layer at a time (`hf_convert.load_stage_shards`).

This module drives set-up and the step; each other concern has its own module in `actor/`:
`mcore_model` (the megatron model of the HF config), `optimizer` (DDP, Adam, schedule, clipping),
`objective` (the loss of each micro-batch and its statistics), `checkpointing` (save / load),
`weight_export` (the weights in HF form for weight sync and HF directories).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from recipe_gkd.actor import checkpointing, hf_arch, hf_convert, mcore_model
from recipe_gkd.actor.collate import LazyMicroBatches, MicroBatch, split_by_token_budget, split_micro_batches
from recipe_gkd.actor.context_parallel import ContextSplit
from recipe_gkd.actor.lora import LoRASettings, add_adapters, is_adapter
from recipe_gkd.actor.moe_stats import RouterWatch, scaled_aux_loss_coeff
from recipe_gkd.actor.objective import ActorKinds, ActorObjective, sum_from_last_stage
from recipe_gkd.actor.optimizer import build_optimizer, clip_grads, wrap_ddp
from recipe_gkd.actor.probe_rows import forward_only_micro_batch, pack_rows, unpack_token_logprobs
from recipe_gkd.actor.weight_export import WeightExporter, write_hf_dir
from recipe_gkd.batch import ScoredSequence, TrainShard, trained_rows, trained_tokens
from recipe_gkd.config import Device, GKDConfig, Precision, actor_world_size, cpu_threads
from recipe_gkd.models import read_hf_arch
from recipe_gkd.parallel_layout import ParallelLayout
from recipe_gkd.weight_sync.adapter import adapter_config, write_peft_dir

# megatron's RNG tracker needs a seed; nothing random runs (no dropout, weights from HF).
MEGATRON_SEED = 1234


def group_timeout_minutes(bound_s: float) -> int:
    """megatron's group timeout (whole minutes) that is at least the world group's `bound_s` seconds."""
    return max(1, math.ceil(bound_s / 60.0))


class MegatronActor:
    """One rank of the megatron student trainer (see module docstring)."""

    def __init__(
        self, cfg: GKDConfig, rank: int, world_size: int, master_addr: str, master_port: int, kinds: ActorKinds
    ) -> None:
        """`kinds`: the run's target kind and objective (recipe_gkd/targets actor_kinds), built once and handed down."""
        self.cfg = cfg
        self.kinds = kinds
        self.rank = rank
        self.world_size = world_size
        self.master_addr = master_addr
        self.master_port = master_port
        self.on_cpu = cfg.cluster.device == Device.cpu
        self.layout = ParallelLayout.from_config(cfg, rank)
        self._steps = 0
        self._model: Any = None
        self.router_watch: RouterWatch | None = None
        self.lora: LoRASettings | None = None

    # ------------------------------------------------------------------------- setup / teardown

    def setup(self) -> dict[str, Any]:
        """Process group + megatron parallel state, model with the student's HF weights, optimizer."""
        start = time.perf_counter()
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(self.cfg.model.student_path)
        self.arch = read_hf_arch(hf_config)
        self.pad_id = int(getattr(hf_config, "pad_token_id", None) or 0)
        # Multi-turn rollouts: the loss trains on the tokens the student sampled (false: the ablation, every one).
        self.mask_tool_tokens = self.cfg.algorithm.mask_tool_tokens
        self._check_world()  # before anything global changes: a bad layout fails cleanly
        if threads := cpu_threads(self.cfg)["actor"]:
            torch.set_num_threads(threads)
        self._enter_device()
        self._init_distributed()
        m = self.cfg.actor.megatron
        bf16 = self.cfg.actor.precision == Precision.bf16
        self.tconfig = mcore_model.build_transformer_config(
            self.arch,
            self.layout,
            bf16=bf16,
            on_cpu=self.on_cpu,
            recompute=m.recompute.value,
            attention=m.attention.value,
            aux_loss_coeff=self.cfg.actor.moe.aux_loss_coeff,
        )
        self.gpt = mcore_model.build_gpt_model(
            self.arch,
            self.tconfig,
            pre_process=self.layout.is_first_stage,
            post_process=self.layout.is_last_stage,
            attention=m.attention.value,
        )
        self._check_stage_layers()
        # A LoRA student (actor.lora.rank > 0): the base frozen, adapters on its linears (recipe_gkd/actor/lora.py).
        self.lora = LoRASettings.from_config(self.cfg)
        hf_arch.check_lora_student(self.arch, self.cfg.actor.lora.rank)
        if not self.on_cpu:
            self.gpt.cuda(torch.cuda.current_device())
        # This stage's parameter names -> names in the whole model (layers renumbered per stage, experts per
        # expert-parallel rank).
        self._global_names = hf_convert.stage_param_names(
            self.arch, self.layout.pp_rank, self.layout.pp_size, self.layout.ep_rank, self.layout.ep_size
        )
        reader = hf_convert.HFCheckpointReader(self.cfg.model.student_path)
        self._load_stage(reader)
        first_layer = hf_convert.stage_layers(self.arch, self.layout.pp_rank, self.layout.pp_size).start
        if self.lora is not None:
            add_adapters(self.gpt, self.lora, first_layer, self.cfg.data.seed, self.layout.tp_rank)
        num_params = sum(reader.numel(n) for n in hf_convert.hf_param_names(self.arch))
        self._model = wrap_ddp(self.cfg, self.tconfig, self.gpt, bf16)
        self.optimizer, self.scheduler = build_optimizer(self.cfg, self._model, bf16)
        self.objective = ActorObjective(
            self.cfg,
            self.arch.vocab_size,
            self.layout,
            self.device,
            tp_group=self.tp_group,
            pp_group=self.pp_group,
            dp_group=self.dp_cp_group,
            target=self.kinds.target,
            objective=self.kinds.objective,
        )
        self._exporter = WeightExporter(
            self.gpt, self.arch, self._global_names, self.layout, self.rank, self.device, self.tp_group, self.lora
        )
        self.router_watch = RouterWatch(self.gpt, self.arch, first_layer, self.device) if self.arch.is_moe else None
        return {
            "rank": self.rank,
            "tp_rank": self.layout.tp_rank,
            "dp_rank": self.layout.dp_rank,
            "pp_rank": self.layout.pp_rank,
            "tp_size": self.layout.tp_size,
            "dp_size": self.layout.dp_size,
            "pp_size": self.layout.pp_size,
            "ep_rank": self.layout.ep_rank,
            "ep_size": self.layout.ep_size,
            "device": str(self.device),
            "num_params": num_params,
            "num_local_params": sum(p.numel() for p in self.gpt.parameters()),
            "num_trained_local_params": sum(p.numel() for p in self.gpt.parameters() if p.requires_grad),
            "setup_s": time.perf_counter() - start,
            "summary": self._summary(),
        }

    def _summary(self) -> str:
        """One line: how this actor computes (attention kernel, recompute, optimizer sharding, micro-batches)."""
        m, a = self.cfg.actor.megatron, self.cfg.actor
        attention = {
            "sdpa": "torch scaled_dot_product_attention",
            "unfused": "megatron's unfused DotProductAttention",
        }[m.attention.value]
        optimizer = (
            f"distributed optimizer over data parallel {self.layout.dp_size}"
            if m.distributed_optimizer
            else "optimizer state replicated per rank"
        )
        batches = (
            f"micro-batches of <= {a.max_tokens_per_micro_batch} tokens"
            if a.max_tokens_per_micro_batch
            else f"micro-batches of {a.micro_batch_size} sequences"
        )
        trained = (
            f"LoRA adapters rank {self.lora.rank} (alpha {self.lora.alpha:g}) on {', '.join(self.lora.targets)}, the "
            "base frozen"
            if self.lora is not None
            else "every weight trained"
        )
        return (
            f"{a.precision.value} params ({'fp32 master weights, ' if a.precision == Precision.bf16 else ''}"
            f"Adam), {trained}, attention: {attention}, local layer spec (no Transformer Engine), recompute: "
            f"{m.recompute.value}, {optimizer}, {batches}"
        )

    def shutdown(self) -> None:
        """Destroy megatron's parallel state and the process group (idempotent)."""
        from megatron.core import parallel_state

        if dist.is_available() and dist.is_initialized():
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()

    def _enter_device(self) -> None:
        # Torch function modes are per thread: re-enter in whichever thread runs this call.
        if self.on_cpu:
            from recipe_gkd.actor.cpu_compat import enable_cpu_compat

            enable_cpu_compat()

    def _check_world(self) -> None:
        expected = actor_world_size(self.cfg)
        if self.world_size != expected:
            raise ValueError(
                f"MegatronActor got world_size={self.world_size} but actor.nnodes x actor.gpus_per_node = {expected}; "
                "set actor.gpus_per_node to the number of actor ranks"
            )
        layout = self.layout
        hf_arch.check_split(self.arch, layout.tp_size, layout.pp_size, layout.cp_size, ep_size=layout.ep_size)

    def _check_stage_layers(self) -> None:
        """megatron's layer numbers on this stage must be the ones `hf_convert.stage_layers` loads into it."""
        got = [layer.layer_number - 1 for layer in self.gpt.decoder.layers]  # megatron numbers from 1
        expected = list(hf_convert.stage_layers(self.arch, self.layout.pp_rank, self.layout.pp_size))
        if got != expected:
            raise RuntimeError(
                f"pipeline stage {self.layout.pp_rank}: megatron holds layers {got}, expected {expected}"
            )

    def _init_distributed(self) -> None:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        if self.on_cpu:
            backend, self.device = "gloo", torch.device("cpu")
        else:
            # Under Ray each rank sees only its own GPU; without Ray, rank i takes GPU i.
            torch.cuda.set_device(self.rank % torch.cuda.device_count())
            backend, self.device = "nccl", torch.device("cuda", torch.cuda.current_device())
            if share := self.cfg.actor.gpu_memory_utilization:
                # GPU-only, reasoned (torch/cuda/memory.py set_per_process_memory_fraction): the caching
                # allocator refuses to grow this process past its share; colocated vLLM engines keep theirs.
                torch.cuda.set_per_process_memory_fraction(share, self.device)
        # The rendezvous waits for every rank's set-up and the collectives run in steps: neither times out before the
        # driver's bound on that phase does (the driver then dumps every stack and names the key).
        bound_s = max(self.cfg.debug.hang_timeout_s, self.cfg.debug.setup_timeout_s)
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{self.master_addr}:{self.master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=bound_s),
        )
        layout = self.layout
        # megatron-core 0.16.1 parallel_state.initialize_model_parallel gives every group it creates (TP, DP, PP,
        # MP, embedding, ...) `timedelta(minutes=distributed_timeout_minutes)`, 30 by default, not the world's bound.
        # Expert parallelism inside data parallelism, expert tensor parallel = tp (megatron's default).
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp_size,
            pipeline_model_parallel_size=layout.pp_size,
            context_parallel_size=layout.cp_size,
            expert_model_parallel_size=layout.ep_size,
            distributed_timeout_minutes=group_timeout_minutes(bound_s),
        )
        model_parallel_cuda_manual_seed(MEGATRON_SEED)
        megatron_coords = (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_context_parallel_rank(),
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_expert_model_parallel_rank(),
            parallel_state.get_expert_data_parallel_rank(),
        )
        ours = (layout.tp_rank, layout.cp_rank, layout.dp_rank, layout.pp_rank, layout.ep_rank, layout.expert_dp_rank)
        if megatron_coords != ours:
            raise RuntimeError(
                f"rank {self.rank}: megatron places it at (tp, cp, dp, pp, ep, expert dp) = {megatron_coords}, "
                f"recipe_gkd.parallel_layout at {ours}"
            )
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        # Token sums of the split sequences (losses, their statistics) run over data x context parallel: every CP
        # rank holds a share of its replica's tokens (megatron's finalize_model_grads counts them over this group).
        self.dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.cp_group = parallel_state.get_context_parallel_group()
        self.context_split = ContextSplit(layout.cp_size, layout.cp_rank, self.cp_group, self.pad_id)
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        # TP x PP: the ranks that compute one model replica together (and hold the same data).
        self.mp_group = parallel_state.get_model_parallel_group()

    def _load_stage(self, reader: hf_convert.HFCheckpointReader) -> None:
        """This rank's shards of this stage's parameters, read from the HF checkpoint unit by unit."""
        params = {n: p for n, p in self.gpt.named_parameters() if not is_adapter(n)}
        expected = set(self._global_names)
        if set(params) != expected:
            raise RuntimeError(
                f"megatron stage {self.layout.pp_rank} parameters differ from the converter's: "
                f"extra {sorted(set(params) - expected)[:3]}, missing {sorted(expected - set(params))[:3]}"
            )
        shards = hf_convert.load_stage_shards(
            reader, self.arch, list(self._global_names.values()), self.layout.tp_rank, self.layout.tp_size
        )
        with torch.no_grad():
            for name, param in params.items():
                local = shards[self._global_names[name]]
                if tuple(local.shape) != tuple(param.shape):
                    raise RuntimeError(f"{name}: converted shard {tuple(local.shape)} != megatron {tuple(param.shape)}")
                param.copy_(local)

    # ------------------------------------------------------------------------- training

    def train_step(self, shards: Sequence[TrainShard]) -> dict[str, float]:
        """One optimizer step on this rank's shards (the TrainShards themselves, not refs).

        Every TP rank of a data-parallel replica must get the same shards. Returns the global
        token-mean loss (same on every rank) and step statistics.
        """
        self._enter_device()
        start = time.perf_counter()
        sequences = _flatten(shards)
        local_tokens = sum(trained_tokens(s, self.mask_tool_tokens) for s in sequences)
        self._check_same_data_over_model_parallel(len(sequences), local_tokens)
        global_tokens = self._sum_over_dp(local_tokens)
        if global_tokens == 0:
            raise ValueError(f"step {self._steps + 1}: no response tokens on any data-parallel rank")
        self._model.train()
        self._model.zero_grad_buffer()
        self.optimizer.zero_grad()
        # Backward of each micro-batch's loss sum; finalize_model_grads divides by the global count.
        outputs = self._run_schedule(
            self._micro_batches(sequences), self.objective.train_loss, forward_only=False, training=True
        )
        loss_sum = self._sum_from_last_stage([out["loss_sum"] for out in outputs], 1)[0]
        forward_backward_s = time.perf_counter() - start
        grad_norm, stepped = self._optimizer_step()
        dist.all_reduce(loss_sum, group=self.dp_cp_group)
        policy_stats = self.objective.policy_stats(outputs, global_tokens)
        return {
            **policy_stats,
            **self.objective.teacher_losses(outputs),
            "loss": float(loss_sum.item()) / global_tokens,
            "grad_norm": grad_norm,
            "lr": self._current_lr(),
            "num_tokens": float(global_tokens),
            "num_sequences": float(self._sum_over_dp(len(sequences))),
            # Top-k entries whose id the student has no embedding row for (folded into the tail).
            "teacher_ids_folded": float(self._sum_over_dp(self._folded_ids(sequences))),
            **(self.router_watch.step_stats(self.dp_group, self.pp_group) if self.router_watch else {}),
            "skipped_step": 0.0 if stepped else 1.0,
            "forward_backward_s": forward_backward_s,
            "train_step_s": time.perf_counter() - start,
        }

    def eval_loss(self, shards: Sequence[TrainShard]) -> dict[str, float | None]:
        """The configured divergence (and forward KL = teacher KL, None with teacher.top_k=0) on `shards`, forward only.

        With sampled_reverse_kl the "divergence" is its surrogate on the greedy responses: the mean of
        log s - log t over their tokens (greedy tokens are no samples: not an estimate of the KL).
        """
        self._enter_device()
        start = time.perf_counter()
        sequences = _flatten(shards)
        local_tokens = sum(trained_tokens(s, self.mask_tool_tokens) for s in sequences)
        self._check_same_data_over_model_parallel(len(sequences), local_tokens)
        global_tokens = self._sum_over_dp(local_tokens)
        self._model.eval()
        with torch.no_grad():
            outputs = self._run_schedule(self._micro_batches(sequences), self.objective.eval_loss, forward_only=True)
        sums = self._sum_from_last_stage([out["sums"] for out in outputs], 2)
        dist.all_reduce(sums, group=self.dp_cp_group)
        denominator = max(global_tokens, 1)
        return {
            "loss": float(sums[0].item()) / denominator,
            # teacher.top_k=0: no top-k to compare over.
            "forward_kl": float(sums[1].item()) / denominator if self.cfg.teacher.top_k else None,
            "num_tokens": float(global_tokens),
            "eval_s": time.perf_counter() - start,
        }

    def _folded_ids(self, sequences: list[ScoredSequence]) -> int:
        return sum(
            int((s.teacher_topk_ids[trained_rows(s, self.mask_tool_tokens)] >= self.arch.vocab_size).sum())
            for s in sequences
        )

    def _micro_batches(self, sequences: list[ScoredSequence]) -> LazyMicroBatches:
        budget = self.cfg.actor.max_tokens_per_micro_batch
        if budget:
            groups = split_by_token_budget(sequences, budget)
        else:
            groups = split_micro_batches(sequences, self.cfg.actor.micro_batch_size)
        return LazyMicroBatches(
            groups, self.pad_id, tuple(self.objective.teacher_names), self.device, self.mask_tool_tokens
        )

    def _run_schedule(
        self,
        micro_batches: LazyMicroBatches | list[MicroBatch],
        loss_fn: Callable[..., Any],
        *,
        forward_only: bool,
        collect_non_loss_data: bool = False,
        training: bool = False,
    ) -> list[Any]:
        """Every micro-batch through megatron's schedule; the last stage's `loss_fn` outputs (empty elsewhere).

        `loss_fn(micro, output)` runs on the last stage with its logits [B, T, V_padded / tp]. `training`: a
        mixture of experts' routers are watched and its load-balancing loss weighted by the micro-batch's loss
        tokens (recipe_gkd/actor/moe_stats.py).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[MicroBatch], model: Any) -> tuple[Tensor, Callable[..., Any]]:
            # Context parallelism: this rank's zigzag share of every sequence (the whole micro-batch at CP = 1).
            micro = self.context_split.split(next(data_iterator))
            if self.router_watch is not None:
                self.router_watch.watch(micro.loss_mask_BT if training else None)
                self.tconfig.moe_aux_loss_coeff = scaled_aux_loss_coeff(
                    self.cfg.actor.moe.aux_loss_coeff, micro.num_tokens
                )
            # No attention mask: right padding never precedes a real token, the causal mask suffices.
            # Stages after the first read the previous stage's activations, not input_ids.
            output = model(micro.input_ids_BT, micro.position_ids_BT, None)
            return output, partial(loss_fn, micro)

        if isinstance(micro_batches, LazyMicroBatches):
            shapes = micro_batches.shapes
        else:
            shapes = [(int(m.input_ids_BT.shape[0]), int(m.input_ids_BT.shape[1])) for m in micro_batches]
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[self._model],
            num_microbatches=len(micro_batches),
            # Only an upper bound: stages exchange each micro-batch's shape (variable_seq_lengths).
            seq_length=max(t for _, t in shapes),
            micro_batch_size=max(b for b, _ in shapes),
            forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data,
        )

    def _optimizer_step(self) -> tuple[float, bool]:
        """Clip, advance the lr schedule, step. Returns (pre-clip grad norm, whether it stepped)."""
        found_inf = self.optimizer.prepare_grads()
        grad_norm = clip_grads(self.optimizer, self.cfg.actor.optim.clip_grad, self.device)
        self._steps += 1
        self.scheduler.step(1)
        if found_inf or not math.isfinite(grad_norm):
            # A non-finite gradient would poison Adam's moments: skip this update (reported).
            return grad_norm, False
        self.optimizer.step_with_ready_grads()
        return grad_norm, True

    def _sum_from_last_stage(self, values: list[Tensor], width: int) -> Tensor:
        return sum_from_last_stage(values, width, self.layout, self.pp_group, self.device)

    def _current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _sum_over_dp(self, value: int) -> int:
        total = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(total, group=self.dp_group)
        return int(total.item())

    def _check_same_data_over_model_parallel(self, num_sequences: int, num_tokens: int) -> None:
        """TP and PP ranks compute one model replica together: they must all hold the same sequences."""
        if self.layout.tp_size * self.layout.pp_size == 1:
            return
        stats = torch.tensor([num_sequences, num_tokens, -num_sequences, -num_tokens], device=self.device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=self.mp_group)
        if stats[0] != -stats[2] or stats[1] != -stats[3]:
            raise ValueError(
                f"rank {self.rank}: model-parallel (TP x PP) ranks got different data ({num_sequences} sequences, "
                f"{num_tokens} tokens here); give every rank of a replica the shards of its data-parallel "
                "rank (recipe_gkd.parallel_layout.ParallelLayout.dp_rank)"
            )

    # ------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self, path: str) -> dict[str, float]:
        """Model + optimizer as a megatron dist checkpoint in `path` (empty dir), + lr schedule and step.

        Every rank calls it. The sharded tensors are keyed by their global names (layer numbers
        over all stages) and offsets, so the checkpoint loads into any tensor- and
        pipeline-parallel size (see `load_checkpoint`).
        """
        self._enter_device()
        start = time.perf_counter()
        checkpointing.save_checkpoint(
            path,
            model=self._model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            steps=self._steps,
            rank=self.rank,
            layout=self.layout,
            lora=self.lora,
        )
        return {"save_s": time.perf_counter() - start}

    def load_checkpoint(self, path: str) -> dict[str, float]:
        """Restore what `save_checkpoint` wrote (possibly at another tensor- or pipeline-parallel size)."""
        self._enter_device()
        start = time.perf_counter()
        self._steps = checkpointing.load_checkpoint(
            path,
            model=self._model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            rank=self.rank,
            distributed_optimizer=self.cfg.actor.megatron.distributed_optimizer,
            lora=self.lora,
        )
        return {"load_s": time.perf_counter() - start, "steps": float(self._steps)}

    # ------------------------------------------------------------------------- probes and export

    def token_logprobs(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
        """log p(token t+1 | tokens <= t) under the current weights, fp32 [B, L-1].

        Without a mask every row is one sequence from position 0. With a mask, each row's
        valid tokens (a contiguous run of 1s, e.g. left padding) are scored as a sequence of
        their own, starting at position 0; entries whose t or t+1 is padding are 0. Every
        rank must call this with the same input (tensor-parallel collectives).
        """
        self._enter_device()
        ids_BL = np.asarray(input_ids, dtype=np.int64)
        mask_BL = np.ones_like(ids_BL, dtype=bool) if attention_mask is None else np.asarray(attention_mask, dtype=bool)
        packed_BL, starts_B, lengths_B = pack_rows(ids_BL, mask_BL, self.pad_id)
        packed = torch.from_numpy(packed_BL).to(self.device)
        logprobs_BLV = torch.log_softmax(self._full_logits(packed)[:, :-1], dim=-1)
        packed_logprobs_BL = logprobs_BLV.gather(-1, packed[:, 1:, None]).squeeze(-1).cpu().numpy()
        return unpack_token_logprobs(packed_logprobs_BL, starts_B, lengths_B)

    def forward_logits(self, input_ids: np.ndarray) -> np.ndarray:
        """Full-vocabulary fp32 logits [B, L, V] of unpadded rows (every rank calls it, same input)."""
        self._enter_device()
        ids_BL = torch.as_tensor(np.asarray(input_ids, dtype=np.int64), device=self.device)
        return self._full_logits(ids_BL).cpu().numpy()

    @torch.no_grad()
    def _full_logits(self, ids_BL: Tensor) -> Tensor:
        """fp32 [B, L, V] on every rank: the last stage's vocabulary shards gathered over TP, padding dropped."""
        batch, length = ids_BL.shape
        micro = forward_only_micro_batch(ids_BL, self.device)
        self._model.eval()
        outputs = self._run_schedule(
            [micro], partial(self._gather_logits, length=length), forward_only=True, collect_non_loss_data=True
        )
        if self.layout.pp_size == 1:
            return outputs[0]
        if self.layout.is_last_stage:
            logits_BLV = outputs[0].contiguous()  # cut off the padded vocabulary: a strided view
        else:
            logits_BLV = torch.empty(batch, length, self.arch.vocab_size, dtype=torch.float32, device=self.device)
        last = self.layout.rank_with(pp=self.layout.pp_size - 1)
        dist.broadcast(logits_BLV, src=last, group=self.pp_group)
        return logits_BLV

    def _gather_logits(
        self, micro: MicroBatch, logits_BLv: Tensor, non_loss_data: bool = True, *, length: int
    ) -> Tensor:
        """The last stage's logits shard -> fp32 [B, length, V]: gathered over TP and (context parallel) over CP."""
        if self.layout.tp_size > 1:
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            logits_BLv = gather_from_tensor_model_parallel_region(logits_BLv)
        logits_BLV = logits_BLv[..., : self.arch.vocab_size].float()
        # Context parallelism: every CP rank's positions back in the sequence's order, its padding cut off.
        return self.context_split.gather(logits_BLV, length)

    def export_hf_state_dict(self) -> dict[str, np.ndarray] | None:
        """The current weights as HF-named fp32 arrays, on global rank 0 (None elsewhere).

        Tied embeddings appear once (`model.embed_tokens.weight`), as HF's save_pretrained
        writes them. Every rank must call this: TP ranks of replica 0 gather their shards.
        """
        state = dict(self.iter_hf_weights())
        return state if self.rank == 0 else None

    def iter_hf_weights(self) -> Iterator[tuple[str, np.ndarray]]:
        """The current weights as (HF name, fp32 array on the host), one conversion unit (a decoder layer) at a time.

        Yields on global rank 0 only; every rank must exhaust it. Replica 0's TP ranks gather each
        parameter of their stage; a later stage's TP rank 0 sends it to rank 0. Rank 0 holds one
        unit beyond what the consumer keeps, never the whole model.
        """
        for name, tensor in self.iter_hf_tensors(on_device=False, fp32=True):
            yield name, np.ascontiguousarray(tensor.numpy())

    def iter_hf_tensors(self, on_device: bool, fp32: bool = False) -> Iterator[tuple[str, Tensor]]:
        """The current weights as (HF name, torch tensor), unit by unit, on global rank 0 only (every rank calls).

        See `WeightExporter.iter_hf_tensors` (recipe_gkd/actor/weight_export.py) for `on_device` and `fp32`.
        """
        self._enter_device()
        yield from self._exporter.iter_hf_tensors(on_device, fp32)

    def iter_adapter_tensors(self, on_device: bool) -> Iterator[tuple[str, Tensor]]:
        """The LoRA adapter in its sync form (PEFT names, B scaled: recipe_gkd/weight_sync/adapter.py), layer by
        layer, on global rank 0 only (every rank calls); see `WeightExporter.iter_adapter_tensors`."""
        self._enter_device()
        yield from self._exporter.iter_adapter_tensors(sync_form=True, on_device=on_device)

    def save_adapter(self, out_dir: str) -> str | None:
        """Write the LoRA adapter as a PEFT directory (adapter_config.json, adapter_model.safetensors: B as trained,
        lora_alpha = actor.lora.alpha, fp32) on rank 0; every rank calls it. None without adapters."""
        if self.lora is None:
            return None
        self._enter_device()
        state = dict(self._exporter.iter_adapter_tensors(sync_form=False, on_device=False, fp32=True))
        if self.rank == 0:
            lora, student = self.lora, self.cfg.model.student_path
            config = adapter_config(lora.rank, lora.alpha, lora.targets, student, dropout=lora.dropout)
            write_peft_dir(Path(out_dir), state, config)
        dist.barrier()
        return str(out_dir) if self.rank == 0 else None

    def save_hf(self, out_dir: str) -> str | None:
        """Write an HF directory (config, model.safetensors, tokenizer) on rank 0; every rank calls it."""
        state = self.export_hf_state_dict()
        if state is not None:
            source = Path(self.cfg.model.student_path)
            write_hf_dir(state, Path(out_dir), source, Path(self.cfg.model.tokenizer_path or source))
        dist.barrier()
        return str(out_dir) if state is not None else None


# ----------------------------------------------------------------------------- helpers


def _flatten(shards: Sequence[TrainShard]) -> list[ScoredSequence]:
    for shard in shards:
        if not isinstance(shard, TrainShard):
            raise TypeError(
                f"train_step takes a list of TrainShard, got {type(shard).__name__}; resolve Ray refs with ray.get first"
            )
    return [seq for shard in shards for seq in shard.sequences]
