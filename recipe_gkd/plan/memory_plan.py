"""Per-GPU memory plan: will each role fit, before anything launches (reads config.json only).

For every GPU role of the config, an estimate in GiB of what that GPU will hold:

- actor rank (megatron, the heaviest pipeline stage): weights, gradient buffer, optimizer state
  (fp32 master weights + Adam moments, divided over data parallel x context parallel with the
  distributed optimizer), activations of the micro-batches in flight, logits/loss buffers (with
  context parallelism: of the rank's 1/cp of every sequence, and the keys and values each layer
  gathers from the whole sequence), and a fixed CUDA/NCCL reserve; a mixture of experts'
  num_experts / ep experts of every layer beside its dense parameters (their optimizer state over
  data parallel / ep), its active experts' activations and its all-to-all dispatcher's buffers
  (`RankState`); a LoRA student (actor.lora.rank > 0) the frozen base weights alone and its adapters' whole
  state, gradients and optimizer state (`AdapterRankState`), and what the adapters keep for the backward pass;
- rollout engine GPU (vLLM): its `rollout.gpu_memory_utilization` share holds the weights (a
  mixture of experts: every expert), a LoRA student's adapter slots, a runtime reserve and the KV cache, which must
  hold at least one sequence of `data.max_prompt_length + rollout.sampling.max_new_tokens` tokens;
- teacher replica GPU (vLLM, local): weights, one request's full-vocabulary prompt log-prob
  buffers, a runtime reserve and the KV cache for `teacher.max_model_len`.

The formulas follow what the code allocates (see `actor_bytes_per_token_and_layer`); they
are compared with measured peaks in benchmarks/bench_actor_memory.py. A role that cannot fit
raises ConfigError naming the key to change (`check_memory_plan`). What the actor trains (the whole student or its
LoRA adapters) is one object built from the config (`build_trained`): its state on an actor rank, its activations,
its lines on a rollout engine and the size of one synced version (Ray's object store, `object_store_mib`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

from recipe_gkd.actor.hf_arch import check_expert_parallel
from recipe_gkd.config import (
    PIPELINE_DEPTH,
    ConfigError,
    Device,
    GKDConfig,
    Precision,
    Recompute,
    RolloutBackend,
    WeightTransport,
    actor_world_size,
    colocated_shares,
    weight_transport,
)
from recipe_gkd.config.derived import longest_sequence, vllm_max_lora_rank
from recipe_gkd.config.rules import CONTEXT_PARALLEL_SIZES, teacher_longest_sequence, validate
from recipe_gkd.config.schema import LoRAConfig
from recipe_gkd.config.teachers import TeacherHandle, teacher_handles, teacher_views
from recipe_gkd.models import Shape, UnsupportedModelError
from recipe_gkd.parallel_layout import ParallelLayout
from recipe_gkd.plan import lora_memory
from recipe_gkd.plan.gpu_memory import DEFAULT_GPU_MEMORY_GIB, GpuQuery, plan_gpu_memory
from recipe_gkd.plan.model_shape import read_shape
from recipe_gkd.targets import build_target
from teacher_server.config.teacher import TeacherBackend, TeacherLocation
from teacher_server.wire.hidden_codec import HIDDEN_ITEMSIZE

GIB = 1024**3
# CUDA context, cuBLAS workspaces, NCCL buffers and allocator slack on every actor GPU.
ACTOR_RESERVE_GIB = 2.5
# teacher.output=hidden: the loss's HIDDEN_CHUNK_BUFFERS fp32 [chunk, v] buffers take DEFAULT_CHUNK_BYTES
# in all (recipe_gkd/losses/hidden.py; the same numbers, kept here so a dry run imports no torch).
HIDDEN_LOSS_CHUNK_BYTES = 256 * 2**20
HIDDEN_CHUNK_BUFFERS = 5
# algorithm.cross_tokenizer at actor TP > 1: the loss gathers the whole vocabulary on every rank
# (recipe_gkd/actor/objective.py `full_vocabulary`, megatron-core 0.16.1 `_GatherFromModelParallelRegion`) from
# Float16Module's fp32 logits. Bound: six fp32 [tokens, V] tensors at once (the gathered logits, their tempered
# copy, the span path's log-softmax, the shared pieces' top-k loss over the same rows, and the gradients alive
# together in backward); benchmarks/bench_cross_tokenizer_memory.py measures 16.6-18.5 B per token per id.
XTOK_GATHERED_BYTES = 6 * 4
# vLLM outside weights and KV cache: CUDA graphs, sampler, activations of its profile run.
VLLM_RESERVE_GIB = 2.0
# vLLM's default max_num_batched_tokens for the offline LLM class on H100/H200 (vllm/engine/arg_utils.py).
VLLM_BATCHED_TOKENS = 16384
# Each vLLM engine process's CUDA context (~0.5 GiB on H100 with lazy module loading) and, with tensor
# parallelism, NCCL's buffers (channels x peers x NCCL_BUFFSIZE 4 MiB over its protocols): both exist before
# vLLM's init snapshot (vllm/v1/worker/gpu_worker.py Worker.init_device, 0.24.0/0.33.0), so they lie outside
# the gpu_memory_utilization share, which is a fraction of the device's total (request_memory).
VLLM_CUDA_CONTEXT_GIB = 0.5
VLLM_NCCL_GIB = 0.5
# A mixture of experts on the actor (megatron-core 0.16.1, the alltoall dispatcher recipe_gkd/actor/mcore_model.py
# sets, SequentialMLP experts of the local spec). Kept for backward per routed copy of a token, in I_moe / tp values:
# fc1's output [gate; up] (2), silu of the gate half (1), the up half plus glu_linear_offset (1, a new tensor), their
# product, which the routing weight multiplies (1), and the weighted product fc2 keeps (1) (transformer/mlp.py
# MLP.forward with per_token_scale). The copy of the token each expert's fc1 keeps (h values) is counted beside them.
EXPERT_ACTIVATION_VALUES = 6
# What the router and the permutation keep per token, bounded per expert: three fp32 [E] tensors and the boolean
# routing map (transformer/moe/router.py TopKRouter at moe_router_dtype fp32, moe_utils.permute's transposed
# probabilities and map; the top-k indices and probabilities, k << E, fit in the bound). A megatron MoE layer's saved
# tensors on CPU: 176 B a token at E = 16, k = 4 against this 208; its experts' and token copies matched the terms
# above to the byte (4608 + 2048 B a token at k = 4, I_moe = 96, h = 256, bf16).
ROUTER_BYTES_PER_EXPERT = 3 * 4 + 1
# MoEAlltoAllTokenDispatcher (transformer/moe/token_dispatcher.py): dispatch permutes each token's copies into one
# [tokens x experts_per_token, h] tensor (moe_utils.permute, dropless: num_out_tokens = tokens x topk) and the
# all-to-all receives as many (in); combine sends the experts' outputs back and receives them (out). Four such
# buffers of one layer at a time, in the compute dtype (an upper bound: at ep = 1 the all-to-all returns its input).
DISPATCH_BUFFERS = 4


@dataclass
class RoleMemory:
    """One GPU role's estimate: named parts in bytes against the GPU's usable bytes."""

    role: str
    gpus: int
    parts: list[tuple[str, float]] = field(default_factory=list)
    capacity: float = 0.0
    # The config key to change when it does not fit, and what the shortfall is.
    key: str = ""
    problem: str = ""
    notes: list[str] = field(default_factory=list)
    # Memory the role takes on its GPU outside `capacity` (a vLLM engine's share): it must fit in what is left.
    outside: list[tuple[str, float]] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(b for _, b in self.parts)

    @property
    def outside_total(self) -> float:
        return sum(b for _, b in self.outside)

    @property
    def fits(self) -> bool:
        return not self.problem


@dataclass
class MemoryPlan:
    roles: list[RoleMemory]
    skipped: list[str]
    # One GPU's size the plan budgets, and where it came from (recipe_gkd/plan/gpu_memory.py).
    gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB
    gpu_memory_source: str = ""


# ----------------------------------------------------------------------------- actor


def actor_bytes_per_token_and_layer(
    shape: Shape, tp: int, act_bytes: int, seq_len: int, recompute: str, attention: str
) -> float:
    """Activation bytes one decoder layer keeps for the backward pass, per token of a micro-batch.

    Local layer spec, no sequence parallel. Kept tensors: the two RMSNorm inputs and outputs
    (4h, replicated over TP), Qwen3's q/k norm inputs, the attention inputs and output, and the
    MLP's fc1 output, SwiGLU's two halves and its product (4 * ffn / tp). sdpa keeps q, k, v,
    the output and one log-sum-exp per row; unfused keeps q, k and v repeated to every head,
    the fp32 softmax output and its copy in the compute dtype ([heads, s] per token).
    selective recomputes the MLP (and unfused core attention); full keeps the layer input only
    (the recomputed layer's activations are added once by the caller). A mixture of experts keeps,
    in place of the MLP's, its active experts' (experts_per_token of them) and its router's,
    which selective recompute does not recompute.
    """
    h, d = shape.hidden_size, shape.head_dim
    heads, groups = shape.num_heads / tp, max(1.0, shape.num_kv_heads / tp)
    norms = 4 * h + ((heads + groups) * d if shape.qk_layernorm else 0)
    if attention == "sdpa":
        # fp32 grouped keys/values are repeated per head to reach the memory-efficient kernel
        # (recipe_gkd/actor/attention.py repeat_kv_for_kernel; with enable_gqa fp32 takes the math kernel).
        kv_heads = heads if act_bytes == 4 else groups
        attn = (2 * heads + 2 * kv_heads) * d
        probs = 0.0
    else:
        attn = 4 * heads * d
        probs = heads * seq_len * (4 + (act_bytes if act_bytes != 4 else 0)) / act_bytes
    if shape.is_moe:
        # The active width: each token's experts_per_token copies, each kept by its expert's fc1 (h) and through
        # its SwiGLU (EXPERT_ACTIVATION_VALUES x I_moe / tp); the router's fp32 [E] tensors beside them.
        experts = shape.experts_per_token * (h + EXPERT_ACTIVATION_VALUES * shape.moe_intermediate_size / tp)
        mlp = experts + shape.num_experts * ROUTER_BYTES_PER_EXPERT / act_bytes
    else:
        mlp = 4 * shape.intermediate_size / tp
    if recompute == "full":
        return act_bytes * h
    if recompute == "selective":
        # megatron's "mlp" recompute module skips MoE layers (transformer/transformer_layer.py): experts stay.
        mlp = mlp if shape.is_moe else 0.0
        if attention == "unfused":
            attn, probs = (heads + 2 * groups) * d + heads * d, 0.0
    return act_bytes * (norms + attn + probs + mlp)


def actor_memory(cfg: GKDConfig, shape: Shape, teacher: Shape | None = None) -> RoleMemory:
    """The heaviest actor rank, bounded from above (`teacher`: its shape with teacher.output=hidden).

    With pp > 1 the first stage holds the embedding and the most micro-batches in flight, the
    last one the output layer and the logits; the estimate takes the larger of the two end
    layers and adds both the first stage's activations and the last stage's logits. With cp > 1
    everything per token is the rank's share of each sequence (`ParallelLayout.cp_local_length`).
    """
    role, state = _actor_role(cfg, shape, teacher)
    if role.total > role.capacity:
        role.key, role.problem = _actor_remedy(cfg, role, shape, teacher, state)
    return role


def _actor_role(cfg: GKDConfig, shape: Shape, teacher: Shape | None) -> tuple[RoleMemory, float]:
    """The actor rank's parts against its budget, and its model state (weights, gradients, optimizer state and the
    step's temporary, which no smaller micro-batch shrinks); no remedy (`_actor_remedy` plans other settings)."""
    a, m = cfg.actor, cfg.actor.megatron
    layout = ParallelLayout.from_config(cfg)
    try:  # the student's config.json read here first (a dry run): its experts and actor.megatron.ep
        check_expert_parallel(shape, layout.ep_size)
    except UnsupportedModelError as err:
        raise ConfigError("actor.megatron.ep", str(err)) from err
    tp, pp, dp, cp = layout.tp_size, layout.pp_size, layout.dp_size, layout.cp_size
    bf16 = a.precision == Precision.bf16
    act = 2 if bf16 else 4
    vocab_shard = layout.vocab_shard_size(shape.vocab_size)
    layers = shape.num_layers // pp
    trained = build_trained(cfg)
    state = trained.rank_state(shape, layout, bf16=bf16, distributed=m.distributed_optimizer)
    seq_len = longest_sequence(cfg)[0]  # multi-turn: rollout.max_total_tokens
    tokens = a.max_tokens_per_micro_batch or a.micro_batch_size * seq_len
    per_rank = cfg.data.train_batch_size // dp
    micro_batches = (
        max(1, math.ceil(per_rank * seq_len / tokens))
        if a.max_tokens_per_micro_batch
        else per_rank // a.micro_batch_size
    )
    in_flight = min(pp, micro_batches)
    # Context parallelism: each rank holds 2 of the 2 x cp chunks of every row padded to a multiple of 2 x cp, so
    # every per-token buffer below is of `rank_tokens` (a token budget is taken as padded rows'; at cp = 1 both
    # are the micro-batch's tokens). Attention's scores span the whole padded row (`padded_len`).
    rank_tokens = (
        layout.cp_local_length(a.max_tokens_per_micro_batch)
        if a.max_tokens_per_micro_batch
        else a.micro_batch_size * layout.cp_local_length(seq_len)
    )
    padded_len = layout.cp_padded_length(seq_len)
    per_layer = actor_bytes_per_token_and_layer(shape, tp, act, padded_len, m.recompute.value, m.attention.value)
    activations = in_flight * rank_tokens * layers * per_layer
    if m.recompute == Recompute.full:  # one layer's full activations while it is recomputed
        activations += rank_tokens * actor_bytes_per_token_and_layer(
            shape, tp, act, padded_len, "none", m.attention.value
        )
    adapter_activations = trained.activation_parts(shape, tp, act, rank_tokens, layers, in_flight, m.recompute)
    # Last stage: logits in the compute dtype, their fp32 copy, the loss's fp32 log-softmax and
    # the two gradients of the same size (measured on CPU: benchmarks/bench_actor_memory.py).
    logits = rank_tokens * vocab_shard * (act + 4 * 4)
    # Buffers of one layer or of the loss at a time: the experts' dispatcher, a gathered vocabulary.
    transient = [
        *_gathered_kv_parts(shape, layout, act, rank_tokens * cp, layers, in_flight, m.recompute, m.attention.value),
        *_dispatcher_parts(shape, rank_tokens, act),
        *_gathered_vocabulary_parts(cfg, shape, rank_tokens),
    ]
    # All gone before the optimizer steps.
    freed = activations + logits + sum(b for _, b in [*transient, *adapter_activations])
    step_temp = state.step_temporary()
    of_tokens = (
        f"{tokens} tokens"
        if cp == 1
        else f"{rank_tokens} tokens per context-parallel rank ({rank_tokens * cp} padded / cp {cp})"
    )
    role = RoleMemory(
        role="actor rank",
        gpus=actor_world_size(cfg),
        parts=[
            *state.parts(layers),
            (
                f"activations ({in_flight} micro-batch(es) of {of_tokens} x {layers} layers, "
                f"recompute {m.recompute.value}, {m.attention.value} attention"
                f"{_active_experts(shape, tp)})",
                activations,
            ),
            *adapter_activations,
            (f"logits and loss buffers ({rank_tokens} tokens x {vocab_shard} vocabulary columns)", logits),
            *transient,
            (
                f"optimizer step temporary (fp32 sqrt of the Adam second moments, {step_temp / GIB:.2f} GiB) "
                "beyond the freed activations and logits",
                max(0.0, step_temp - freed),
            ),
            *_teacher_head_parts(teacher, vocab_shard, rank_tokens, act),
            ("CUDA context, NCCL, allocator reserve", ACTOR_RESERVE_GIB * GIB),
        ],
        capacity=cfg.cluster.gpu_memory_gib * GIB,
    )
    if share := a.gpu_memory_utilization:
        # torch's per-process cap covers what the caching allocator holds; the CUDA context and NCCL lie outside it.
        role.outside = [role.parts.pop()]
        role.capacity = share * role.capacity
        role.notes.append(f"budget = actor.gpu_memory_utilization {share} x {cfg.cluster.gpu_memory_gib} GiB")
    if shape.is_moe:
        role.notes.append(
            f"mixture of experts: {shape.num_params() / 1e9:.2f}B params, {shape.active_params() / 1e9:.2f}B active "
            f"per token; actor.megatron.ep={layout.ep_size}: {shape.num_experts // layout.ep_size} of "
            f"{shape.num_experts} experts per layer on each rank, their gradients and optimizer state over the "
            f"{layout.expert_dp_size} data-parallel rank(s) holding the same experts"
        )
    if cp > 1:
        role.notes.append(
            f"actor.megatron.cp={cp}: each {seq_len}-token sequence padded to a multiple of {2 * cp} ({padded_len}) "
            f"and cut into {2 * cp} chunks, {padded_len // cp} tokens on each rank; attention gathers the keys and "
            f"values of all {padded_len} ({_kv_gather_traffic(shape, layout, act, padded_len) / GIB:.2f} GiB "
            "received per rank and sequence in the forward, as much reduce-scattered in the backward)"
        )
    return role, state.total() + step_temp


def kv_gather_bytes(shape: Shape, tp: int, act_bytes: int, tokens: int) -> float:
    """One layer's keys and values of `tokens` tokens as one tensor-parallel rank's attention holds them after the
    context-parallel all-gather: 2 x kv_heads / tp x head_dim values a token in the compute dtype (fp32: repeated to
    every query head for the memory-efficient kernel, as `actor_bytes_per_token_and_layer` counts them)."""
    heads, groups = shape.num_heads / tp, max(1.0, shape.num_kv_heads / tp)
    width = heads if act_bytes == 4 else groups
    return tokens * 2 * width * shape.head_dim * act_bytes


def _kv_gather_traffic(shape: Shape, layout: ParallelLayout, act: int, tokens: int) -> float:
    """Bytes one rank receives in the all-gathers of one `tokens`-long sequence's forward: every layer's keys and
    values of the other cp - 1 ranks' chunks (grouped, as they travel: 2 x kv_heads / tp x head_dim a token)."""
    groups = max(1.0, shape.num_kv_heads / layout.tp_size)
    share = (layout.cp_size - 1) / layout.cp_size
    return shape.num_layers // layout.pp_size * 2 * groups * shape.head_dim * tokens * act * share


def _gathered_kv_parts(
    shape: Shape,
    layout: ParallelLayout,
    act: int,
    padded_tokens: int,
    layers: int,
    in_flight: int,
    recompute: Recompute,
    attention: str,
) -> list[tuple[str, float]]:
    """cp > 1: the whole micro-batch's keys and values each layer's attention all-gathers over the context-parallel
    group (recipe_gkd/actor/attention.py SDPAttention), `padded_tokens` of them (all cp ranks' chunks).

    Assumed as the code holds them: the gathered tensors are what scaled_dot_product_attention saves for the
    backward, so every layer that is not recomputed keeps its own (x the micro-batches in flight); the local keys
    and values before the gather stay counted in the per-token activations (an upper bound). Beside them, one
    layer's worth in flight: the backward's gradient of the gathered keys and values, whole-sequence before its
    reduce-scatter. With full recompute (or selective with unfused core attention) none is kept: the layer being
    recomputed holds its gather and that gradient (two)."""
    if layout.cp_size == 1:
        return []
    one_layer = kv_gather_bytes(shape, layout.tp_size, act, padded_tokens)
    recomputed = recompute == Recompute.full or (recompute == Recompute.selective and attention == "unfused")
    kept = 0 if recomputed else layers * in_flight
    held = kept + (2 if recomputed else 1)
    what = (
        f"{kept} kept for the backward + {held - kept} in flight" if kept else "the recomputed layer's and its gradient"
    )
    name = f"gathered keys and values ({padded_tokens} tokens of the whole sequence x {held} layers: {what})"
    return [(name, held * one_layer)]


@dataclass(frozen=True)
class RankState:
    """The model state of the heaviest actor rank: its dense parameters (attention, norms, a router, the embedding and
    output layer) and its experts' (num_experts / ep of every layer, 1/tp of each), with what each is sharded over.

    megatron-core 0.16.1 reduces and shards the two apart: an expert's weights are `allreduce=False` when ep > 1
    (tensor_parallel/layers.py ColumnParallelLinear / RowParallelLinear, is_expert), DDP puts their gradients in
    `expert_parallel_buffers` over the expert data-parallel group (distributed/distributed_data_parallel.py), and
    get_megatron_optimizer (optimizer/__init__.py) builds a second optimizer for them whose data_parallel_group is
    `intra_expt_dp_group` (parallel_state.get_expert_data_parallel_group), which the distributed optimizer shards
    each bucket over (optimizer/distrib_optimizer.py _build_model_gbuf_range). At ep = 1 the experts are dense
    parameters of the one optimizer, sharded over all of data parallel (dp / ep = dp: the same shares).

    Context parallelism replicates weights and gradients (each rank holds the whole layer) but shards the optimizer
    state over data parallel x context parallel: the dense optimizer's data_parallel_group is `intra_dp_cp_group`
    (optimizer/__init__.py get_megatron_optimizer; process_groups_config.py: parallel_state.get_data_parallel_group(
    with_context_parallel=True, partial_data_parallel=True), the dp x cp group itself with one optimizer instance,
    parallel_state.py), over which DDP also allocates the gradient buffers and reduces the gradients
    (distributed/distributed_data_parallel.py `_allocate_buffers_for_parameters(dense_params, intra_dp_cp_group)`,
    scaled by 1 / dp_cp_group.size()). The experts' group at ep = 1 spans the same ranks (megatron's expert rank
    order has no cp: its data parallel is world / (tp x ep x pp)).
    """

    dense: float
    experts: float
    # Ranks the dense / the experts' optimizer state is divided over (1: replicated, no distributed optimizer).
    dense_shards: int
    expert_shards: int
    ep_size: int
    num_experts: int
    tp_size: int
    bf16: bool
    distributed: bool
    cp_size: int = 1

    @classmethod
    def of(cls, shape: Shape, layout: ParallelLayout, *, bf16: bool, distributed: bool) -> RankState:
        pp, tp = layout.pp_size, layout.tp_size
        layers = shape.num_layers // pp
        embedding = layout.vocab_shard_size(shape.vocab_size) * shape.hidden_size
        # The last stage: final norm + output layer (a tied one is a copy there when pp > 1).
        last = shape.hidden_size + (embedding if (not shape.tie_word_embeddings or pp > 1) else 0)
        return cls(
            dense=layers * shape.dense_layer_params(tp) + (embedding + last if pp == 1 else max(embedding, last)),
            experts=layers * shape.expert_layer_params(tp, layout.ep_size),
            dense_shards=layout.dp_size * layout.cp_size if distributed else 1,
            expert_shards=layout.expert_dp_size * layout.cp_size if distributed else 1,
            ep_size=layout.ep_size,
            num_experts=shape.num_experts,
            tp_size=tp,
            bf16=bf16,
            distributed=distributed,
            cp_size=layout.cp_size,
        )

    @property
    def params(self) -> float:
        return self.dense + self.experts

    def weights(self) -> float:
        return self.params * (2 if self.bf16 else 4)

    def gradients(self) -> float:
        return self.params * 4

    def optimizer(self) -> float:
        """fp32 master weights (bf16) and the two Adam moments, each part over its own shards."""
        per_param = 12 if self.bf16 else 8
        return self.dense * (per_param / self.dense_shards) + self.experts * (per_param / self.expert_shards)

    def total(self) -> float:
        return self.weights() + self.gradients() + self.optimizer()

    def step_temporary(self) -> float:
        """The optimizer step's fp32 temporary: torch's AdamW (megatron-core 0.16.1's GPU optimizer without Transformer
        Engine or apex, megatron/core/optimizer/__init__.py) steps with foreach ops, and `_foreach_sqrt` of the second
        moments makes one fp32 tensor per parameter of the optimizer's shard (Fused Adam steps in place: this is the
        bound). ep > 1: the dense and the expert optimizer of megatron's ChainedOptimizer step one after the other,
        the larger shard's temporary is the peak."""
        if self.ep_size > 1:
            return max(self.dense * 4 / self.dense_shards, self.experts * 4 / self.expert_shards)
        return self.params * 4 / self.dense_shards

    def _over(self, shards: int, what: str = "data parallel") -> str:
        """The ranks an optimizer state is sharded over, as its line names them (with cp > 1: dp x cp)."""
        if self.cp_size == 1:
            return f"{what} {shards}"
        return f"{what} x context parallel {shards // self.cp_size} x {self.cp_size}"

    def parts(self, layers: int) -> list[tuple[str, float]]:
        """The plan's weights, gradient buffer and optimizer state lines (a mixture of experts: the experts' share)."""
        dtype = "bf16" if self.bf16 else "fp32"
        master = "fp32 master + " if self.bf16 else ""
        if not self.experts:
            mode = f"distributed over {self._over(self.dense_shards)}" if self.distributed else "replicated"
            return [
                (f"weights ({dtype}, {self.params / 1e9:.2f}B params on this rank)", self.weights()),
                ("gradient buffer (fp32)", self.gradients()),
                (f"optimizer state ({master}Adam moments, {mode})", self.optimizer()),
            ]
        local = self.num_experts // self.ep_size
        shard = f", 1/{self.tp_size} of each" if self.tp_size > 1 else ""
        expert_gib = self.experts * 4 / GIB
        mode = (
            f"distributed: dense over {self._over(self.dense_shards)}, the experts' "
            f"{self.experts * (12 if self.bf16 else 8) / self.expert_shards / GIB:.2f} GiB over "
            f"{self._over(self.expert_shards, 'expert data parallel')}"
            if self.distributed
            else "replicated"
        )
        return [
            (
                f"weights ({dtype}, {self.params / 1e9:.2f}B params on this rank: {self.dense / 1e9:.2f}B dense + "
                f"{self.experts / 1e9:.2f}B experts, {local} of {self.num_experts} in each of {layers} layers{shard})",
                self.weights(),
            ),
            (f"gradient buffer (fp32, the experts' {expert_gib:.2f} GiB of it)", self.gradients()),
            (f"optimizer state ({master}Adam moments, {mode})", self.optimizer()),
        ]


@dataclass(frozen=True)
class AdapterRankState:
    """actor.lora.rank > 0: the heaviest rank's frozen base and its LoRA adapters.

    The base keeps its weights alone: megatron-core 0.16.1's DDP gives a parameter without requires_grad no room in
    its gradient buffers and the optimizer takes no master copy or moments of it (distributed/
    distributed_data_parallel.py, optimizer/__init__.py skip `not param.requires_grad`). The adapters (`adapter`
    parameters on this rank, `lora_memory.actor_adapter_params` of each of its layers) have the whole state: weights
    in the training dtype, an fp32 gradient buffer, fp32 master weights (bf16) and two Adam moments, over the dense
    optimizer's shards (data parallel x context parallel with the distributed optimizer).
    """

    base: RankState
    adapter: float
    lora: LoRAConfig

    @classmethod
    def of(
        cls, shape: Shape, layout: ParallelLayout, lora: LoRAConfig, *, bf16: bool, distributed: bool
    ) -> AdapterRankState:
        if shape.is_moe:  # the adapters sit on dense linears: an expert's fc1 / fc2 is not one of them
            raise ConfigError(
                "actor.lora.rank",
                f"LoRA adapters on a mixture of experts ({shape.num_experts} experts a layer) are not planned: the "
                "adapters cover a dense student's linear_qkv, linear_proj, linear_fc1 and linear_fc2; set "
                "actor.lora.rank=0",
            )
        base = RankState.of(shape, layout, bf16=bf16, distributed=distributed)
        layers = shape.num_layers // layout.pp_size
        return cls(base, layers * lora_memory.actor_adapter_params(shape, lora, layout.tp_size), lora)

    @property
    def _weight_bytes(self) -> int:
        return 2 if self.base.bf16 else 4

    def _optimizer(self) -> float:
        return self.adapter * (12 if self.base.bf16 else 8) / self.base.dense_shards

    def total(self) -> float:
        return self.base.weights() + self.adapter * (self._weight_bytes + 4) + self._optimizer()

    def step_temporary(self) -> float:
        """torch's foreach AdamW's fp32 sqrt of the second moments, of the adapters' shard alone."""
        return self.adapter * 4 / self.base.dense_shards

    def parts(self, layers: int) -> list[tuple[str, float]]:
        """The frozen base's weights and the adapters' weights, gradient buffer and optimizer state."""
        b = self.base
        dtype = "bf16" if b.bf16 else "fp32"
        master = "fp32 master + " if b.bf16 else ""
        mode = f"distributed over {b._over(b.dense_shards)}" if b.distributed else "replicated"
        split = f"; column-parallel B and row-parallel A over tp {b.tp_size}" if b.tp_size > 1 else ""
        return [
            (
                f"base weights ({dtype}, {b.params / 1e9:.2f}B params on this rank, frozen: no gradient buffer, no "
                "optimizer state)",
                b.weights(),
            ),
            (
                f"LoRA adapters ({dtype}, rank {self.lora.rank} on {', '.join(self.lora.targets)} of {layers} layers: "
                f"{self.adapter / 1e6:.1f}M params on this rank{split})",
                self.adapter * self._weight_bytes,
            ),
            ("adapter gradient buffer (fp32)", self.adapter * 4),
            (f"adapter optimizer state ({master}Adam moments, {mode})", self._optimizer()),
        ]


ActorState = RankState | AdapterRankState


class WholeStudent:
    """actor.lora.rank = 0: the whole student is trained, and every weight sync carries it all."""

    what: ClassVar[str] = "the whole student"
    # The lighter run to name when the model state alone overflows one whole GPU and no other GPU can share it.
    lighter: ClassVar[tuple[str, str] | None] = (
        "actor.lora.rank",
        "train low-rank adapters instead (actor.lora.rank > 0: the base weights frozen, without gradients or "
        "optimizer state)",
    )

    def rank_state(self, shape: Shape, layout: ParallelLayout, *, bf16: bool, distributed: bool) -> ActorState:
        return RankState.of(shape, layout, bf16=bf16, distributed=distributed)

    def activation_parts(
        self, shape: Shape, tp: int, act: int, tokens: int, layers: int, in_flight: int, recompute: Recompute
    ) -> list[tuple[str, float]]:
        return []

    def engine_parts(self, shape: Shape, tp: int, dtype_bytes: int) -> list[tuple[str, float]]:
        return []

    def engine_beyond_profile(self, shape: Shape, tp: int, dtype_bytes: int) -> tuple[str, float]:
        return reload_layer(shape, tp, dtype_bytes)

    def engine_notes(self, shape: Shape, dtype_bytes: int) -> list[str]:
        return []

    def sync_params(self, shape: Shape) -> float:
        return shape.num_params()


@dataclass(frozen=True)
class LoraAdapters:
    """actor.lora.rank > 0: the adapters are trained over the frozen base; the engines load the base once, at start,
    hold the adapter in vLLM's preallocated LoRA slots, and every weight sync carries the adapter alone (its sync
    form, recipe_gkd/weight_sync/adapter.py) through Ray's object store."""

    lora: LoRAConfig
    what: ClassVar[str] = "the LoRA adapter alone"
    lighter: ClassVar[tuple[str, str] | None] = None

    @property
    def engine_rank(self) -> int:
        """vLLM's max_lora_rank, at which it preallocates its slots."""
        return vllm_max_lora_rank(self.lora.rank)

    def rank_state(self, shape: Shape, layout: ParallelLayout, *, bf16: bool, distributed: bool) -> ActorState:
        return AdapterRankState.of(shape, layout, self.lora, bf16=bf16, distributed=distributed)

    def activation_parts(
        self, shape: Shape, tp: int, act: int, tokens: int, layers: int, in_flight: int, recompute: Recompute
    ) -> list[tuple[str, float]]:
        """What the adapters keep for the backward pass (`lora_memory.adapter_activation_bytes`), counted as the base
        layer's activations are: every micro-batch in flight, plus with full recompute the recomputed layer's."""
        per_layer = lora_memory.adapter_activation_bytes(shape, self.lora, tp, act, recompute.value)
        held = in_flight * tokens * layers * per_layer
        if recompute == Recompute.full:
            held += tokens * lora_memory.adapter_activation_bytes(shape, self.lora, tp, act, "none")
        dropout = f", dropout {self.lora.dropout}: the dropped inputs and their masks" if self.lora.dropout else ""
        name = (
            f"adapter activations ({in_flight} micro-batch(es) of {tokens} tokens x {layers} layers: each adapter's "
            f"rank-{self.lora.rank} A x{dropout}, recompute {recompute.value})"
        )
        return [(name, held)]

    def engine_parts(self, shape: Shape, tp: int, dtype_bytes: int) -> list[tuple[str, float]]:
        """vLLM's LoRA slots (enable_lora, at start: inside the engine's share, before its KV cache)."""
        dtype = {2: "bf16", 4: "fp32"}[dtype_bytes]
        slots = lora_memory.vllm_lora_slots(shape, self.engine_rank, tp, dtype_bytes, VLLM_BATCHED_TOKENS)
        sharded = f", sharded over tp {tp} as their linears" if tp > 1 else ""
        name = (
            f"LoRA slots (max_lora_rank {self.engine_rank}, max_loras {lora_memory.VLLM_MAX_LORAS}, {dtype}: A and B "
            f"of every linear of the {shape.num_layers} layers{sharded}, the embedding and the LM head; punica's "
            "buffers)"
        )
        return [(name, slots)]

    def engine_beyond_profile(self, shape: Shape, tp: int, dtype_bytes: int) -> tuple[str, float]:
        """No layer is reloaded: a version is one adapter, at most all on the GPU while it is copied into the slots."""
        params = self.sync_params(shape)
        return f"adapter update: one version being loaded ({params / 1e6:.1f}M params, a bound)", params * dtype_bytes

    def engine_notes(self, shape: Shape, dtype_bytes: int) -> list[str]:
        cache = lora_memory.VLLM_MAX_LORAS * self.sync_params(shape) * dtype_bytes
        return [
            f"enable_lora: vLLM's CPU cache of adapters (max_cpu_loras {lora_memory.VLLM_MAX_LORAS}) holds "
            f"{cache / GIB:.2f} GiB of host memory, not on the GPU; the base weights are loaded once, at start"
        ]

    def sync_params(self, shape: Shape) -> float:
        return lora_memory.sync_adapter_params(shape, self.lora)


Trained = WholeStudent | LoraAdapters


def build_trained(cfg: GKDConfig) -> Trained:
    """What the actor trains and the engines receive: the whole student, or its LoRA adapters (actor.lora.rank)."""
    return LoraAdapters(cfg.actor.lora) if cfg.actor.lora.rank > 0 else WholeStudent()


def version_bytes(cfg: GKDConfig, shape: Shape) -> float:
    """One synced version in the training dtype (fp32 or bf16): the whole student, or the adapter's sync form."""
    return build_trained(cfg).sync_params(shape) * (2 if cfg.actor.precision == Precision.bf16 else 4)


def _active_experts(shape: Shape, tp: int) -> str:
    """The activations line's note for a mixture of experts: the active width it counts."""
    if not shape.is_moe:
        return ""
    return (
        f"; {shape.experts_per_token} of {shape.num_experts} experts per token x {shape.moe_intermediate_size}"
        f"{f' / tp {tp}' if tp > 1 else ''} wide, and the router"
    )


def _dispatcher_parts(shape: Shape, tokens: int, act: int) -> list[tuple[str, float]]:
    """A mixture of experts: the all-to-all dispatcher's permuted tokens in and out, one layer at a time."""
    if not shape.is_moe:
        return []
    rows = tokens * shape.experts_per_token
    name = (
        f"all-to-all dispatcher buffers ({tokens} tokens x {shape.experts_per_token} experts x {shape.hidden_size}, "
        "permuted and exchanged in and out, one layer at a time)"
    )
    return [(name, DISPATCH_BUFFERS * rows * shape.hidden_size * act)]


def _gathered_vocabulary_parts(cfg: GKDConfig, shape: Shape, tokens: int) -> list[tuple[str, float]]:
    """A kind whose loss gathers the whole vocabulary (algorithm.cross_tokenizer) at actor TP > 1: its buffers on every
    rank."""
    if not build_target(cfg).gathers_vocabulary or ParallelLayout.from_config(cfg).tp_size == 1:
        return []
    name = (
        f"cross-tokenizer loss over the gathered vocabulary ({tokens} tokens x {shape.vocab_size} ids on every TP "
        "rank: fp32 logits, their log-softmaxes and gradients)"
    )
    return [(name, tokens * shape.vocab_size * XTOK_GATHERED_BYTES)]


def _teacher_head_parts(teacher: Shape | None, vocab_shard: int, tokens: int, act: int) -> list[tuple[str, float]]:
    """teacher.output=hidden, on the last stage: the teacher's head rows, its hidden states, the loss's chunks."""
    if teacher is None:
        return []
    return [
        (f"teacher output head ({vocab_shard} rows x {teacher.hidden_size})", vocab_shard * teacher.hidden_size * act),
        (
            # The micro-batch's dense [B, T, H] and the loss rows gathered from it (saved for backward), 16-bit:
            # one micro-batch at a time (recipe_gkd/actor/collate.py LazyMicroBatches).
            f"teacher hidden states ({tokens} tokens x {teacher.hidden_size}, 16-bit, and the loss rows' copy)",
            2 * tokens * teacher.hidden_size * HIDDEN_ITEMSIZE,
        ),
        (
            "hidden-state loss chunk buffers (fp32)",
            min(HIDDEN_LOSS_CHUNK_BYTES, tokens * vocab_shard * 4 * HIDDEN_CHUNK_BUFFERS),
        ),
    ]


def _actor_remedy(
    cfg: GKDConfig, role: RoleMemory, shape: Shape, teacher: Shape | None, state: float
) -> tuple[str, str]:
    """The key to change first: the split when the model state (`state`: weights, gradients, optimizer state and its
    step's temporary, which no smaller micro-batch shrinks) overflows; a larger context-parallel size when one
    sequence does not fit even at full recompute (its activations, logits and loss buffers: only splitting the
    sequence shrinks them); else recompute, then the micro-batch."""
    m, a = cfg.actor.megatron, cfg.actor
    layout = ParallelLayout.from_config(cfg)
    over = f"needs {role.total / GIB:.1f} GiB of {role.capacity / GIB:.1f} GiB"
    if state + (0 if role.outside else ACTOR_RESERVE_GIB * GIB) > role.capacity:
        lighter = build_trained(cfg).lighter
        whole_gpu = state + ACTOR_RESERVE_GIB * GIB > cfg.cluster.gpu_memory_gib * GIB
        one_gpu = cfg.cluster.nnodes * cfg.cluster.gpus_per_node == 1  # no other GPU can share the state
        if whole_gpu and lighter is not None and one_gpu:
            key, how = lighter
            return key, f"{over}; the model state alone takes {state / GIB:.1f} GiB, more than the whole GPU: {how}"
        if cfg.actor.gpu_memory_utilization and cfg.cluster.colocate and not whole_gpu:
            return "actor.gpu_memory_utilization", f"{over}; give the actor a larger share of the colocated GPU"
        if not m.distributed_optimizer and layout.dp_size > 1:
            return "actor.megatron.distributed_optimizer", f"{over}; shard the optimizer state over data parallel"
        if (ep := _wider_expert_parallel(shape, layout)) is not None:
            return (
                "actor.megatron.ep",
                f"{over}; the model state alone takes {state / GIB:.1f} GiB, most of it the "
                f"{shape.num_experts // layout.ep_size} of {shape.num_experts} experts of every layer on each rank: "
                f"split them over more ranks (actor.megatron.ep={ep}: {shape.num_experts // ep} each)",
            )
        return _split_the_student(over, state)
    longest, bound = longest_sequence(cfg)
    lean = _lean(cfg)
    lean_role = _actor_role(lean, shape, teacher)[0]
    if lean_role.total > lean_role.capacity:  # one sequence is too long for this split: split the sequence
        if (cp := _wider_context_parallel(cfg, shape, teacher)) is not None:
            size, fits_as_is = cp
            at = ParallelLayout.from_config(_with_cp(cfg, size))
            how = "" if fits_as_is else ", with actor.megatron.recompute=full and one sequence per micro-batch"
            return (
                "actor.megatron.cp",
                f"{over}; one {longest}-token sequence ({bound}) needs {lean_role.total / GIB:.1f} GiB even at full "
                f"recompute, one sequence per micro-batch: split every sequence over context-parallel ranks "
                f"(actor.megatron.cp={size}: {at.cp_local_length(longest)} tokens of each per rank{how})",
            )
        why = (
            f"; one {longest}-token sequence ({bound}) does not fit beside the model state at any actor.megatron.cp "
            f"these {actor_world_size(cfg)} GPUs take"
        )
        return _split_the_student(over, state, why)
    if m.recompute != Recompute.full:
        # A mixture of experts: selective recompute leaves the experts' activations (megatron skips MoE layers).
        nxt = "selective" if m.recompute == Recompute.none and not shape.is_moe else "full"
        return "actor.megatron.recompute", f"{over}; recompute activations (actor.megatron.recompute={nxt})"
    key = "actor.max_tokens_per_micro_batch" if a.max_tokens_per_micro_batch else "actor.micro_batch_size"
    return key, f"{over}; use smaller micro-batches ({key})"


def _split_the_student(over: str, state: float, why: str = "") -> tuple[str, str]:
    """The last remedy: more GPUs for the student (tensor or pipeline parallelism, more actor GPUs)."""
    return (
        "actor.megatron.tp",
        f"{over}{why}; weights, gradients and optimizer state alone take {state / GIB:.1f} GiB: split the student "
        "over more GPUs (actor.megatron.tp / actor.megatron.pp, or more actor GPUs with the distributed optimizer)",
    )


def _lean(cfg: GKDConfig) -> GKDConfig:
    """The same split at its leanest per token: full recompute, one sequence per micro-batch."""
    a = cfg.actor
    megatron = dataclasses.replace(a.megatron, recompute=Recompute.full)
    actor = dataclasses.replace(a, megatron=megatron, micro_batch_size=1, max_tokens_per_micro_batch=0)
    return dataclasses.replace(cfg, actor=actor)


def _with_cp(cfg: GKDConfig, cp: int) -> GKDConfig:
    actor = dataclasses.replace(cfg.actor, megatron=dataclasses.replace(cfg.actor.megatron, cp=cp))
    return dataclasses.replace(cfg, actor=actor)


def _wider_context_parallel(cfg: GKDConfig, shape: Shape, teacher: Shape | None) -> tuple[int, bool] | None:
    """The smallest context-parallel size above the config's that the config rules take on these actor GPUs (not with
    expert parallelism or a cross-tokenizer teacher, dividing the GPUs by tp x pp) and that fits: as configured
    (True), else at full recompute with one sequence per micro-batch (False); None when none fits either way."""
    candidates = []
    for size in (c for c in CONTEXT_PARALLEL_SIZES if c > cfg.actor.megatron.cp):
        candidate = _with_cp(cfg, size)
        try:
            validate(candidate)
        except ConfigError:  # a size these GPUs or this run do not take: the next one
            continue
        candidates.append(candidate)
    for as_is in (True, False):
        for candidate in candidates:
            role = _actor_role(candidate if as_is else _lean(candidate), shape, teacher)[0]
            if role.total <= role.capacity:
                return candidate.actor.megatron.cp, as_is
    return None


def _wider_expert_parallel(shape: Shape, layout: ParallelLayout) -> int | None:
    """The next expert-parallel size that divides both the data-parallel size and the experts (None: none, or dense).

    A wider ep divides each rank's experts' weights and gradients; their optimizer state, over dp / ep ranks, stays."""
    if not shape.is_moe:
        return None
    wider = (e for e in range(layout.ep_size + 1, layout.dp_size + 1) if not layout.dp_size % e)
    return next((e for e in wider if not shape.num_experts % e), None)


# ----------------------------------------------------------------------------- vLLM engines


def vllm_memory(
    role: str,
    gpus: int,
    shape: Shape,
    tp: int,
    utilization: float,
    max_len: int,
    cfg: GKDConfig,
    *,
    dtype_bytes: int,
    beyond_profile: tuple[str, float] | None,
    engine_parts: list[tuple[str, float]] | None = None,
) -> RoleMemory:
    """One GPU of a vLLM engine with `tp` GPUs: weights, `engine_parts` (what it allocates at start beside them: a
    LoRA student's adapter slots), runtime reserve, KV cache in its share; outside it the process's CUDA context
    (+ NCCL with tp > 1) and `beyond_profile`, what the engine allocates that its profile run did not see: a
    teacher's prompt log-prob buffers, a rollout engine's reloaded layer or adapter update (None: nothing).

    Weights and KV cache are in the engine's dtype (`dtype_bytes`; vLLM's kv_cache_dtype "auto").
    """
    capacity = cfg.cluster.gpu_memory_gib * GIB
    budget = utilization * capacity
    weights = shape.num_params() * dtype_bytes / tp
    dtype = {2: "bf16", 4: "fp32"}[dtype_bytes]
    # A mixture of experts: vLLM holds every expert on every GPU of the engine (1/tp of each; its own expert
    # parallelism is not used).
    experts = (
        f", {shape.num_layers * shape.expert_layer_params() / 1e9:.2f}B of them in all {shape.num_experts} experts"
        if shape.is_moe
        else ""
    )
    parts = [(f"weights ({dtype}, {shape.num_params() / 1e9:.2f}B params / tp {tp}{experts})", weights)]
    parts += engine_parts or []
    parts.append(("vLLM runtime (CUDA graphs, sampler, profile activations)", VLLM_RESERVE_GIB * GIB))
    outside = [("CUDA context of the vLLM process", VLLM_CUDA_CONTEXT_GIB * GIB)]
    if tp > 1:
        outside.append((f"NCCL buffers (tensor parallel {tp})", VLLM_NCCL_GIB * GIB))
    if beyond_profile is not None:
        outside.append(beyond_profile)
    kv = budget - sum(b for _, b in parts)
    per_token = shape.kv_bytes_per_token(tp, dtype_bytes)
    kv_tokens = int(kv // per_token) if kv > 0 else 0
    parts.append((f"KV cache ({kv_tokens} tokens at {per_token / 1024:.0f} KiB each)", max(kv, 0.0)))
    memory = RoleMemory(role=role, gpus=gpus, parts=parts, capacity=budget, outside=outside)
    memory.notes.append(f"budget = {utilization} x {cfg.cluster.gpu_memory_gib} GiB")
    if kv_tokens < max_len:
        memory.problem = (
            f"the KV cache holds {kv_tokens} tokens, less than one {max_len}-token sequence: "
            f"weights {weights / GIB:.1f} GiB per GPU leave too little of {budget / GIB:.1f} GiB"
        )
    elif not cfg.cluster.colocate and budget + memory.outside_total > capacity:
        memory.problem = (
            f"{utilization} x {capacity / GIB:.1f} GiB for vLLM plus {memory.outside_total / GIB:.1f} GiB outside it "
            f"exceed the GPU's {capacity / GIB:.1f} GiB"
        )
    return memory


def prompt_logprob_buffers(shape: Shape, max_len: int, dtype_bytes: int) -> tuple[str, float]:
    """A scoring request's full-vocabulary prompt log-prob temporaries, which vLLM allocates outside its share.

    vLLM's V1 model runner computes a request's prompt log-probs from its whole scheduled chunk's logits
    in the model dtype, an fp32 copy and their fp32 log-softmax (vllm/v1/worker/gpu_model_runner.py,
    _get_prompt_logprobs_dict, 0.24 to 0.33: 12.4 GB for 8192 tokens at a 152k vocabulary); no runner's
    profiling run asks for prompt log-probs, so the KV cache takes the whole `gpu_memory_utilization`
    share and these bytes must fit beside it. (0.24's V2 runner, its default for Qwen3 and Llama, works
    in 1024-token chunks, far less: the plan takes the V1 bound.) A chunk is at most max_num_batched_tokens.
    """
    tokens = min(max_len, VLLM_BATCHED_TOKENS)
    per_entry = dtype_bytes + 4.0 + (4.0 if dtype_bytes != 4 else 0.0)
    name = f"prompt log-prob buffers ({tokens} tokens x {shape.vocab_size} vocabulary: logits, fp32 log-softmax)"
    return name, tokens * shape.vocab_size * per_entry


def reload_layer(shape: Shape, tp: int, dtype_bytes: int) -> tuple[str, float]:
    """The rollout engine's weight sync: vLLM's layer-wise in-place reload materialises each layer's parameters
    afresh on the device, loads the received weights into them and copies them into the engine's storage
    (vllm/model_executor/model_loader/reload/layerwise.py `_layerwise_process`, meta.py `materialize_layer`,
    0.24.0/0.33.0), after the KV cache took the share: the largest module's parameters lie outside it."""
    params = shape.largest_module_params(tp)
    return f"in-place reload: one layer materialised ({params / 1e6:.0f}M params, the largest)", params * dtype_bytes


def rollout_memory(cfg: GKDConfig, shape: Shape) -> RoleMemory:
    r = cfg.rollout
    max_len = longest_sequence(cfg)[0]
    # The rollout engine loads the student in the training precision (recipe_gkd/rollout/vllm.py).
    dtype_bytes = 4 if cfg.actor.precision == Precision.fp32 else 2
    gpus = r.nnodes * r.gpus_per_node
    trained = build_trained(cfg)  # a LoRA student: the engine's adapter slots, and no layer reloaded
    memory = vllm_memory(
        "rollout GPU",
        gpus,
        shape,
        r.tp,
        r.gpu_memory_utilization,
        max_len,
        cfg,
        dtype_bytes=dtype_bytes,
        beyond_profile=trained.engine_beyond_profile(shape, r.tp, dtype_bytes),
        engine_parts=trained.engine_parts(shape, r.tp, dtype_bytes),
    )
    memory.notes += trained.engine_notes(shape, dtype_bytes)
    if weight_transport(cfg) == WeightTransport.object_store:
        auto = (
            "" if cfg.cluster.ray_object_store_mb else ", cluster.ray_object_store_mb auto: two versions + the shards"
        )
        memory.notes.append(
            f"weight sync: {trained.what}, {version_bytes(cfg, shape) / GIB:.2f} GiB a version, through Ray's object "
            f"store of {object_store_mib(cfg) / 1024:.2f} GiB (host memory{auto})"
        )
    if not memory.fits:
        memory.key = "rollout.gpu_memory_utilization" if r.gpu_memory_utilization < 0.9 else "rollout.tp"
    else:
        engines = gpus // r.tp
        prompts = cfg.data.train_batch_size // engines
        kv_tokens = memory.parts[-1][1] / shape.kv_bytes_per_token(r.tp, dtype_bytes)
        memory.notes.append(
            f"{min(prompts, int(kv_tokens // max_len))} of its {prompts} prompts per step fit at full length at once"
        )
    return memory


def teacher_memory(cfg: GKDConfig, shape: Shape, handle: TeacherHandle | None = None) -> RoleMemory:
    """A teacher replica's GPU (`cfg`: a teacher's view; `handle`: the teacher in the run, which names its keys)."""
    handle = handle or next(iter(teacher_handles(cfg).values()))
    t = cfg.teacher
    max_len = t.max_model_len or shape.max_position_embeddings
    # teacher.dtype auto: vLLM keeps a 16-bit checkpoint's dtype and casts an fp32 one to fp16
    # (vllm/config/model.py, ModelConfig.dtype).
    dtype_bytes = 4 if t.dtype == "float32" else 2
    # A hidden-state teacher runs vLLM's pooling runner, which asks for no prompt log-probs and whose profile run
    # pools a whole max_num_batched_tokens batch (vllm/v1/worker/gpu_model_runner.py `profile_run` ->
    # `_dummy_pooler_run`, 0.24.0/0.33.0): the pooled states are inside its share, nothing lies beyond it.
    hidden = build_target(cfg).teacher_on_actor  # the teacher sends hidden states (its head is on the actor)
    memory = vllm_memory(
        f"{handle.label} GPU",
        t.replicas * t.gpus_per_replica,
        shape,
        t.gpus_per_replica,
        t.gpu_memory_utilization,
        max_len,
        cfg,
        dtype_bytes=dtype_bytes,
        beyond_profile=None if hidden else prompt_logprob_buffers(shape, max_len, dtype_bytes),
    )
    if hidden:
        memory.notes.append(
            "teacher.output=hidden: a pooling engine, no prompt log-probs; its profile run pools a full batch "
            "(the runtime reserve holds it)"
        )
    if not memory.fits:
        if memory.problem.startswith("the KV cache"):
            memory.key = "teacher.max_model_len" if not t.max_model_len else "teacher.gpus_per_replica"
        else:
            memory.key = "teacher.gpu_memory_utilization"
            memory.problem += ": lower teacher.gpu_memory_utilization (or teacher.max_model_len)"
        # The teacher's own keys (teachers.NAME.X in a run of several).
        memory.key = memory.key.replace("teacher.", f"{handle.key_prefix}.")
        memory.problem = memory.problem.replace("teacher.", f"{handle.key_prefix}.")
    if handle.prompt.privileged:  # its own prompts: the longest sequence it scores is its prompt bound's
        longest, prompt_key = teacher_longest_sequence(cfg)
        memory.notes.append(
            f"scores sequences of up to {longest} tokens ({prompt_key} + rollout.sampling.max_new_tokens)"
        )
        if max_len < longest:  # no memory setting helps: this comes first
            memory.key = prompt_key
            memory.problem = (
                f"the model's {max_len} positions are fewer than the {longest}-token sequences it scores: lower "
                f"{prompt_key} or rollout.sampling.max_new_tokens"
            )
    return memory


# ----------------------------------------------------------------------------- plan


def build_memory_plan(cfg: GKDConfig, query: GpuQuery | None = None) -> MemoryPlan | None:
    """The plan for a GPU run (None on cluster.device=cpu, where nothing is on a GPU).

    Budgets one GPU of cluster.gpu_memory_gib, or (0) of this node's real GPUs (`query`); raises
    ConfigError naming cluster.gpu_memory_gib when the configured size is not the device's."""
    if cfg.cluster.device == Device.cpu:
        return None
    gpu = plan_gpu_memory(cfg, query)
    cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, gpu_memory_gib=gpu.gib))
    skipped: list[str] = []
    roles: list[RoleMemory] = []
    student = read_shape(cfg.model.student_path, "model.student_path", skipped)
    if student is not None:
        on_actor = build_target(cfg).teacher_on_actor  # the target kind's teacher head on the actor's last stage
        teacher = read_shape(cfg.teacher.model_path, "teacher.model_path", skipped) if on_actor else None
        roles.append(actor_memory(cfg, student, teacher))
        if cfg.rollout.backend == RolloutBackend.vllm:
            roles.append(rollout_memory(cfg, student))
        else:
            skipped.append("rollout: rollout.backend=hf is not planned (vllm is the GPU backend)")
    # Every teacher on its own replicas (several teachers: each named, its keys under teachers.NAME).
    handles = teacher_handles(cfg)
    for name, view in teacher_views(cfg).items():
        h = handles[name]
        t = view.teacher
        if t.location == TeacherLocation.remote:
            skipped.append(f"{h.label}: {h.key('location')}=remote, planned where it runs")
        elif t.backend != TeacherBackend.vllm:
            skipped.append(f"{h.label}: {h.key('backend')}=hf is not planned (vllm is the GPU backend)")
        else:
            teacher_shape = read_shape(t.model_path, h.key("model_path"), skipped)
            if teacher_shape is not None:
                roles.append(teacher_memory(view, teacher_shape, h))
    if cfg.cluster.colocate:
        roles.insert(0, colocated_gpu(cfg, roles))
    return MemoryPlan(roles=roles, skipped=skipped, gpu_memory_gib=gpu.gib, gpu_memory_source=gpu.source)


def colocated_gpu(cfg: GKDConfig, roles: list[RoleMemory]) -> RoleMemory:
    """One GPU of cluster.colocate: each role's share of it, what lies outside the shares, and the sum.

    The shares come from the config alone (so a dry run prints them without any config.json); the
    bytes outside them (the actor's CUDA context and NCCL, the teacher's prompt log-prob buffers) from
    the roles planned. vLLM refuses to start when the GPU's free memory is below its share
    (vllm/v1/worker/gpu_worker.py, Worker.init_device), so everything must fit at once.
    """
    capacity = cfg.cluster.gpu_memory_gib * GIB
    shares = colocated_shares(cfg)
    what = {
        "actor.gpu_memory_utilization": "the actor process (torch's per-process cap)",
        "rollout.gpu_memory_utilization": "the rollout engine (vLLM: weights, runtime, KV cache)",
    }
    teacher_what = "the teacher replica (vLLM: weights, runtime, KV cache)"  # teacher. or teachers.NAME.
    parts = [
        (f"{share:.2f} x {cfg.cluster.gpu_memory_gib}: {key}, {what.get(key, teacher_what)}", share * capacity)
        for key, share in shares.items()
    ]
    outside = [(f"{r.role}: {name} (outside its share)", b) for r in roles for name, b in r.outside]
    if not cfg.actor.gpu_memory_utilization or not any(r.role == "actor rank" for r in roles):
        outside.insert(
            0, ("actor rank: CUDA context, NCCL, allocator reserve (outside its share)", ACTOR_RESERVE_GIB * GIB)
        )
    gpu = RoleMemory(
        role=f"GPU (colocated: actor rank, rollout engine{_colocated_teachers(len(shares) - 2)})",
        gpus=cfg.cluster.gpus_per_node,
        parts=parts + outside,
        capacity=capacity,
    )
    gpu.notes.append(f"shares sum to {sum(shares.values()):.2f} of the GPU; {len(outside)} part(s) outside the shares")
    if gpu.total > capacity:
        largest = max(shares, key=lambda k: shares[k])
        gpu.key = largest
        gpu.problem = (
            f"the roles on one GPU need {gpu.total / GIB:.1f} GiB of {capacity / GIB:.1f} GiB; lower the shares "
            f"({', '.join(shares)}), the largest first"
        )
    return gpu


def _colocated_teachers(replicas: int) -> str:
    """The colocated GPU's teacher replicas in its role name: none, one, or one per teacher."""
    if replicas <= 0:
        return ""
    return ", teacher replica" if replicas == 1 else f", {replicas} teacher replicas (one per teacher)"


def format_memory_plan(plan: MemoryPlan) -> str:
    lines = [f"memory plan (estimate, GiB per GPU of {plan.gpu_memory_gib} GiB, from {plan.gpu_memory_source}):"]
    for role in plan.roles:
        verdict = "fits" if role.fits else "DOES NOT FIT"
        lines.append(
            f"  {role.role} (x{role.gpus}): {role.total / GIB:.1f} of {role.capacity / GIB:.1f} GiB, {verdict}"
        )
        lines += [f"    {bytes_ / GIB:7.2f}  {name}" for name, bytes_ in role.parts]
        lines += [f"  + {bytes_ / GIB:7.2f}  {name} (outside the budget)" for name, bytes_ in role.outside]
        lines += [f"    note: {note}" for note in role.notes]
    lines += [f"  not planned: {reason}" for reason in plan.skipped]
    return "\n".join(lines)


def check_memory_plan(plan: MemoryPlan) -> None:
    """Raise ConfigError naming the key of the first role that does not fit."""
    for role in plan.roles:
        if not role.fits:
            raise ConfigError(
                role.key,
                f"{role.role} does not fit: {role.problem} (memory plan above; debug.memory_check=false launches anyway)",
            )


# ----------------------------------------------------------------------------- Ray's object store

# The least Ray's object store is given (the CPU demo's tiny models need no more), and the room kept
# beside the weights for the rollout shards of the steps in flight.
OBJECT_STORE_MIN_MIB = 256
OBJECT_STORE_SHARDS_MIB = 128


def object_store_mib(cfg: GKDConfig) -> int:
    """cluster.ray_object_store_mb, or (0) twice one synced version (the student's export, or with actor.lora.rank > 0
    the adapter's: `version_bytes`) plus room for the shards, plus the teacher's hidden states of the batches in
    flight (teacher.output=hidden).

    An object-store sync puts a whole version (in the training dtype: fp32 or bf16) before the engines
    have read it, and the next version may be put before the last reference to the previous one is
    gone: two versions must fit, or Ray spills them to disk (seconds per step, measured: an 81M
    student's 325 MB through a 256 MiB store took 3-5.5 s a sync).
    """
    if cfg.cluster.ray_object_store_mb:
        return cfg.cluster.ray_object_store_mb
    base = OBJECT_STORE_MIN_MIB
    if weight_transport(cfg) == WeightTransport.object_store:  # else the weights go over a collective, by buckets
        shape = read_shape(cfg.model.student_path, "model.student_path", [])
        if shape is not None:
            export_mib = version_bytes(cfg, shape) / 2**20
            base = max(OBJECT_STORE_MIN_MIB, math.ceil(2 * export_mib) + OBJECT_STORE_SHARDS_MIB)
    return base + math.ceil(hidden_shard_bytes(cfg) / 2**20)


def hidden_shard_bytes(cfg: GKDConfig) -> int:
    """teacher.output=hidden: the hidden states the rollout shards of the batches in flight carry through the object
    store (the target kind's payload: 2 bytes a value of recipe_gkd/targets/hidden.py HiddenStates), at most
    max_new_tokens a sequence (0 for a kind without a payload of that size)."""
    teacher = read_shape(cfg.teacher.model_path, "teacher.model_path", [])
    per_token = build_target(cfg).payload_bytes_per_token(None if teacher is None else teacher.hidden_size)
    batches = 1 + PIPELINE_DEPTH[cfg.algorithm.schedule]
    # Response tokens a sequence: multi-turn conversations up to rollout.max_total_tokens.
    tokens = cfg.data.train_batch_size * (
        cfg.rollout.max_total_tokens if cfg.rollout.env else cfg.rollout.sampling.max_new_tokens
    )
    return batches * tokens * per_token
