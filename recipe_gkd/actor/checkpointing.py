"""Actor checkpoints: model and optimizer as a megatron dist checkpoint, the lr schedule, step and RNG beside it.

The sharded tensors are keyed by their global names (layer numbers over all stages) and offsets,
so a checkpoint loads into any tensor-, pipeline-, data- and expert-parallel size (an expert under its global
number: megatron's SequentialMLP.sharded_state_dict). Also the two
megatron-core 0.16.1 fixes a distributed-optimizer load needs without Apex / Transformer Engine.
megatron is imported inside the functions.
"""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recipe_gkd.actor.lora import LoRASettings, is_adapter
from recipe_gkd.actor.optimizer import leaf_optimizers
from recipe_gkd.config import ConfigError
from recipe_gkd.parallel_layout import ParallelLayout

# The lr schedule and step count beside the dist checkpoint (plain objects, rank 0 only).
ACTOR_STATE_FILE = "actor_state.pt"
# Per rank: torch and megatron RNG states (nothing random runs today; kept so dropout would resume exactly).
RNG_FILE = "rng_rank{rank}.pt"


def save_checkpoint(
    path: str,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    steps: int,
    rank: int,
    layout: ParallelLayout,
    lora: LoRASettings | None = None,
) -> None:
    """Model + optimizer as a megatron dist checkpoint in `path` (empty dir), + lr schedule and step (every rank calls).

    A LoRA student's checkpoint holds its adapters and their optimizer state only: the frozen base is the HF
    student's (model.student_path), read again at start."""
    from megatron.core import dist_checkpointing

    out = Path(path)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    _in_process_write_results()
    dist_checkpointing.save(sharded_state_dict(model, optimizer, adapters_only=lora is not None), str(out))
    if rank == 0:
        state = {
            "scheduler": scheduler.state_dict(),
            "steps": steps,
            "tp": layout.tp_size,
            "pp": layout.pp_size,
            "ep": layout.ep_size,
            "lora": None if lora is None else {"rank": lora.rank, "targets": list(lora.targets)},
        }
        torch.save(state, out / ACTOR_STATE_FILE)
    torch.save(_rng_states(), out / RNG_FILE.format(rank=rank))
    dist.barrier()


def load_checkpoint(
    path: str,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    rank: int,
    distributed_optimizer: bool,
    lora: LoRASettings | None = None,
) -> int:
    """Restore what `save_checkpoint` wrote (possibly at another parallel size); returns the step count."""
    from megatron.core import dist_checkpointing

    state = torch.load(Path(path) / ACTOR_STATE_FILE, weights_only=False)
    check_same_lora(state.get("lora"), lora, path)
    init_empty_optimizer_state(optimizer, distributed_optimizer)
    loaded = dist_checkpointing.load(
        sharded_state_dict(model, optimizer, is_loading=True, adapters_only=lora is not None), path
    )
    _load_model_state(model.module, loaded["model"], adapters_only=lora is not None)
    optimizer.load_state_dict(loaded["optimizer"])
    _unshare_adam_steps(optimizer)
    # fp32 main params (bf16 training) are the optimizer's copy: refresh them from the model.
    optimizer.reload_model_params()
    scheduler.load_state_dict(state["scheduler"])
    rng = Path(path) / RNG_FILE.format(rank=rank)
    if rng.is_file():  # absent when this rank did not exist at save time (a larger world)
        _set_rng_states(torch.load(rng, weights_only=False))
    dist.barrier()
    return int(state["steps"])


def init_empty_optimizer_state(optimizer: Any, distributed_optimizer: bool) -> None:
    """Give a distributed optimizer that has not stepped yet its Adam state, to be overwritten by the load.

    megatron-core 0.16.1's DistributedOptimizer.state_dict() (optimizer/distrib_optimizer.py)
    reads every parameter's Adam `step` when neither Apex nor Transformer Engine provides the
    fused Adam, so loading into a fresh one fails; its own
    `_init_optimizer_states_with_dummy_values` (one step with zero gradients, used by megatron
    for the FSDP format) creates the state. The main params it touches are reloaded from the
    model after the load (`reload_model_params`).
    """
    if not distributed_optimizer:
        return
    for leaf in leaf_optimizers(optimizer):
        if not leaf.optimizer.state:
            leaf._init_optimizer_states_with_dummy_values()
        _keep_adam_step_on_reshardable_load(leaf)


def check_same_lora(saved: dict[str, Any] | None, lora: LoRASettings | None, path: str) -> None:
    """A checkpoint resumes into the same kind of student: a LoRA one with the same rank and targets."""
    now = None if lora is None else {"rank": lora.rank, "targets": list(lora.targets)}
    if saved != now:
        raise ConfigError(
            "actor.lora.rank",
            f"checkpoint {path} was saved with adapters {saved or 'none (the whole student trained)'}, this run has "
            f"{now or 'none (actor.lora.rank=0)'}: resume with the checkpoint's actor.lora settings",
        )


def _load_model_state(module: torch.nn.Module, state: dict[str, Any], adapters_only: bool) -> None:
    """The loaded tensors into the model: all of them, or (a LoRA checkpoint) every adapter and nothing else."""
    if not adapters_only:
        module.load_state_dict(state, strict=True)
        return
    result = module.load_state_dict(state, strict=False)
    missing = [name for name in result.missing_keys if is_adapter(name)]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"LoRA checkpoint: adapters missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}")


def sharded_state_dict(
    model: Any, optimizer: Any, is_loading: bool = False, adapters_only: bool = False
) -> dict[str, Any]:
    """The model's and the optimizer's sharded state dicts, as dist_checkpointing saves and loads them
    (`adapters_only`: a LoRA student's adapters, its frozen base left out)."""
    model_sd = model.module.sharded_state_dict()
    if adapters_only:
        model_sd = {key: value for key, value in model_sd.items() if is_adapter(key)}
    # The distributed optimizer's default format (fully_sharded_model_space) is refused by
    # megatron-core 0.16.1's own checkpointing (flattened ranges); fully_reshardable gathers its
    # shards into per-parameter tensors, so a checkpoint loads at another TP / PP / DP size.
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    optimizer_sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return {"model": model_sd, "optimizer": optimizer_sd}


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
    for leaf in leaf_optimizers(optimizer):
        for state in leaf.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
