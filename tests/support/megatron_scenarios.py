"""Runs MegatronActor scenarios in one rank process (launched by test_megatron_actor.py).

    python tests/support/megatron_scenarios.py --rank R --world W --workdir D \
        --models M --ports P1,P2,... --jobs job1,job2,... [--device cpu|cuda]

Each actor gets a fresh process group on the next port of --ports (every rank takes them in
the same order). Each job builds its actors from the HF models under M, runs, and rank 0 writes
`D/<job>.npz`. Megatron runs in these processes only: the pytest process never imports it,
so its CUDA compat patches and process groups never leak into other tests.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from recipe_gkd.batch import FOLDED_BASE, ScoredSequence, TrainShard
from recipe_gkd.config import (
    Attention,
    CrossTokenizer,
    Device,
    Divergence,
    GKDConfig,
    Precision,
    Recompute,
    TeacherOutput,
)
from recipe_gkd.targets import actor_kinds
from recipe_gkd.targets.hidden import HiddenStates
from recipe_gkd.targets.spans import Spans
from teacher_server.wire.protocol import scores_from_logprobs

GLOBAL_BATCH = 8
TOP_K = 8
PROBE_SHAPE = (3, 12)
SAMPLER_SALT = 0x5A
# What train_step reports for algorithm.divergence=sampled_reverse_kl (recipe_gkd.observe.rows.POLICY_KEYS).
# Not whole minutes: megatron's groups take minutes (rounded up), the world group seconds.
SETUP_TIMEOUT_S = 3630.0
POLICY_KEYS = ("advantage_mean", "ratio_mean", "ratio_min", "ratio_max", "ratio_clipped_frac")


# ----------------------------------------------------------------------------- data


def make_sequences(seed: int, count: int, vocab: int, top_k: int = TOP_K) -> list[ScoredSequence]:
    """Random prompt+response sequences with a random teacher's exact top-k log-probs."""
    rng = np.random.default_rng(seed)
    sequences = []
    for i in range(count):
        length = int(rng.integers(6, 24))
        response_start = int(rng.integers(1, length))
        ids = rng.integers(0, vocab, length).astype(np.int32)
        logits = rng.normal(size=(length - response_start, vocab)) * 2.0
        logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        scores = scores_from_logprobs(logprobs, ids[response_start:], top_k)
        # The sampler's logprobs (sampled_reverse_kl's s_old) near a random model's -log V, from their own
        # stream so that the other arrays stay what they were.
        stale = np.random.default_rng([seed, i, SAMPLER_SALT]).normal(size=length - response_start) * 0.3
        sequences.append(
            ScoredSequence(
                sample_id=i,
                input_ids=ids,
                response_start=response_start,
                on_policy=True,
                teacher_topk_logprobs=scores.topk_logprobs,
                teacher_topk_ids=scores.topk_ids,
                teacher_tail_logmass=scores.tail_logmass,
                teacher_sampled_logprob=scores.sampled_logprob,
                rollout_logprobs=(stale - np.log(vocab)).astype(np.float32),
            )
        )
    return sequences


def make_masked_sequences(seed: int, count: int, vocab: int, other: bool = False) -> list[ScoredSequence]:
    """make_sequences as multi-turn rollouts hand them on: in every response of 3+ tokens a run the student did not
    sample (a tool's output; ScoredSequence.sampled_mask) whose rollout logprob is the placeholder 0.0. `other`: the same
    batch with other values at those rows (rollout and teacher logprobs, teacher top-k rows and tail)."""
    rng = np.random.default_rng([seed, 0x7001])
    sequences = make_sequences(seed, count, vocab)
    for seq in sequences:
        n = seq.num_response_tokens
        mask = np.ones(n, dtype=bool)
        if n >= 3:
            start = int(rng.integers(1, n - 1))
            mask[start : int(rng.integers(start + 1, n))] = False
        seq.sampled_mask = mask
        off, k = ~mask, int((~mask).sum())
        assert seq.rollout_logprobs is not None
        seq.rollout_logprobs[off] = 0.0
        if other:
            values = np.random.default_rng([seed, 0x7002, seq.sample_id])
            seq.rollout_logprobs[off] = -values.exponential(2.0, k)
            seq.teacher_sampled_logprob[off] = -values.exponential(2.0, k)
            seq.teacher_topk_logprobs[off] = np.sort(-values.exponential(3.0, seq.teacher_topk_logprobs[off].shape))
            seq.teacher_topk_logprobs[off] = seq.teacher_topk_logprobs[off][:, ::-1]
            seq.teacher_topk_ids[off] = values.permutation(vocab)[: seq.teacher_topk_ids.shape[1]]
            seq.teacher_tail_logmass[off] = -values.exponential(0.5, k)
    return sequences


def make_xtok_sequences(seed: int, count: int, vocab: int, top_k: int = TOP_K) -> list[ScoredSequence]:
    """make_sequences shaped as a cross-tokenizer scorer maps its reply (recipe_gkd/cross_tokenizer/span_scores.py).

    Per response: spans of 1-3 student tokens tiling it but for an unaligned tail (span_len -1); a multi-token
    span's first position carries the teacher's log-probability of its text (teacher_sampled_logprob); one-token
    spans keep the top-k, some with pieces the student lacks (FOLDED_BASE + column) and some with none shared.
    """
    rng = np.random.default_rng([seed, 0x38B])
    sequences = make_sequences(seed, count, vocab, top_k)
    for seq in sequences:
        n = seq.num_response_tokens
        span_len = np.full(n, -1, dtype=np.int32)
        t = 0
        while t < n - 1:  # the last token stays unaligned (a truncated character)
            length = min(int(rng.choice([1, 1, 2, 3])), n - 1 - t)
            span_len[t : t + length] = 0
            span_len[t] = length
            if length > 1:
                seq.teacher_sampled_logprob[t] = -rng.uniform(0.2, 4.0)
            elif rng.random() < 0.5:  # fold some pieces (all of them: a one-token span with nothing shared)
                folded = rng.random(top_k) < (1.0 if rng.random() < 0.3 else 0.4)
                seq.teacher_topk_ids[t] = np.where(folded, FOLDED_BASE + np.arange(top_k), seq.teacher_topk_ids[t])
            t += length
        seq.payload = Spans(span_len)
    return sequences


def make_hidden_sequences(seed: int, count: int, vocab: int, hidden_size: int) -> list[ScoredSequence]:
    """make_sequences with the teacher's final hidden states (teacher.output=hidden) as the worker hands them on:
    random states rounded to the wire's bfloat16, in its 16 bits."""
    from teacher_server.wire import hidden_codec

    sequences = make_sequences(seed, count, vocab)
    rng = np.random.default_rng([seed, 0x41D])
    for seq in sequences:
        raw = (rng.standard_normal((seq.num_response_tokens, hidden_size)) * 2).astype(np.float32)
        seq.payload = HiddenStates.from_float32(hidden_codec.round_to(raw, "bfloat16"), "bfloat16")
    return sequences


def rank_shards(
    seed: int, vocab: int, dp_rank: int, dp_size: int, make: Callable[..., list[ScoredSequence]] = make_sequences
) -> list[TrainShard]:
    """This data-parallel rank's part of a GLOBAL_BATCH batch, as two shards (two rollout workers)."""
    sequences = make(seed, GLOBAL_BATCH, vocab)
    per_rank = GLOBAL_BATCH // dp_size
    mine = sequences[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    half = len(mine) // 2
    return [TrainShard(step=seed, weight_version=0, sequences=mine[:half]), TrainShard(seed, 0, mine[half:])]


def probe_ids(vocab: int) -> np.ndarray:
    return np.random.default_rng(123).integers(0, vocab, PROBE_SHAPE).astype(np.int64)


# ----------------------------------------------------------------------------- jobs


def make_cfg(model_dir: str, world: int, device: str, **actor: Any) -> GKDConfig:
    cfg = GKDConfig()
    cfg.cluster.device = Device(device)
    cfg.model.student_path = model_dir
    cfg.actor.gpus_per_node = world
    cfg.debug.setup_timeout_s = SETUP_TIMEOUT_S
    cfg.actor.megatron.tp = actor.pop("tp", 1)
    cfg.actor.megatron.pp = actor.pop("pp", 1)
    cfg.actor.megatron.ep = actor.pop("ep", 1)
    cfg.actor.megatron.cp = actor.pop("cp", 1)
    cfg.actor.moe.aux_loss_coeff = actor.pop("aux_loss_coeff", 0.0)
    cfg.actor.micro_batch_size = actor.pop("micro_batch_size", 4)
    cfg.actor.precision = Precision(actor.pop("precision", "fp32"))
    cfg.actor.max_tokens_per_micro_batch = actor.pop("max_tokens_per_micro_batch", 0)
    cfg.algorithm.divergence = Divergence(actor.pop("divergence", "forward_kl"))
    cfg.algorithm.ratio_clip = actor.pop("ratio_clip", 0.0)
    cfg.algorithm.cross_tokenizer = CrossTokenizer(actor.pop("cross_tokenizer", "none"))
    cfg.actor.lora.rank = actor.pop("lora_rank", 0)
    cfg.actor.lora.alpha = actor.pop("lora_alpha", 32.0)
    cfg.actor.lora.dropout = actor.pop("lora_dropout", 0.0)
    m = cfg.actor.megatron
    m.distributed_optimizer = actor.pop("distributed_optimizer", False)
    m.recompute = Recompute(actor.pop("recompute", "none"))
    m.attention = Attention(actor.pop("attention", "sdpa"))
    for key, value in actor.items():
        setattr(cfg.actor.optim, key, value)
    return cfg


class Job:
    def __init__(self, args: argparse.Namespace, ports: Iterator[int], name: str) -> None:
        self.args, self.ports, self.name = args, ports, name
        self.out: dict[str, np.ndarray] = {}

    def actor(self, model: str, **actor: Any) -> Any:
        from recipe_gkd.actor.megatron_actor import MegatronActor

        teacher = actor.pop("teacher_model", "")
        cfg = make_cfg(str(Path(self.args.models) / model), self.args.world, self.args.device, **actor)
        if teacher:  # teacher.output=hidden with that model's head
            cfg.teacher.output = TeacherOutput.hidden
            cfg.teacher.model_path = str(Path(self.args.models) / teacher)
        a = MegatronActor(cfg, self.args.rank, self.args.world, "127.0.0.1", next(self.ports), actor_kinds(cfg))
        info = a.setup()
        self.out["info"] = np.array(json.dumps(info))
        self.out["group_timeouts_s"] = np.array(json.dumps(group_timeouts_s(a)))
        return a

    def export(self, a: Any, prefix: str) -> None:
        state = a.export_hf_state_dict()
        if state is not None:
            self.out.update({f"{prefix}/{k}": v for k, v in state.items()})

    def shards(self, a: Any, seed: int, vocab: int) -> list[TrainShard]:
        xtok = a.cfg.algorithm.cross_tokenizer != CrossTokenizer.none
        make = make_xtok_sequences if xtok else make_sequences
        return rank_shards(seed, vocab, a.layout.dp_rank, a.layout.dp_size, make)

    def train(self, a: Any, seeds: list[int], vocab: int) -> None:
        stats = [a.train_step(self.shards(a, s, vocab)) for s in seeds]
        for key in ("loss", "grad_norm", "lr", "num_tokens", *POLICY_KEYS):
            if key in stats[0]:
                self.out[key] = np.array([s[key] for s in stats])
        self.out["optimizer_state_numel"] = np.array(optimizer_state_numel(a.optimizer))

    def save(self) -> None:
        if self.args.rank == 0:
            np.savez(Path(self.args.workdir) / f"{self.name}.npz", **self.out)


def group_timeouts_s(a: Any) -> dict[str, float]:
    """The timeout of the world group and of each megatron group this rank holds (gloo's own option)."""
    import torch.distributed as dist

    groups = {"world": dist.group.WORLD, "tp": a.tp_group, "dp": a.dp_group, "pp": a.pp_group, "mp": a.mp_group}
    return {name: g._get_backend(a.device).options._timeout.total_seconds() for name, g in groups.items()}


def optimizer_state_numel(optimizer: Any) -> int:
    """Elements of this rank's Adam state (moments, and fp32 master weights when bf16): what sharding shrinks."""
    import torch

    total = 0
    for leaf in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in leaf.optimizer.state.values():
            total += sum(t.numel() for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
    return total


def _logits_job(parallel: str) -> Callable[[Job], None]:
    """Per model variant: logits and the untouched export (HF -> mcore -> HF), `parallel` ("tp"/"pp") = world."""

    def run(job: Job) -> None:
        for model in ("llama_tied", "llama_untied", "qwen2_bias", "qwen3_qknorm", "llama3_rope", "mistral"):
            a = job.actor(model, **{parallel: job.args.world})
            vocab = a.arch.vocab_size
            job.out[f"{model}/logits"] = a.forward_logits(probe_ids(vocab))
            job.export(a, f"{model}/export")
            a.shutdown()

    return run


def _train_job(model: str, seeds: list[int], **actor: Any) -> Callable[[Job], None]:
    def run(job: Job) -> None:
        a = job.actor(model, **actor)
        vocab = a.arch.vocab_size
        job.export(a, "before")
        job.train(a, seeds, vocab)
        job.export(a, "after")
        job.out["eval"] = np.array(json.dumps(a.eval_loss(job.shards(a, 99, vocab))))
        mask = np.ones(PROBE_SHAPE, dtype=bool)
        mask[0, :3] = False  # left padding on row 0
        mask[1, -2:] = False  # right padding on row 1
        job.out["probe_ids"] = probe_ids(vocab)
        job.out["probe_mask"] = mask
        job.out["probe_logprobs"] = a.token_logprobs(probe_ids(vocab), mask)
        a.shutdown()

    return run


def _masked_job(job: Job) -> None:
    """Multi-turn batches (tokens the student did not sample), sampled_reverse_kl: one step from the same weights on
    the batch with placeholders at the unsampled rows (`placeholder_*`) and on the one with other values (`other_*`)."""
    for prefix, other in (("placeholder", False), ("other", True)):
        a = job.actor("llama_untied_odd", micro_batch_size=3, lr=1e-3, **SAMPLED)
        vocab = a.arch.vocab_size

        def make(seed: int, count: int, vocab: int, other: bool = other) -> list[ScoredSequence]:
            return make_masked_sequences(seed, count, vocab, other)

        shards = rank_shards(1, vocab, a.layout.dp_rank, a.layout.dp_size, make)
        stats = a.train_step(shards)
        for key in ("loss", "grad_norm", "num_tokens", *POLICY_KEYS):
            job.out[f"{prefix}_{key}"] = np.array(stats[key])
        job.out[f"{prefix}_eval"] = np.array(json.dumps(a.eval_loss(shards)))
        job.export(a, f"{prefix}_after")
        a.shutdown()


def _hidden_job(job: Job) -> None:
    """teacher.output=hidden, 4 micro-batches of 2: one step's loss, and the bytes of the micro-batches' teacher
    states alive whenever the loss runs (each micro-batch's tensor tracked from its collation until it is freed)."""
    import weakref

    from recipe_gkd.actor import collate as collate_module

    live: dict[int, int] = {}
    shapes: list[tuple[int, ...]] = []
    collate = collate_module.collate

    def tracked(*args: Any, **kwargs: Any) -> Any:
        micro = collate(*args, **kwargs)
        states = micro.payload
        live[id(states)] = states.numel() * states.element_size()
        shapes.append(tuple(states.shape))
        weakref.finalize(states, live.pop, id(states), None)
        return micro

    collate_module.collate = tracked
    a = job.actor("llama_tied", micro_batch_size=2, teacher_model="llama_untied", **NO_CLIP)
    peaks: list[int] = []
    loss_sum = a.objective.target.loss_sum

    def measured(*args: Any, **kwargs: Any) -> Any:
        peaks.append(sum(live.values()))
        return loss_sum(*args, **kwargs)

    a.objective.target.loss_sum = measured
    hidden_size = a.objective.target.head_vH.shape[1]
    sequences = make_hidden_sequences(7, GLOBAL_BATCH, a.arch.vocab_size, hidden_size)
    job.out["loss"] = np.array([a.train_step([TrainShard(step=7, weight_version=0, sequences=sequences)])["loss"]])
    job.out["live_bytes_at_loss"] = np.array(peaks)
    job.out["micro_batch_shapes"] = np.array(shapes)
    collate_module.collate = collate
    a.shutdown()


def _save_job(model: str, **actor: Any) -> Callable[[Job], None]:
    def run(job: Job) -> None:
        a = job.actor(model, **actor)
        a.train_step(rank_shards(5, a.arch.vocab_size, a.layout.dp_rank, a.layout.dp_size))
        a.save_hf(str(Path(job.args.workdir) / f"{job.name}_hf"))
        job.out["probe_logprobs"] = a.token_logprobs(probe_ids(a.arch.vocab_size))
        a.shutdown()

    return run


def local_grads(a: Any) -> dict[str, np.ndarray]:
    """This rank's gradients (megatron's main_grad: d(global token-mean loss), before the optimizer) under their
    global megatron names (experts under their global number, layers over all stages)."""
    out = {}
    for local, param in a.gpt.named_parameters():
        grad = getattr(param, "main_grad", None)
        if grad is not None:
            out[a._global_names[local]] = grad.detach().float().cpu().numpy().copy()
    return out


def _step_pair_job(model: str, *, save: bool = False, resume: bool = False, **actor: Any) -> Callable[[Job], None]:
    """Two steps at `ep` (default: every rank of the world, one expert-parallel group; a dense model passes ep=1
    and its own split): the probe's
    logits and the untouched export, then two steps, each rank's gradients of the first, the exported weights,
    the router's statistics; `save`: a checkpoint after the first step (at workdir/<job>_ckpt) and an HF directory;
    `resume`: loads `actor['from']`'s checkpoint first and runs only the second step."""

    def run(job: Job) -> None:
        ckpt_from = actor.pop("from", None)
        a = job.actor(model, **{"ep": job.args.world, **actor})
        vocab = a.arch.vocab_size
        job.out["logits"] = a.forward_logits(probe_ids(vocab))
        if resume:
            a.load_checkpoint(str(Path(job.args.workdir).parent / ckpt_from))
            job.out["resumed_logprobs"] = a.token_logprobs(probe_ids(vocab))
        else:
            job.export(a, "before")
            first = a.train_step(job.shards(a, 1, vocab))
            job.out["first_loss"] = np.array(first["loss"])
            job.out["first_grad_norm"] = np.array(first["grad_norm"])
            job.out["router_stats"] = np.array(json.dumps({k: v for k, v in first.items() if k.startswith("moe_")}))
            grads = local_grads(a)
            np.savez(Path(job.args.workdir) / f"{job.name}_grads_rank{job.args.rank}.npz", **grads)
            if save:
                a.save_checkpoint(str(Path(job.args.workdir) / f"{job.name}_ckpt"))
                a.save_hf(str(Path(job.args.workdir) / f"{job.name}_hf"))
                job.out["saved_logprobs"] = a.token_logprobs(probe_ids(vocab))
        second = a.train_step(job.shards(a, 2, vocab))
        job.out["second_loss"] = np.array(second["loss"])
        job.export(a, "after")
        a.shutdown()

    return run


def _moe_shims_job(job: Job) -> None:
    """Each of recipe_gkd/actor/cpu_compat.py's three MoE shims undone in turn (the rest kept): an EP = world forward
    of the MoE model fails with that shim's error (recorded), then passes with all three."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    from recipe_gkd.actor import cpu_compat
    from recipe_gkd.actor.megatron_actor import MegatronActor

    cpu_compat.enable_cpu_compat()
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher

    def tensors_kept(self: Any, point: str, tokens_per_expert: Any = None) -> Any:
        return tokens_per_expert  # megatron's maybe_move_tensor_to_cpu on CPU: the split sizes stay tensors

    undo = {
        "side_stream": (dispatcher, "cuda_dtoh_stream", None),
        "split_sizes": (dispatcher, "_maybe_dtoh_and_synchronize", tensors_kept),
        "router_gemm": (moe_utils, "te_general_gemm", "absent"),
    }
    errors = {}
    for shim, (owner, attribute, value) in undo.items():
        kept = getattr(owner, attribute)
        if value == "absent":
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, value)
        cfg = make_cfg(str(Path(job.args.models) / "qwen3_moe"), job.args.world, job.args.device, ep=job.args.world)
        a = MegatronActor(cfg, job.args.rank, job.args.world, "127.0.0.1", next(job.ports), actor_kinds(cfg))
        try:
            a.setup()
            a.forward_logits(probe_ids(a.arch.vocab_size))
            errors[shim] = ""
        except Exception as err:  # what the shim prevents, recorded for the test  # noqa: BLE001
            errors[shim] = f"{type(err).__name__}: {err}"
        finally:
            a.shutdown()
            setattr(owner, attribute, kept)
    job.out["errors"] = np.array(json.dumps(errors))
    a = job.actor("qwen3_moe", ep=job.args.world)
    job.out["logits"] = a.forward_logits(probe_ids(a.arch.vocab_size))
    a.shutdown()


def _cp_job(model: str, make: Callable[..., list[ScoredSequence]] | None = None, **actor: Any) -> Callable[[Job], None]:
    """Context parallelism at cp = the world (cp = 1 on one rank): one step's loss, grad norm and gradients (the
    whole ones on every CP rank after megatron's reduction over data x context parallel), policy statistics, the
    eval losses, the probe's logits and masked token logprobs, the weights after the step."""

    def run(job: Job) -> None:
        a = job.actor(model, **{"cp": job.args.world, **actor})
        vocab = a.arch.vocab_size
        if make is not None:
            shards = rank_shards(1, vocab, a.layout.dp_rank, a.layout.dp_size, make)
        elif a.cfg.teacher.output == TeacherOutput.hidden:
            hidden = a.objective.target.head_vH.shape[1]
            sequences = make_hidden_sequences(7, GLOBAL_BATCH, vocab, hidden)
            shards = [TrainShard(step=7, weight_version=0, sequences=sequences)]
        else:
            shards = job.shards(a, 1, vocab)
        job.out["logits"] = a.forward_logits(probe_ids(vocab))
        mask = np.ones(PROBE_SHAPE, dtype=bool)
        mask[0, :3] = False
        job.out["probe_logprobs"] = a.token_logprobs(probe_ids(vocab), mask)
        stats = a.train_step(shards)
        for key in ("loss", "grad_norm", "num_tokens", *POLICY_KEYS):
            if key in stats:
                job.out[key] = np.array(stats[key])
        np.savez(Path(job.args.workdir) / f"{job.name}_grads_rank{job.args.rank}.npz", **local_grads(a))
        job.out["eval"] = np.array(json.dumps(a.eval_loss(shards)))
        job.export(a, "after")
        a.shutdown()

    return run


def adapter_grads(a: Any) -> dict[str, np.ndarray]:
    """This rank's adapter gradients (megatron's main_grad) under their global megatron names (layers over all
    stages)."""
    from recipe_gkd.actor import hf_convert
    from recipe_gkd.actor.lora import is_adapter

    first = hf_convert.stage_layers(a.arch, a.layout.pp_rank, a.layout.pp_size).start
    out = {}
    for local, param in a.gpt.named_parameters():
        if is_adapter(local):
            name = hf_convert.MCORE_LAYER.format(i=hf_convert.layer_index(local) + first) + local.split(".", 3)[3]
            out[name] = param.main_grad.detach().float().cpu().numpy().copy()
    return out


def frozen_report(a: Any) -> dict[str, Any]:
    """What trains on this rank: base parameters that require or hold a gradient (none may), the adapters'
    element count and the optimizer's state elements."""
    from recipe_gkd.actor.lora import is_adapter

    params = dict(a.gpt.named_parameters())
    base = {n: p for n, p in params.items() if not is_adapter(n)}
    return {
        "base_with_grad": [
            n for n, p in base.items() if p.requires_grad or p.grad is not None or hasattr(p, "main_grad")
        ],
        "base_numel": sum(p.numel() for p in base.values()),
        "adapter_numel": sum(p.numel() for n, p in params.items() if is_adapter(n)),
        "optimizer_state_numel": optimizer_state_numel(a.optimizer),
    }


def _lora_job(model: str, *, save: bool = False, resume: bool = False, **actor: Any) -> Callable[[Job], None]:
    """A LoRA student (tests/recipe_gkd/actor/test_lora_actor.py): the probe's logits at step 0, two steps (each
    rank's adapter gradients of each, what trains), the logits after, the adapter in its sync form, the PEFT
    directory and the merged HF directory; `save`: a checkpoint after the first step; `resume`: loads
    `actor['from']`'s checkpoint first and runs only the second step."""

    def run(job: Job) -> None:
        import torch

        torch.manual_seed(1234)  # the adapters' dropout masks: the same stream in every job
        settings = dict(actor)
        ckpt_from = settings.pop("from", None)
        a = job.actor(model, **settings)
        vocab = a.arch.vocab_size
        job.out["logits_before"] = a.forward_logits(probe_ids(vocab))
        workdir = Path(job.args.workdir)
        if resume:
            a.load_checkpoint(str(workdir.parent / ckpt_from))
            job.out["resumed_logprobs"] = a.token_logprobs(probe_ids(vocab))
        else:
            first = a.train_step(job.shards(a, 1, vocab))
            job.out["first_loss"] = np.array(first["loss"])
            job.out["first_grad_norm"] = np.array(first["grad_norm"])
            np.savez(workdir / f"{job.name}_grads_rank{job.args.rank}.npz", **adapter_grads(a))
            (workdir / f"{job.name}_frozen_rank{job.args.rank}.json").write_text(json.dumps(frozen_report(a)))
            if save:
                a.save_checkpoint(str(workdir / f"{job.name}_ckpt"))
                job.out["saved_logprobs"] = a.token_logprobs(probe_ids(vocab))
        second = a.train_step(job.shards(a, 2, vocab))
        job.out["second_loss"] = np.array(second["loss"])
        job.out["second_grad_norm"] = np.array(second["grad_norm"])
        np.savez(workdir / f"{job.name}_grads2_rank{job.args.rank}.npz", **adapter_grads(a))
        job.out["logits_after"] = a.forward_logits(probe_ids(vocab))
        sync = {name: t.float().numpy() for name, t in a.iter_adapter_tensors(on_device=False)}
        job.out.update({f"sync/{name}": v for name, v in sync.items()})
        a.save_adapter(str(workdir / f"{job.name}_adapter"))
        a.save_hf(str(workdir / f"{job.name}_hf"))
        a.shutdown()

    return run


def _masked_sequences(seed: int, count: int, vocab: int) -> list[ScoredSequence]:
    return make_masked_sequences(seed, count, vocab, other=True)


NO_CLIP = {"clip_grad": 0.0, "lr": 1e-3}
SAMPLED = {"divergence": "sampled_reverse_kl", "ratio_clip": 0.2}
XTOK = {"cross_tokenizer": "span"}
# eps >> |grad| makes Adam's first step ~ lr * grad / eps: linear in the (clipped) gradient.
LINEAR_ADAM = {"eps": 1.0e3, "lr": 1.0e3}
# Adapters of rank 4 (scale 8 / 4), a learning rate that moves them well past the probe's tolerance in two steps.
LORA = {"lora_rank": 4, "lora_alpha": 8.0, "micro_batch_size": 4, "clip_grad": 0.0, "lr": 1e-2}
JOBS: dict[str, Callable[[Job], None]] = {
    "logits": _logits_job("tp"),
    "logits_pp": _logits_job("pp"),
    # Global-token normalization: one batch, micro-batch 8 vs 1 vs DP=2 (x micro-batch 2).
    "mb8": _train_job("llama_tied", [1], micro_batch_size=8, **NO_CLIP),
    "mb1": _train_job("llama_tied", [1], micro_batch_size=1, **NO_CLIP),
    # Micro-batches by tokens (sorted, unequal row counts) and the memory-saving settings: the same update as mb8.
    "tokens50": _train_job("llama_tied", [1], max_tokens_per_micro_batch=50, **NO_CLIP),
    "recompute_full": _train_job("llama_tied", [1], micro_batch_size=8, recompute="full", **NO_CLIP),
    "recompute_selective": _train_job(
        "llama_tied", [1], micro_batch_size=8, recompute="selective", attention="unfused", **NO_CLIP
    ),
    "unfused": _train_job("llama_tied", [1], micro_batch_size=8, attention="unfused", **NO_CLIP),
    "dp2": _train_job("llama_tied", [1], micro_batch_size=2, **NO_CLIP),
    "dp2_distopt": _train_job("llama_tied", [1], micro_batch_size=2, distributed_optimizer=True, **NO_CLIP),
    # bf16 params with fp32 master weights, sharded (the GPU presets' setting) vs replicated; three clipped steps.
    "bf16_dp2": _train_job("llama_tied", [1, 2, 3], micro_batch_size=2, precision="bf16", lr=1e-3),
    "bf16_dp2_distopt": _train_job(
        "llama_tied", [1, 2, 3], micro_batch_size=2, precision="bf16", distributed_optimizer=True, lr=1e-3
    ),
    # TP=2 vs TP=1: three steps on different batches, Adam with clipping at 1.0, warmup.
    "tp1_steps": _train_job("llama_untied_odd", [1, 2, 3], micro_batch_size=3, lr=1e-3, warmup_steps=2),
    "tp2_steps": _train_job("llama_untied_odd", [1, 2, 3], tp=2, micro_batch_size=3, lr=1e-3, warmup_steps=2),
    "tp2_tied_steps": _train_job("llama_tied", [1, 2, 3], tp=2, micro_batch_size=3, lr=1e-3),
    # PP=2 (one layer per stage, 1F1B over 2 micro-batches of unequal lengths) vs TP=1.
    "pp2_steps": _train_job("llama_untied_odd", [1, 2, 3], pp=2, micro_batch_size=3, lr=1e-3, warmup_steps=2),
    "pp2_tied_steps": _train_job("llama_tied", [1, 2, 3], pp=2, micro_batch_size=3, lr=1e-3),
    "tp2pp2_steps": _train_job("llama_untied_odd", [1, 2, 3], tp=2, pp=2, micro_batch_size=3, lr=1e-3, warmup_steps=2),
    # DP=2 x PP=2 on the tied model: the tied embedding's gradient is summed over DP and over the stages.
    "dp2pp2": _train_job("llama_tied", [1], pp=2, micro_batch_size=2, **NO_CLIP),
    "tp1_tied_steps": _train_job("llama_tied", [1, 2, 3], micro_batch_size=3, lr=1e-3),
    # Clipping: same step without and with a clip far below the gradient norm.
    "noclip": _train_job("llama_tied", [1], clip_grad=0.0, **LINEAR_ADAM),
    "clip": _train_job("llama_tied", [1], clip_grad=1.0e-3, **LINEAR_ADAM),
    "bf16": _train_job("llama_tied", [1], precision="bf16", **NO_CLIP),
    "save_tp2": _save_job("llama_untied_odd", tp=2),
    "hidden_mb2": _hidden_job,
    # Multi-turn batches: the tokens the student did not sample train nothing, whatever values they carry.
    "tp1_masked": _masked_job,
    # The sampled-token reverse KL (stale s_old, PPO clip) at TP=2 and PP=2 vs one rank.
    "tp1_sampled": _train_job("llama_untied_odd", [1, 2, 3], micro_batch_size=3, lr=1e-3, **SAMPLED),
    "tp2_sampled": _train_job("llama_untied_odd", [1, 2, 3], tp=2, micro_batch_size=3, lr=1e-3, **SAMPLED),
    "pp2_sampled": _train_job("llama_untied_odd", [1, 2, 3], pp=2, micro_batch_size=3, lr=1e-3, **SAMPLED),
    # algorithm.cross_tokenizer (spans, folded pieces) at TP=2 vs one rank: the loss over the gathered vocabulary
    # (101 padded to 102), and the sampled-token reverse KL with span advantages over the TP group.
    "tp1_xtok": _train_job("llama_untied_odd", [1, 2, 3], micro_batch_size=3, lr=1e-3, **XTOK),
    "tp2_xtok": _train_job("llama_untied_odd", [1, 2, 3], tp=2, micro_batch_size=3, lr=1e-3, **XTOK),
    "tp1_xtok_sampled": _train_job("llama_untied_odd", [1, 2, 3], micro_batch_size=3, lr=1e-3, **XTOK, **SAMPLED),
    "tp2_xtok_sampled": _train_job("llama_untied_odd", [1, 2, 3], tp=2, micro_batch_size=3, lr=1e-3, **XTOK, **SAMPLED),
    # A mixture of experts (tests/recipe_gkd/actor/test_moe_actor.py): EP = the world, or EP = 1 at DP = 2.
    "moe": _step_pair_job("qwen3_moe", micro_batch_size=2, **NO_CLIP),
    "moe_shims": _moe_shims_job,
    # Context parallelism (tests/recipe_gkd/actor/test_context_parallel_actor.py): cp = the world.
    "cp_topk": _cp_job("llama_untied_odd", micro_batch_size=3, **NO_CLIP),
    "cp_sampled": _cp_job("llama_untied_odd", micro_batch_size=3, **NO_CLIP, **SAMPLED),
    "cp_masked": _cp_job("llama_untied_odd", _masked_sequences, micro_batch_size=3, **NO_CLIP, **SAMPLED),
    "cp_hidden": _cp_job("llama_tied", micro_batch_size=2, teacher_model="llama_untied", **NO_CLIP),
    "cp_qwen3": _cp_job("qwen3_qknorm", micro_batch_size=4, **NO_CLIP),
    "cp_pp": _cp_job("llama_untied_odd", cp=2, pp=2, micro_batch_size=3, **NO_CLIP),
    "cp_save": _step_pair_job(
        "llama_untied_odd", save=True, ep=1, cp=2, micro_batch_size=3, distributed_optimizer=True, **NO_CLIP
    ),
    "cp_resume": _step_pair_job(
        "llama_untied_odd",
        resume=True,
        ep=1,
        micro_batch_size=3,
        distributed_optimizer=True,
        **{"from": "w2/cp_save_ckpt"},
        **NO_CLIP,
    ),
    # LoRA students (tests/recipe_gkd/actor/test_lora_actor.py): TP = 2, PP = 2 and a resume at TP = 1 vs TP = 1.
    "lora_tp1": _lora_job("qwen3_qknorm", **LORA),
    "lora_tp2": _lora_job("qwen3_qknorm", tp=2, **LORA),
    "lora_pp2": _lora_job("qwen3_qknorm", pp=2, **LORA),
    # Dropout on the adapters' input: active in training steps only, replayed exactly by full recompute.
    "lora_dropout": _lora_job("qwen3_qknorm", lora_dropout=0.3, **LORA),
    "lora_dropout_full": _lora_job("qwen3_qknorm", lora_dropout=0.3, recompute="full", **LORA),
    "lora_save": _lora_job("qwen3_qknorm", save=True, tp=2, distributed_optimizer=True, **LORA),
    "lora_resume": _lora_job(
        "qwen3_qknorm", resume=True, distributed_optimizer=True, **{"from": "w2/lora_save_ckpt"}, **LORA
    ),
    "moe_ep1": _step_pair_job("qwen3_moe", ep=1, micro_batch_size=2, **NO_CLIP),
    "moe_distopt": _step_pair_job("qwen3_moe", micro_batch_size=2, distributed_optimizer=True, **NO_CLIP),
    "moe_aux": _step_pair_job("qwen3_moe", micro_batch_size=2, aux_loss_coeff=0.5, **NO_CLIP),
    "moe_save": _step_pair_job("qwen3_moe", save=True, micro_batch_size=2, distributed_optimizer=True, **NO_CLIP),
    "moe_resume": _step_pair_job(
        "qwen3_moe",
        resume=True,
        micro_batch_size=2,
        distributed_optimizer=True,
        **{"from": "w2/moe_save_ckpt"},
        **NO_CLIP,
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--models", required=True)
    parser.add_argument("--ports", required=True, help="comma-separated free ports, one per actor built")
    parser.add_argument("--jobs", required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    ports = iter(int(p) for p in args.ports.split(","))
    for name in args.jobs.split(","):
        job = Job(args, ports, name)
        JOBS[name](job)
        job.save()


if __name__ == "__main__":
    main()
