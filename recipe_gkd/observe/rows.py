"""The rows the loop logs: one metrics.jsonl row per step, one eval.jsonl row per evaluation.

Each column's meaning is said where it is built; the loop (recipe_gkd/gkd.py) hands over what a step produced
(the rollout workers' RolloutStats, the actor's statistics, the weight sync's timings) and logs the row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from recipe_gkd.batch import RolloutStats, actor_rank_of
from recipe_gkd.config import Divergence, GKDConfig
from recipe_gkd.config.teachers import TeacherHandle, split_teachers, teacher_handles
from recipe_gkd.observe.metrics import alignment_columns, episode_columns, teacher_columns
from recipe_gkd.pools import Pools, ShardHandle
from recipe_gkd.process_memory import process_memory_mb
from recipe_gkd.targets import Target

# The actor's statistics of the sampled-token objective (algorithm.divergence=sampled_reverse_kl).
POLICY_KEYS = ("advantage_mean", "ratio_mean", "ratio_min", "ratio_max", "ratio_clipped_frac")
# The actor's statistics of a mixture of experts' routers (recipe_gkd/actor/moe_stats.py RouterWatch).
MOE_PREFIX = "moe_"
# Per-worker memory keys (debug.log_memory), e.g. actor1_rss_mb, rollout0_gpu_peak_mb.
MEMORY_SUFFIXES = ("_rss_mb", "_gpu_peak_mb")


def step_row(
    cfg: GKDConfig,
    target: Target,
    step: int,
    version: int,
    stats: list[RolloutStats],
    rollout_wait_s: float,
    train: dict[str, float],
    sync: dict[str, float],
    step_s: float,
) -> dict[str, Any]:
    """The metrics.jsonl row of one step (`stats`: every rollout worker's of the batch it trained on)."""
    sampled_with = min(s.weight_version for s in stats)
    handles = teacher_handles(cfg)
    return {
        "step": step + 1,
        "batch": stats[0].step,
        "loss": train["loss"],
        "divergence": cfg.algorithm.divergence.value,
        # The loss is KL(teacher || student) itself when training with forward KL.
        "teacher_kl": train["loss"] if cfg.algorithm.divergence.value == "forward_kl" else None,
        "weight_version": version,
        "staleness": (version - 1) - sampled_with,
        # Task reward of the student's own samples; dataset responses (lmbda < 1) apart.
        "reward": ratio(stats, "onpolicy_reward_sum", "onpolicy_rewarded"),
        "offpolicy_reward": ratio(stats, "offpolicy_reward_sum", "offpolicy_rewarded"),
        "response_tokens": sum(s.num_response_tokens for s in stats),
        "sequences": sum(s.num_sequences for s in stats),
        # Mean tokens the student sampled per response (a conversation's every turn; tool tokens apart).
        "response_length": ratio(stats, "num_response_tokens", "num_sequences"),
        # The share of the student's responses (turns, in conversations) the length limit cut before any stop id.
        "response_clipped_frac": ratio(stats, "clipped_turns", "sampled_turns"),
        # None where no top-k over the student's vocabulary travels (the target kind says: teacher.top_k=0, hidden
        # states, spans across tokenizers).
        "teacher_topk_mass": (
            ratio(stats, "teacher_topk_mass_sum", "num_response_tokens") if target.sends_topk() else None
        ),
        # None where the replies carry no sampled token's logprob (hidden states only: the loss is exact).
        "teacher_sampled_logprob": (
            ratio(stats, "teacher_sampled_logprob_sum", "onpolicy_tokens") if target.sends_logprobs() else None
        ),
        "sampled_reverse_kl": sampled_reverse_kl(cfg, stats) if target.sends_logprobs() else None,
        # algorithm.divergence=sampled_reverse_kl: token means of A = log t - log s_old and of s_theta / s_old.
        **{key: train.get(key) for key in POLICY_KEYS},
        "teacher_ids_folded": train.get("teacher_ids_folded"),
        "grad_norm": train.get("grad_norm"),
        "lr": train.get("lr"),
        "generate_s": max(s.timings["generate_s"] for s in stats),
        "teacher_s": max(s.timings["teacher_s"] for s in stats),
        "rollout_wait_s": rollout_wait_s,
        "train_s": train["train_s"],
        "sync_s": sync["sync_export_s"] + sync["sync_load_s"],
        # The actor's export (object store: up to every bucket put) and the engines' receive and in-place load.
        "sync_export_s": sync["sync_export_s"],
        "sync_load_s": sync["sync_load_s"],
        # One weight version's bytes as it travels to each engine (a LoRA student's: the adapter alone).
        "sync_bytes": sync.get("sync_bytes"),
        # Mean |token logprob difference| engine vs actor on the sync probe, on the steps that check it.
        "sync_logprob_diff": sync.get("sync_logprob_diff"),
        # How far the actor's own probe logprobs moved since the previous check (the probe's power: a shift below the
        # tolerance means the probe alone could not tell these weights from the previous ones), and how many of the
        # actor's tensors the engines' checksums were compared with (weight_sync.SyncCheck).
        "sync_probe_shift": sync.get("sync_probe_shift"),
        "sync_tensors_checked": sync.get("sync_tensors_checked"),
        "sync_check_s": sync.get("sync_check_s"),
        "step_s": step_s,
        **teacher_columns(stats, handles.values(), ""),
        **teacher_loss_columns(cfg, train),
        # A mixture-of-experts student: per-expert load, the most and least loaded (layer, expert) against uniform,
        # the router's entropy (recipe_gkd/actor/moe_stats.py); absent for a dense student.
        **{key: value for key, value in train.items() if key.startswith(MOE_PREFIX)},
        **alignment_columns(stats),
        **episode_columns(stats, ""),
        "sample_ids": sorted(i for s in stats for i in s.sample_ids),
        # Several teachers: the teacher that scored each of sample_ids (same order).
        **sample_teachers(handles, stats),
    }


def eval_row(
    cfg: GKDConfig, step: int, loss: dict[str, float], stats: list[RolloutStats], seconds: float
) -> dict[str, Any]:
    """The eval.jsonl row of one evaluation (`loss`: the actor's eval_loss over the held-out responses)."""
    return {
        "step": step,
        # KL(teacher || student) over the K + 1 outcomes (top-k + tail), whatever the training
        # divergence: a lower bound of the full-vocabulary KL (merging outcomes never raises a KL).
        "eval_teacher_kl": loss["forward_kl"],
        "eval_divergence": loss["loss"],
        "eval_reward": ratio(stats, "onpolicy_reward_sum", "onpolicy_rewarded"),
        # Records with an answer (the accuracy counts those only) among the eval_sequences evaluated.
        "eval_answered": sum(s.onpolicy_rewarded for s in stats),
        "eval_sequences": sum(s.num_sequences for s in stats),
        # Per evaluation: greedy generation by the rollout engine, teacher scoring (slowest worker), all of it.
        "eval_generate_s": max(s.timings["generate_s"] for s in stats),
        "eval_teacher_s": max(s.timings["teacher_s"] for s in stats),
        **teacher_columns(stats, teacher_handles(cfg).values(), "eval_"),
        **episode_columns(stats, "eval_"),
        "eval_s": seconds,
    }


def eval_teacher_kls(
    cfg: GKDConfig, pools: Pools, results: list[Any], shards: list[list[ShardHandle]]
) -> dict[str, float | None]:
    """Several teachers: eval_teacher_NAME_kl, KL(teacher || student) over the held-out sequences teacher NAME
    scored (one more forward pass per teacher). None where some actor rank holds none of them."""
    split = [h for h in teacher_handles(cfg).values() if h.metric_prefix is not None]
    if not split or not cfg.teacher.top_k:
        return {}
    dp = pools.actor.dp_size
    held: dict[str, set[int]] = {}  # teacher -> the actor ranks holding some of its sequences
    for worker, (stats, _) in enumerate(results):
        for j, name in enumerate(stats.sample_teachers):
            held.setdefault(name, set()).add(actor_rank_of(worker, len(stats.sample_teachers), j, dp))
    return {
        f"eval_{h.metric_prefix}kl": pools.actor.eval_loss(shards, h.name)["forward_kl"]
        if len(held.get(h.name, ())) == dp
        else None
        for h in split
    }


def teacher_loss_columns(cfg: GKDConfig, train: dict[str, Any]) -> dict[str, float | None]:
    """Several teachers: the actor's teacher_<name>_loss (the objective over that teacher's tokens) and, training
    with forward KL, teacher_<name>_kl, the same figure (as teacher_kl is the loss); None for a teacher absent
    from the step's batch."""
    columns: dict[str, float | None] = {}
    handles = teacher_handles(cfg)
    for name in split_teachers(cfg):  # sorted by name, as before
        head = handles[name].metric_prefix
        loss = train.get(f"{head}loss")
        columns[f"{head}loss"] = loss
        columns[f"{head}kl"] = loss if cfg.algorithm.divergence == Divergence.forward_kl else None
    return columns


def sample_teachers(handles: dict[str, TeacherHandle], stats: Sequence[RolloutStats]) -> dict[str, list[str]]:
    """{"sample_teachers": the teacher of each sorted sample id} when the step's teachers have names in the rows
    (configured under `teachers:`), else {}."""
    pairs = sorted((i, t) for s in stats for i, t in zip(s.sample_ids, s.sample_teachers, strict=True))
    if all(handles[t].row_name is None for _, t in pairs):
        return {}
    return {"sample_teachers": [t for _, t in pairs]}


def memory_row(stats: list[RolloutStats], train: dict[str, float]) -> dict[str, float]:
    """debug.log_memory: resident (and peak GPU) MiB of the driver and of every worker."""
    row = {"driver_rss_mb": process_memory_mb()}
    for s in stats:
        row.update(s.memory_mb)
    row.update({k: v for k, v in train.items() if k.endswith(MEMORY_SUFFIXES)})
    return row


def sampled_reverse_kl(cfg: GKDConfig, stats: list[RolloutStats]) -> float | None:
    """Monte Carlo estimate of the full-vocabulary KL(student || teacher) on the step's samples.

    mean(log s(x) - log t(x)) over on-policy tokens is unbiased only when x was drawn from s
    itself (rollout temperature 1, no top-p/top-k) and both sides are at temperature 1; else None.
    Unlike the loss (K + 1 outcomes) it sees the whole vocabulary.
    """
    s = cfg.rollout.sampling
    if s.temperature != 1.0 or s.top_p != 1.0 or s.top_k != 0 or cfg.algorithm.temperature != 1.0:
        return None
    student = ratio(stats, "rollout_logprob_sum", "onpolicy_tokens")
    teacher = ratio(stats, "teacher_sampled_logprob_sum", "onpolicy_tokens")
    return None if student is None or teacher is None else student - teacher


def ratio(stats: Sequence[RolloutStats], numerator: str, denominator: str) -> float | None:
    """sum(numerator) / sum(denominator) over the rollout workers; None when nothing was counted."""
    total = sum(getattr(s, denominator) for s in stats)
    return sum(getattr(s, numerator) for s in stats) / total if total else None
