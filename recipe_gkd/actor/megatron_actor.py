"""The student trainer: one megatron-core GPTModel rank (TP x PP x DP; CP = 1), a plain class.

The driver applies `ray.remote` and calls every method on every actor rank (they all take part
in collectives); tests construct it directly, one process per rank. One step:

1. collate this rank's sequences into right-padded micro-batches (`actor.micro_batch_size`
   sequences, or by tokens: `actor.max_tokens_per_micro_batch`); every TP and PP rank of a
   data-parallel replica holds the same sequences,
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
"""

from __future__ import annotations

import math
import queue
import shutil
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceOf
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from recipe_gkd.actor import hf_convert, mcore_model
from recipe_gkd.actor.collate import MicroBatch, collate, split_by_token_budget, split_micro_batches
from recipe_gkd.actor.layout import rank_layout
from recipe_gkd.batch import Sequence, TrainShard
from recipe_gkd.config import Device, Divergence, GKDConfig, Precision, actor_world_size, cpu_threads, scaled_lr
from recipe_gkd.losses import gkd_loss_sum, sampled_reverse_kl_loss_sum, vocab_parallel_gkd_loss_sum

# megatron's RNG tracker needs a seed; nothing random runs (no dropout, weights from HF).
MEGATRON_SEED = 1234
# Clip coefficient max_norm / (norm + eps), as torch.nn.utils.clip_grad_norm_ and megatron do.
CLIP_EPS = 1.0e-6
WEIGHTS_FILE = "model.safetensors"
# The lr schedule and step count beside the dist checkpoint (plain objects, rank 0 only).
ACTOR_STATE_FILE = "actor_state.pt"
# Per rank: torch and megatron RNG states (nothing random runs today; kept so dropout would resume exactly).
RNG_FILE = "rng_rank{rank}.pt"
# Largest rank of a weight sent between pipeline stages during export (matrices and vectors).
MAX_EXPORT_NDIM = 4
# Parameter dtypes a pipeline stage may send to rank 0 in an export (their index travels in the header).
EXPORT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Files of an HF directory that hold weights or the model config (everything else is copied).
HF_NON_TOKENIZER_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".pt", ".pth")


class MegatronActor:
    """One rank of the megatron student trainer (see module docstring)."""

    def __init__(self, cfg: GKDConfig, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.master_addr = master_addr
        self.master_port = master_port
        self.on_cpu = cfg.cluster.device == Device.cpu
        self.layout = rank_layout(cfg, rank)
        self._steps = 0
        self._model: Any = None

    # ------------------------------------------------------------------------- setup / teardown

    def setup(self) -> dict[str, Any]:
        """Process group + megatron parallel state, model with the student's HF weights, optimizer."""
        start = time.perf_counter()
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(self.cfg.model.student_path)
        self.arch = hf_convert.read_hf_arch(hf_config)
        self.pad_id = int(getattr(hf_config, "pad_token_id", None) or 0)
        self._check_world()  # before anything global changes: a bad layout fails cleanly
        if threads := cpu_threads(self.cfg)["actor"]:
            torch.set_num_threads(threads)
        self._enter_device()
        self._init_distributed()
        m = self.cfg.actor.megatron
        bf16 = self.cfg.actor.precision == Precision.bf16
        self.tconfig = mcore_model.build_transformer_config(
            self.arch,
            tp_size=m.tp,
            pp_size=m.pp,
            cp_size=m.cp,
            bf16=bf16,
            on_cpu=self.on_cpu,
            recompute=m.recompute.value,
            attention=m.attention.value,
        )
        self.gpt = mcore_model.build_gpt_model(
            self.arch,
            self.tconfig,
            pre_process=self.layout.is_first_stage,
            post_process=self.layout.is_last_stage,
            attention=m.attention.value,
        )
        self._check_stage_layers()
        if not self.on_cpu:
            self.gpt.cuda(torch.cuda.current_device())
        # This stage's parameter names -> names in the whole model (layers renumbered per stage).
        self._global_names = hf_convert.stage_param_names(self.arch, self.layout.pp_rank, self.layout.pp_size)
        reader = hf_convert.HFCheckpointReader(self.cfg.model.student_path)
        self._load_stage(reader)
        num_params = sum(reader.numel(n) for n in hf_convert.hf_param_names(self.arch))
        self._model = self._wrap_ddp(bf16)
        self._build_optimizer(bf16)
        self._vocab_shard = self._local_vocab_slice()
        return {
            "rank": self.rank,
            "tp_rank": self.layout.tp_rank,
            "dp_rank": self.layout.dp_rank,
            "pp_rank": self.layout.pp_rank,
            "tp_size": self.layout.tp_size,
            "dp_size": self.layout.dp_size,
            "pp_size": self.layout.pp_size,
            "device": str(self.device),
            "num_params": num_params,
            "num_local_params": sum(p.numel() for p in self.gpt.parameters()),
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
        return (
            f"{a.precision.value} params ({'fp32 master weights, ' if a.precision == Precision.bf16 else ''}"
            f"Adam), attention: {attention}, local layer spec (no Transformer Engine), recompute: "
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
        m = self.cfg.actor.megatron
        hf_convert.check_split(self.arch, m.tp, m.pp, m.cp)

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
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{self.master_addr}:{self.master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=self.cfg.debug.hang_timeout_s),
        )
        m = self.cfg.actor.megatron
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=m.tp, pipeline_model_parallel_size=m.pp, context_parallel_size=m.cp
        )
        model_parallel_cuda_manual_seed(MEGATRON_SEED)
        megatron_coords = (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank(),
        )
        ours = (self.layout.tp_rank, self.layout.dp_rank, self.layout.pp_rank)
        if megatron_coords != ours:
            raise RuntimeError(
                f"rank {self.rank}: megatron places it at (tp, dp, pp) = {megatron_coords}, "
                f"recipe_gkd.actor.layout at {ours}"
            )
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        # TP x PP: the ranks that compute one model replica together (and hold the same data).
        self.mp_group = parallel_state.get_model_parallel_group()

    def _load_stage(self, reader: hf_convert.HFCheckpointReader) -> None:
        """This rank's shards of this stage's parameters, read from the HF checkpoint unit by unit."""
        params = dict(self.gpt.named_parameters())
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

    def _wrap_ddp(self, bf16: bool) -> Any:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.transformer.module import Float16Module

        module = Float16Module(self.tconfig, self.gpt) if bf16 else self.gpt
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            # Reduce-scatter of the grads into each rank's optimizer shard, all-gather of the params after.
            use_distributed_optimizer=self.cfg.actor.megatron.distributed_optimizer,
        )
        # Run by megatron's schedule after the backward passes: DP all-reduce, tied-embedding
        # all-reduce between the first and last stage, division by the global loss-token count.
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        return DistributedDataParallel(config=self.tconfig, ddp_config=ddp_config, module=module)

    def _build_optimizer(self, bf16: bool) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = self.cfg.actor.optim
        lr = scaled_lr(self.cfg)
        config = OptimizerConfig(
            optimizer="adam",
            lr=lr,
            min_lr=lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.beta1,
            adam_beta2=o.beta2,
            adam_eps=o.eps,
            # megatron's own clipping asserts CUDA tensors: `_clip_grads` does it with torch ops.
            clip_grad=0.0,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            # fp32 master weights and Adam moments sharded over data parallel (megatron's DistributedOptimizer).
            use_distributed_optimizer=self.cfg.actor.megatron.distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(config, [self._model])
        # Linear warmup to `lr` over actor.optim.warmup_steps, then constant; wd off for norms/biases.
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=lr,
            min_lr=lr,
            lr_warmup_steps=o.warmup_steps,
            lr_decay_steps=o.warmup_steps + 1,
            lr_decay_style="constant",
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )

    def _local_vocab_slice(self) -> slice:
        """This rank's real (unpadded) vocabulary columns of its logits shard."""
        padded = hf_convert.padded_vocab_size(self.arch.vocab_size, self.layout.tp_size)
        shard = padded // self.layout.tp_size
        self._vocab_start = self.layout.tp_rank * shard
        return slice(0, max(0, min(shard, self.arch.vocab_size - self._vocab_start)))

    # ------------------------------------------------------------------------- training

    def train_step(self, shards: SequenceOf[TrainShard]) -> dict[str, float]:
        """One optimizer step on this rank's shards (the TrainShards themselves, not refs).

        Every TP rank of a data-parallel replica must get the same shards. Returns the global
        token-mean loss (same on every rank) and step statistics.
        """
        self._enter_device()
        start = time.perf_counter()
        sequences = _flatten(shards)
        local_tokens = sum(s.num_response_tokens for s in sequences)
        self._check_same_data_over_model_parallel(len(sequences), local_tokens)
        global_tokens = self._sum_over_dp(local_tokens)
        if global_tokens == 0:
            raise ValueError(f"step {self._steps + 1}: no response tokens on any data-parallel rank")
        self._model.train()
        self._model.zero_grad_buffer()
        self.optimizer.zero_grad()
        # Backward of each micro-batch's loss sum; finalize_model_grads divides by the global count.
        outputs = self._run_schedule(self._micro_batches(sequences), self._train_loss, forward_only=False)
        loss_sum = self._sum_from_last_stage([out["loss_sum"] for out in outputs], width=1)[0]
        forward_backward_s = time.perf_counter() - start
        grad_norm, stepped = self._optimizer_step()
        dist.all_reduce(loss_sum, group=self.dp_group)
        policy_stats = self._policy_stats(outputs, global_tokens) if self._sampled_objective else {}
        return {
            **policy_stats,
            "loss": float(loss_sum.item()) / global_tokens,
            "grad_norm": grad_norm,
            "lr": self._current_lr(),
            "num_tokens": float(global_tokens),
            "num_sequences": float(self._sum_over_dp(len(sequences))),
            # Top-k entries whose id the student has no embedding row for (folded into the tail).
            "teacher_ids_folded": float(self._sum_over_dp(self._folded_ids(sequences))),
            "skipped_step": 0.0 if stepped else 1.0,
            "forward_backward_s": forward_backward_s,
            "train_step_s": time.perf_counter() - start,
        }

    def eval_loss(self, shards: SequenceOf[TrainShard]) -> dict[str, float | None]:
        """The configured divergence (and forward KL = teacher KL, None with teacher.top_k=0) on `shards`, forward only.

        With sampled_reverse_kl the "divergence" is its surrogate on the greedy responses: the mean of
        log s - log t over their tokens (greedy tokens are no samples: not an estimate of the KL).
        """
        self._enter_device()
        start = time.perf_counter()
        sequences = _flatten(shards)
        local_tokens = sum(s.num_response_tokens for s in sequences)
        self._check_same_data_over_model_parallel(len(sequences), local_tokens)
        global_tokens = self._sum_over_dp(local_tokens)
        self._model.eval()
        with torch.no_grad():
            outputs = self._run_schedule(self._micro_batches(sequences), self._eval_loss, forward_only=True)
        sums = self._sum_from_last_stage([out["sums"] for out in outputs], width=2)
        dist.all_reduce(sums, group=self.dp_group)
        denominator = max(global_tokens, 1)
        return {
            "loss": float(sums[0].item()) / denominator,
            # teacher.top_k=0: no top-k to compare over.
            "forward_kl": float(sums[1].item()) / denominator if self.cfg.teacher.top_k else None,
            "num_tokens": float(global_tokens),
            "eval_s": time.perf_counter() - start,
        }

    def _folded_ids(self, sequences: list[Sequence]) -> int:
        return sum(int((s.teacher_topk_ids >= self.arch.vocab_size).sum()) for s in sequences)

    def _micro_batches(self, sequences: list[Sequence]) -> list[MicroBatch]:
        budget = self.cfg.actor.max_tokens_per_micro_batch
        if budget:
            groups = split_by_token_budget(sequences, budget)
        else:
            groups = split_micro_batches(sequences, self.cfg.actor.micro_batch_size)
        return [collate(group, self.pad_id).to(self.device) for group in groups]

    def _run_schedule(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: Callable[..., Any],
        *,
        forward_only: bool,
        collect_non_loss_data: bool = False,
    ) -> list[Any]:
        """Every micro-batch through megatron's schedule; the last stage's `loss_fn` outputs (empty elsewhere).

        `loss_fn(micro, output)` runs on the last stage with its logits [B, T, V_padded / tp].
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[MicroBatch], model: Any) -> tuple[Tensor, Callable[..., Any]]:
            micro = next(data_iterator)
            # No attention mask: right padding never precedes a real token, the causal mask suffices.
            # Stages after the first read the previous stage's activations, not input_ids.
            output = model(micro.input_ids_BT, micro.position_ids_BT, None)
            return output, partial(loss_fn, micro)

        shapes = [tuple(m.input_ids_BT.shape) for m in micro_batches]
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

    @property
    def _sampled_objective(self) -> bool:
        return self.cfg.algorithm.divergence == Divergence.sampled_reverse_kl

    def _train_loss(self, micro: MicroBatch, logits_BTv: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        # (loss sum, loss tokens, logged): with calculate_per_token_loss megatron keeps the sum as is.
        num_tokens = torch.tensor(micro.num_tokens, dtype=torch.int, device=self.device)
        if self._sampled_objective:
            loss_sum, logged = self._sampled_loss_sum(logits_BTv, micro)
            return loss_sum, num_tokens, {"loss_sum": loss_sum.detach().double(), **logged}
        loss_sum, _ = self._loss_sum(logits_BTv, micro)
        return loss_sum, num_tokens, {"loss_sum": loss_sum.detach().double()}

    def _eval_loss(self, micro: MicroBatch, logits_BTv: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        if self._sampled_objective:
            loss_sum = self._sampled_loss_sum(logits_BTv, micro)[0]
        else:
            loss_sum, _ = self._loss_sum(logits_BTv, micro)
        kl_sum = torch.zeros((), dtype=loss_sum.dtype, device=self.device)
        if self.cfg.teacher.top_k:
            kl_sum, _ = self._loss_sum(logits_BTv, micro, divergence="forward_kl")
        num_tokens = torch.tensor(micro.num_tokens, dtype=torch.int, device=self.device)
        return loss_sum, num_tokens, {"sums": torch.stack([loss_sum, kl_sum]).double()}

    def _sampled_loss_sum(self, logits_BTv: Tensor, micro: MicroBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """The sampled-token reverse-KL surrogate's sum over the loss tokens and its logged statistics."""
        logits_BTv = logits_BTv[..., self._vocab_shard]
        tp = self.layout.tp_size > 1
        loss_sum, _, stats = sampled_reverse_kl_loss_sum(
            logits_BTv,
            micro.target_ids_BT,
            micro.rollout_logprobs_BT,
            micro.teacher_sampled_BT,
            micro.loss_mask_BT,
            ratio_clip=self.cfg.algorithm.ratio_clip,
            vocab_start=self._vocab_start if tp else 0,
            vocab_size=self.arch.vocab_size if tp else None,
            group=self.tp_group if tp else None,
        )
        sums = torch.stack([stats.advantage_sum, stats.ratio_sum, stats.clipped])
        return loss_sum, {"policy_sums": sums, "policy_extremes": torch.stack([stats.ratio_max, -stats.ratio_min])}

    def _policy_stats(self, outputs: list[dict[str, Tensor]], global_tokens: int) -> dict[str, float]:
        """Token means of the advantage and ratio, the clipped fraction, the ratio's range, over the global batch."""
        sums = self._sum_from_last_stage([out["policy_sums"] for out in outputs], width=3)
        dist.all_reduce(sums, group=self.dp_group)
        extremes = torch.full((2,), -math.inf, dtype=torch.float64, device=self.device)
        for out in outputs:
            extremes = torch.maximum(extremes, out["policy_extremes"].reshape(2))
        if self.layout.pp_size > 1:
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.pp_group)  # -inf except on the last stage
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.dp_group)
        advantage, ratio, clipped = (float(x) / global_tokens for x in sums.tolist())
        return {
            "advantage_mean": advantage,
            "ratio_mean": ratio,
            "ratio_max": float(extremes[0].item()),
            "ratio_min": -float(extremes[1].item()),
            "ratio_clipped_frac": clipped,
        }

    def _sum_from_last_stage(self, values: list[Tensor], width: int) -> Tensor:
        """The sum of the last stage's per-micro-batch values [width], on every stage of the pipeline."""
        total = torch.zeros(width, dtype=torch.float64, device=self.device)
        for value in values:
            total += value.reshape(width)
        if self.layout.pp_size > 1:
            dist.all_reduce(total, group=self.pp_group)  # zeros except on the last stage
        return total

    def _loss_sum(self, logits_BTv: Tensor, micro: MicroBatch, divergence: str | None = None) -> tuple[Tensor, Tensor]:
        """Sum of per-token divergences over the micro-batch's loss tokens (same on all TP ranks)."""
        a = self.cfg.algorithm
        kwargs: dict[str, Any] = {
            "divergence": divergence or a.divergence.value,
            "beta": a.beta,
            "temperature": a.temperature,
            "tail": a.tail,
            "teacher_tail_logmass": micro.teacher_tail_BT,
        }
        # Padded vocabulary columns are not tokens: they are cut off, never given mass.
        logits_BTv = logits_BTv[..., self._vocab_shard]
        batch = (micro.teacher_logprobs_BTK, micro.teacher_ids_BTK, micro.loss_mask_BT)
        if self.layout.tp_size == 1:
            return gkd_loss_sum(logits_BTv, *batch, **kwargs)
        return vocab_parallel_gkd_loss_sum(
            logits_BTv,
            *batch,
            vocab_start=self._vocab_start,
            vocab_size=self.arch.vocab_size,
            group=self.tp_group,
            **kwargs,
        )

    def _optimizer_step(self) -> tuple[float, bool]:
        """Clip, advance the lr schedule, step. Returns (pre-clip grad norm, whether it stepped)."""
        found_inf = self.optimizer.prepare_grads()
        grad_norm = self._clip_grads()
        self._steps += 1
        self.scheduler.step(1)
        if found_inf or not math.isfinite(grad_norm):
            # A non-finite gradient would poison Adam's moments: skip this update (reported).
            return grad_norm, False
        self.optimizer.step_with_ready_grads()
        return grad_norm, True

    @torch.no_grad()
    def _clip_grads(self) -> float:
        """Global L2 grad norm; scale the grads to actor.optim.clip_grad when above it.

        megatron lists each TP shard once and skips TP-replicated params (norm weights) on all
        but TP rank 0, so the model-parallel all-reduce counts every gradient entry once.
        """
        leaves = _leaf_optimizers(self.optimizer)
        grads = [g for opt in leaves for g in opt.get_main_grads_for_grad_norm()]
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for grad in grads:
            squares += torch.linalg.vector_norm(grad, dtype=torch.float32) ** 2
        dist.all_reduce(squares, group=self.optimizer.get_grad_stats_parallel_group())
        grad_norm = float(squares.sqrt().item())
        max_norm = self.cfg.actor.optim.clip_grad
        if max_norm > 0 and math.isfinite(grad_norm):
            coeff = max_norm / (grad_norm + CLIP_EPS)
            if coeff < 1.0:
                all_grads = [p.grad for opt in leaves for p in opt.get_parameters() if p.grad is not None]
                torch._foreach_mul_(all_grads, coeff)
        return grad_norm

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
                "rank (recipe_gkd.actor.layout.data_parallel_rank)"
            )

    # ------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self, path: str) -> dict[str, float]:
        """Model + optimizer as a megatron dist checkpoint in `path` (empty dir), + lr schedule and step.

        Every rank calls it. The sharded tensors are keyed by their global names (layer numbers
        over all stages) and offsets, so the checkpoint loads into any tensor- and
        pipeline-parallel size (see `load_checkpoint`).
        """
        from megatron.core import dist_checkpointing

        self._enter_device()
        start = time.perf_counter()
        out = Path(path)
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        _in_process_write_results()
        dist_checkpointing.save(self._sharded_state_dict(), str(out))
        if self.rank == 0:
            state = {
                "scheduler": self.scheduler.state_dict(),
                "steps": self._steps,
                "tp": self.layout.tp_size,
                "pp": self.layout.pp_size,
            }
            torch.save(state, out / ACTOR_STATE_FILE)
        torch.save(_rng_states(), out / RNG_FILE.format(rank=self.rank))
        dist.barrier()
        return {"save_s": time.perf_counter() - start}

    def load_checkpoint(self, path: str) -> dict[str, float]:
        """Restore what `save_checkpoint` wrote (possibly at another tensor- or pipeline-parallel size)."""
        from megatron.core import dist_checkpointing

        self._enter_device()
        start = time.perf_counter()
        self._init_empty_optimizer_state()
        loaded = dist_checkpointing.load(self._sharded_state_dict(is_loading=True), path)
        self._model.module.load_state_dict(loaded["model"], strict=True)
        self.optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(self.optimizer)
        # fp32 main params (bf16 training) are the optimizer's copy: refresh them from the model.
        self.optimizer.reload_model_params()
        state = torch.load(Path(path) / ACTOR_STATE_FILE, weights_only=False)
        self.scheduler.load_state_dict(state["scheduler"])
        self._steps = int(state["steps"])
        rng = Path(path) / RNG_FILE.format(rank=self.rank)
        if rng.is_file():  # absent when this rank did not exist at save time (a larger world)
            _set_rng_states(torch.load(rng, weights_only=False))
        dist.barrier()
        return {"load_s": time.perf_counter() - start, "steps": float(self._steps)}

    def _init_empty_optimizer_state(self) -> None:
        """Give a distributed optimizer that has not stepped yet its Adam state, to be overwritten by the load.

        megatron-core 0.16.1's DistributedOptimizer.state_dict() (optimizer/distrib_optimizer.py)
        reads every parameter's Adam `step` when neither Apex nor Transformer Engine provides the
        fused Adam, so loading into a fresh one fails; its own
        `_init_optimizer_states_with_dummy_values` (one step with zero gradients, used by megatron
        for the FSDP format) creates the state. The main params it touches are reloaded from the
        model after the load (`reload_model_params`).
        """
        if not self.cfg.actor.megatron.distributed_optimizer:
            return
        for leaf in _leaf_optimizers(self.optimizer):
            if not leaf.optimizer.state:
                leaf._init_optimizer_states_with_dummy_values()
            _keep_adam_step_on_reshardable_load(leaf)

    def _sharded_state_dict(self, is_loading: bool = False) -> dict[str, Any]:
        model_sd = self._model.module.sharded_state_dict()
        # The distributed optimizer's default format (fully_sharded_model_space) is refused by
        # megatron-core 0.16.1's own checkpointing (flattened ranges); fully_reshardable gathers its
        # shards into per-parameter tensors, so a checkpoint loads at another TP / PP / DP size.
        metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
        optimizer_sd = self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
        return {"model": model_sd, "optimizer": optimizer_sd}

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
        starts_B, lengths_B = _contiguous_runs(mask_BL)
        batch, length = ids_BL.shape
        packed_BL = np.full((batch, length), self.pad_id, dtype=np.int64)
        for row in range(batch):
            packed_BL[row, : lengths_B[row]] = ids_BL[row, starts_B[row] : starts_B[row] + lengths_B[row]]
        packed = torch.from_numpy(packed_BL).to(self.device)
        logprobs_BLV = torch.log_softmax(self._full_logits(packed)[:, :-1], dim=-1)
        packed_logprobs_BL = logprobs_BLV.gather(-1, packed[:, 1:, None]).squeeze(-1).cpu().numpy()
        out_BL = np.zeros((batch, length - 1), dtype=np.float32)
        for row in range(batch):
            scored = max(lengths_B[row] - 1, 0)
            out_BL[row, starts_B[row] : starts_B[row] + scored] = packed_logprobs_BL[row, :scored]
        return out_BL

    def forward_logits(self, input_ids: np.ndarray) -> np.ndarray:
        """Full-vocabulary fp32 logits [B, L, V] of unpadded rows (every rank calls it, same input)."""
        self._enter_device()
        ids_BL = torch.as_tensor(np.asarray(input_ids, dtype=np.int64), device=self.device)
        return self._full_logits(ids_BL).cpu().numpy()

    @torch.no_grad()
    def _full_logits(self, ids_BL: Tensor) -> Tensor:
        """fp32 [B, L, V] on every rank: the last stage's vocabulary shards gathered over TP, padding dropped."""
        batch, length = ids_BL.shape
        positions_BL = torch.arange(length, device=self.device).expand(batch, length)
        micro = MicroBatch(ids_BL, positions_BL, *_no_teacher(batch, length, self.device))
        self._model.eval()
        outputs = self._run_schedule([micro], self._gather_logits, forward_only=True, collect_non_loss_data=True)
        if self.layout.pp_size == 1:
            return outputs[0]
        if self.layout.is_last_stage:
            logits_BLV = outputs[0].contiguous()  # cut off the padded vocabulary: a strided view
        else:
            logits_BLV = torch.empty(batch, length, self.arch.vocab_size, dtype=torch.float32, device=self.device)
        last = self.layout.global_rank(self.layout.tp_rank, self.layout.dp_rank, self.layout.pp_size - 1)
        dist.broadcast(logits_BLV, src=last, group=self.pp_group)
        return logits_BLV

    def _gather_logits(self, micro: MicroBatch, logits_BLv: Tensor, non_loss_data: bool = True) -> Tensor:
        if self.layout.tp_size > 1:
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            logits_BLv = gather_from_tensor_model_parallel_region(logits_BLv)
        return logits_BLv[..., : self.arch.vocab_size].float()

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

        on_device: each tensor stays on this rank's device in the training dtype (bf16 params: bf16), as
        gathered: a GPU export for an NCCL broadcast never visits host memory. Such tensors may be the live
        parameters (TP=1): consume them before the next optimizer step. Otherwise a copy on the host, in the
        training dtype (the object store) or, with `fp32`, in fp32 (HF checkpoints).
        """
        self._enter_device()
        if self.layout.dp_rank != 0:
            return
        params = dict(self.gpt.named_parameters())
        # The tied embedding's copy on the last stage is the first stage's embedding: exported once.
        owned = {g: params[local] for local, g in self._global_names.items() if local == g or g != hf_convert.EMBEDDING}
        for unit, names in hf_convert.mcore_units(self.arch).items():
            full = {name: self._whole_on_rank0(name, owned.get(name), on_device, fp32) for name in names}
            if self.rank == 0:
                whole = {name: tensor for name, tensor in full.items() if tensor is not None}
                yield from hf_convert.mcore_unit_to_hf(unit, whole, self.arch).items()

    def _whole_on_rank0(self, name: str, param: Tensor | None, on_device: bool, fp32: bool) -> Tensor | None:
        """Global parameter `name` unsharded on global rank 0 (None on every other rank): on this rank's
        device in the parameter's dtype (`on_device`), else a host copy in that dtype or (`fp32`) in fp32."""
        owner = hf_convert.owner_stage(name, self.arch, self.layout.pp_size)
        if self.layout.pp_rank != owner:
            if self.rank != 0:
                return None
            received = self._recv_tensor(src=self.layout.global_rank(0, 0, owner))
            return received if on_device else received.to("cpu", torch.float32 if fp32 else received.dtype)
        if param is None:
            raise RuntimeError(f"weight export: {name} is missing from pipeline stage {owner}")
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

    def save_hf(self, out_dir: str) -> str | None:
        """Write an HF directory (config, model.safetensors, tokenizer) on rank 0; every rank calls it."""
        from safetensors.numpy import save_file
        from transformers import AutoConfig

        state = self.export_hf_state_dict()
        if state is not None:
            out = Path(out_dir)
            out.mkdir(parents=True, exist_ok=True)
            source = Path(self.cfg.model.student_path)
            hf_config = AutoConfig.from_pretrained(source)
            hf_config.dtype = "float32"  # the exported weights are fp32 whatever the training precision
            hf_config.save_pretrained(out)
            save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
            _copy_tokenizer_files(Path(self.cfg.model.tokenizer_path or source), out)
        dist.barrier()
        return str(out_dir) if state is not None else None


# ----------------------------------------------------------------------------- helpers


def _flatten(shards: SequenceOf[TrainShard]) -> list[Sequence]:
    for shard in shards:
        if not isinstance(shard, TrainShard):
            raise TypeError(
                f"train_step takes a list of TrainShard, got {type(shard).__name__}; resolve Ray refs with ray.get first"
            )
    return [seq for shard in shards for seq in shard.sequences]


def _in_process_write_results() -> None:
    """Make megatron's checkpoint writer report through an in-process queue.

    By default it creates a multiprocessing Manager server process on the first save, which
    outlives this worker when the run is killed (kill -9): an orphan per actor rank. A
    synchronous save reads the queue in this very process, so a plain queue is enough.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()


def _rng_states() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_states(states: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(states["torch"])
    get_cuda_rng_tracker().set_states(states["tracker"])


def _no_teacher(batch: int, length: int, device: torch.device) -> tuple[Any, ...]:
    """Empty teacher fields of a MicroBatch that is only run forward for its logits (in field order)."""
    return (
        torch.zeros(batch, length, 0, dtype=torch.float32, device=device),
        torch.zeros(batch, length, 0, dtype=torch.int64, device=device),
        torch.zeros(batch, length, dtype=torch.float32, device=device),
        torch.zeros(batch, length, dtype=torch.bool, device=device),
        0,
        torch.zeros(batch, length, dtype=torch.int64, device=device),
        torch.zeros(batch, length, dtype=torch.float32, device=device),
        torch.zeros(batch, length, dtype=torch.float32, device=device),
    )


def _keep_adam_step_on_reshardable_load(optimizer: Any) -> None:
    """Let a fully_reshardable load set torch Adam's per-parameter `step` (megatron-core 0.16.1 fix).

    Without Apex / Transformer Engine, DistributedOptimizer.load_state_dict puts the checkpoint's
    step into every torch Adam state, then `_set_main_param_and_optimizer_states` copies each
    saved tensor into *every* state key, and the fully_reshardable format saves no "step":
    KeyError (optimizer/distrib_optimizer.py). The step is already restored at that point, so it
    is passed through as is. Bound to this optimizer instance only.
    """
    if getattr(optimizer, "_gkd_step_kept", False):
        return
    original = optimizer._set_main_param_and_optimizer_states

    def set_states(model_param: Any, tensors: dict[str, Any]) -> None:
        group_index, group_order = optimizer.model_param_group_index_map[model_param]
        state = optimizer.optimizer.state[optimizer.optimizer.param_groups[group_index]["params"][group_order]]
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"]}
        original(model_param, tensors)

    optimizer._set_main_param_and_optimizer_states = set_states
    optimizer._gkd_step_kept = True


def _unshare_adam_steps(optimizer: Any) -> None:
    """One `step` tensor per parameter again after a distributed-optimizer load (megatron-core 0.16.1 fix).

    Without Apex / Transformer Engine, DistributedOptimizer.load_state_dict gives every torch
    Adam state the *same* step tensor; torch's Adam then adds 1 to it once per parameter, so the
    bias correction of every later step is wrong (measured: step 2 -> 17 after one step of a
    15-parameter model). A no-op for the other optimizers (their states hold separate steps).
    """
    for leaf in _leaf_optimizers(optimizer):
        for state in leaf.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def _leaf_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _contiguous_runs(mask_BL: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: start and length of its run of True values (which must be contiguous)."""
    lengths_B = mask_BL.sum(axis=1)
    starts_B = np.where(lengths_B > 0, mask_BL.argmax(axis=1), 0)
    for row, (start, count) in enumerate(zip(starts_B, lengths_B, strict=True)):
        if not mask_BL[row, start : start + count].all():
            raise ValueError(f"attention_mask row {row} is not one contiguous run of 1s")
    return starts_B, lengths_B


def _copy_tokenizer_files(source: Path, out: Path) -> None:
    for path in source.iterdir():
        if path.is_file() and path.name != "config.json" and not path.name.endswith(HF_NON_TOKENIZER_SUFFIXES):
            shutil.copy2(path, out / path.name)
