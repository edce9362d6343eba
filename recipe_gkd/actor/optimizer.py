"""The actor's optimizer: megatron's DDP wrapper, Adam(W) with its warmup schedule, global grad-norm clipping.

bf16: megatron keeps fp32 master weights; `actor.megatron.distributed_optimizer` shards them and
the Adam moments over data parallel. megatron is imported inside the functions (the actor module
must import without it).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from recipe_gkd.config import GKDConfig, scaled_lr

# Clip coefficient max_norm / (norm + eps), as torch.nn.utils.clip_grad_norm_ and megatron do.
CLIP_EPS = 1.0e-6


def wrap_ddp(cfg: GKDConfig, tconfig: Any, gpt: torch.nn.Module, bf16: bool) -> Any:
    """megatron's DistributedDataParallel around `gpt` (Float16Module first for bf16)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.transformer.module import Float16Module

    module = Float16Module(tconfig, gpt) if bf16 else gpt
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        # Reduce-scatter of the grads into each rank's optimizer shard, all-gather of the params after.
        use_distributed_optimizer=cfg.actor.megatron.distributed_optimizer,
    )
    # Run by megatron's schedule after the backward passes: DP all-reduce, tied-embedding
    # all-reduce between the first and last stage, division by the global loss-token count.
    tconfig.finalize_model_grads_func = finalize_model_grads
    return DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=module)


def build_optimizer(cfg: GKDConfig, model: Any, bf16: bool) -> tuple[Any, Any]:
    """megatron's Adam(W) over the DDP-wrapped `model` and its lr / weight-decay schedule."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o = cfg.actor.optim
    lr = scaled_lr(cfg)
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.beta1,
        adam_beta2=o.beta2,
        adam_eps=o.eps,
        # megatron's own clipping asserts CUDA tensors: `clip_grads` does it with torch ops.
        clip_grad=0.0,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        # fp32 master weights and Adam moments sharded over data parallel (megatron's DistributedOptimizer).
        use_distributed_optimizer=cfg.actor.megatron.distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, [model])
    # Linear warmup to `lr` over actor.optim.warmup_steps, then constant; wd off for norms/biases.
    scheduler = OptimizerParamScheduler(
        optimizer,
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
    return optimizer, scheduler


@torch.no_grad()
def clip_grads(optimizer: Any, max_norm: float, device: torch.device) -> float:
    """Global L2 grad norm; scale the grads to `max_norm` (actor.optim.clip_grad) when above it.

    megatron lists each TP shard once and skips TP-replicated params (norm weights) on all
    but TP rank 0, so the model-parallel all-reduce counts every gradient entry once. A mixture of
    experts has two leaf optimizers whose gradients live on different groups (the dense ones: the
    model-parallel group; the experts': the expert-model-parallel group, each expert on one expert-
    parallel rank): each leaf's squares are summed over its own group, then added (megatron-core
    0.16.1 ChainedOptimizer.get_grad_norm, when the groups differ).
    """
    leaves = leaf_optimizers(optimizer)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for leaf in leaves:
        squares = torch.zeros((), dtype=torch.float32, device=device)
        for grad in leaf.get_main_grads_for_grad_norm():
            squares += torch.linalg.vector_norm(grad, dtype=torch.float32) ** 2
        dist.all_reduce(squares, group=leaf.get_grad_stats_parallel_group())
        total += squares
    grad_norm = float(total.sqrt().item())
    if max_norm > 0 and math.isfinite(grad_norm):
        coeff = max_norm / (grad_norm + CLIP_EPS)
        if coeff < 1.0:
            all_grads = [p.grad for opt in leaves for p in opt.get_parameters() if p.grad is not None]
            torch._foreach_mul_(all_grads, coeff)
    return grad_norm


def leaf_optimizers(optimizer: Any) -> list[Any]:
    """The optimizers under megatron's ChainedOptimizer (or `optimizer` itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))
