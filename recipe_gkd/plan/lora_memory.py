"""A LoRA student's figures for the memory plan (actor.lora.rank > 0), from its config.json Shape alone.

- On an actor rank: one pair A [rank, in] and B [out, rank] per decoder layer and target on megatron's fused linear
  (`fused_dims`). Under TP the column-parallel linears (qkv, fc1) keep A whole and shard B's rows, the row-parallel
  ones (proj, fc2) shard A's columns and keep B whole (`actor_adapter_params`). The activations they add: each
  adapter's rank-wide A x, which B's gradient needs (its input x is the base linear's, counted already), and with
  dropout the dropped copy of x and its mask (`adapter_activation_bytes`).
- In the sync form (recipe_gkd/weight_sync/adapter.py): a pair per HF projection, whole, A repeated over q/k/v and
  gate/up (`sync_adapter_params`): what one version puts in Ray's object store.
- On a vLLM engine GPU (`vllm_lora_slots`): enable_lora preallocates, at start, in the model dtype, for max_loras
  slots at max_lora_rank: A and B of every linear vLLM wraps (its default target_modules=None: all four of every
  layer whatever actor.lora.targets names, and the embedding and the LM head), and punica's index buffers.
"""

from __future__ import annotations

from recipe_gkd.config.schema import LoRAConfig
from recipe_gkd.models import Shape
from recipe_gkd.weight_sync.adapter import HF_PROJECTIONS

# Megatron's column-parallel linears of a decoder layer (the rest, proj and fc2, are row-parallel).
COLUMN_PARALLEL = ("qkv", "fc1")
# The targets inside the MLP, which actor.megatron.recompute=selective recomputes (their adapters' activations too).
MLP_TARGETS = ("fc1", "fc2")
# The engines hold one adapter, the one being trained (max_loras; max_cpu_loras defaults to it).
VLLM_MAX_LORAS = 1
# vLLM's max_num_seqs for the offline LLM class on H100/H200 (vllm/engine/arg_utils.py): punica's per-sequence
# buffers.
VLLM_MAX_NUM_SEQS = 1024
# torch's dropout keeps a bool mask of its input for the backward pass.
DROPOUT_MASK_BYTES = 1


def fused_dims(shape: Shape, target: str) -> tuple[int, int]:
    """(in, out) of megatron's fused linear of `target` (actor.lora.targets), whole (before TP)."""
    h, d = shape.hidden_size, shape.head_dim
    return {
        "qkv": (h, (shape.num_heads + 2 * shape.num_kv_heads) * d),
        "proj": (shape.num_heads * d, h),
        "fc1": (h, 2 * shape.intermediate_size),
        "fc2": (shape.intermediate_size, h),
    }[target]


def actor_adapter_params(shape: Shape, lora: LoRAConfig, tp: int) -> float:
    """One decoder layer's adapter parameters on one of `tp` tensor-parallel actor ranks."""
    total = 0.0
    for target in lora.targets:
        fan_in, fan_out = fused_dims(shape, target)
        if target in COLUMN_PARALLEL:  # A [rank, in] replicated, B [out / tp, rank]
            total += lora.rank * fan_in + fan_out * lora.rank / tp
        else:  # A [rank, in / tp], B [out, rank] replicated
            total += lora.rank * fan_in / tp + fan_out * lora.rank
    return total


def adapter_activation_bytes(shape: Shape, lora: LoRAConfig, tp: int, act_bytes: int, recompute: str) -> float:
    """What one decoder layer's adapters keep for the backward pass, per token of a micro-batch, beyond the base
    layer's activations (`actor_bytes_per_token_and_layer` counts each linear's input x, which A's gradient reads).

    Each adapter keeps A x ([rank] values in the compute dtype, B's input; a row-parallel A's partial sums are
    all-reduced to the whole rank). Dropout > 0 (actor.megatron.tp = 1 only) adds the dropped copy of x (A's input)
    and torch's bool mask. selective recompute recomputes the MLP's adapters with it, full keeps only the layer
    input (the recomputed layer's own are added by the caller at recompute "none")."""
    if recompute == "full":
        return 0.0
    kept = [t for t in lora.targets if not (recompute == "selective" and t in MLP_TARGETS)]
    total = 0.0
    for target in kept:
        total += act_bytes * lora.rank
        if lora.dropout > 0:
            fan_in = fused_dims(shape, target)[0]
            width = fan_in if target in COLUMN_PARALLEL else fan_in / tp
            total += width * (act_bytes + DROPOUT_MASK_BYTES)
    return total


def sync_adapter_params(shape: Shape, lora: LoRAConfig) -> float:
    """The whole adapter in its sync form (recipe_gkd/weight_sync/adapter.py): for each layer, target and HF
    projection one A [rank, in] (the fused linear's A repeated) and B [rows of that projection, rank] (B split)."""
    per_layer = 0.0
    for target in lora.targets:
        fan_in, fan_out = fused_dims(shape, target)
        per_layer += len(HF_PROJECTIONS[target]) * lora.rank * fan_in + fan_out * lora.rank
    return shape.num_layers * per_layer


def vllm_layer_slot_params(shape: Shape, max_rank: int, tp: int) -> float:
    """One decoder layer's LoRA slot values (per slot) on one of an engine's `tp` GPUs: vLLM wraps every linear
    (vllm/lora/layers): qkv_proj (MergedQKVParallelLinearWithLoRA: q, k, v slices, each A [R, h] whole and B its
    shard's rows, the KV heads at least one per GPU), o_proj and down_proj (RowParallelLinearWithLoRA: A [R, in / tp],
    B [h, R] whole), gate_up_proj (MergedColumnParallelLinearWithLoRA: two slices, A [R, h], B [I / tp, R])."""
    h, d, r = shape.hidden_size, shape.head_dim, max_rank
    q_rows = shape.num_heads // tp * d
    kv_rows = max(1, shape.num_kv_heads // tp) * d
    qkv = 3 * r * h + (q_rows + 2 * kv_rows) * r
    o_proj = r * shape.num_heads * d / tp + h * r
    gate_up = 2 * r * h + 2 * (shape.intermediate_size / tp) * r
    down = r * shape.intermediate_size / tp + h * r
    return qkv + o_proj + gate_up + down


def vllm_head_slot_params(shape: Shape, max_rank: int) -> float:
    """The embedding's and the LM head's slot values (per slot), whole on every GPU: VocabParallelEmbeddingWithLoRA
    (A [V, R], B [h, R]) and LogitsProcessorWithLoRA (A [R, h], B [V, R]); a tied LM head is the embedding's
    ParallelLMHead, wrapped through the logits processor only."""
    return 2 * (shape.vocab_size + shape.hidden_size) * max_rank


def punica_bytes(max_num_batched_tokens: int, max_num_seqs: int = VLLM_MAX_NUM_SEQS) -> float:
    """punica's index buffers (vllm/lora/punica_wrapper/punica_base.py: four int64 [tokens], three int64 [seqs];
    punica_gpu.py: two LoRAKernelMeta, each two int32 [tokens] and a few [max_loras + 2])."""
    base = 4 * max_num_batched_tokens * 8 + 3 * max_num_seqs * 8
    meta = 2 * (2 * max_num_batched_tokens * 4 + (2 * (VLLM_MAX_LORAS + 1) + VLLM_MAX_LORAS + 2) * 4)
    return base + meta


def vllm_lora_slots(shape: Shape, max_rank: int, tp: int, dtype_bytes: int, max_num_batched_tokens: int) -> float:
    """Bytes enable_lora preallocates on one of an engine's `tp` GPUs for VLLM_MAX_LORAS slots at `max_rank`, in
    the model dtype (lora_dtype auto), and punica's index buffers."""
    values = shape.num_layers * vllm_layer_slot_params(shape, max_rank, tp) + vllm_head_slot_params(shape, max_rank)
    return VLLM_MAX_LORAS * values * dtype_bytes + punica_bytes(max_num_batched_tokens)
