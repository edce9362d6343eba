"""The megatron-core GPTModel of an HF Llama/Qwen2/Qwen3/Mistral student: its TransformerConfig and the model.

The only module of the actor that imports megatron at module use (inside its functions). The family's architecture
fields and layer-spec arguments come from its spec (recipe_gkd/models: `transformer_config`, `layer_spec`), the run's
parallel, precision and kernel settings from here; the name and tensor mapping to and from HF is
:mod:`recipe_gkd.actor.hf_convert`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from recipe_gkd.actor.hf_arch import check_split
from recipe_gkd.actor.hf_convert import partition_dim
from recipe_gkd.models import HFArch
from recipe_gkd.parallel_layout import ParallelLayout, padded_vocab_size

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

# A family's gated activation (recipe_gkd/models: ModelFamily.activation) as megatron's activation_func.
ACTIVATIONS = {"silu": torch.nn.functional.silu}


def recompute_settings(recompute: str, attention: str) -> dict[str, Any]:
    """megatron's TransformerConfig fields for `actor.megatron.recompute` (none | selective | full).

    selective recomputes the dense MLP (its fc1 output and SwiGLU, 4 * ffn / tp values per token,
    are the largest activations of a Llama/Qwen layer) and, with the unfused attention, the
    [heads, s, s] probabilities; full keeps only each layer's input and recomputes the layer.
    """
    if recompute == "none":
        return {"recompute_granularity": None}
    if recompute == "selective":
        modules = ["mlp", "core_attn"] if attention == "unfused" else ["mlp"]
        return {"recompute_granularity": "selective", "recompute_modules": modules}
    if recompute == "full":
        # Uniform, one layer per unit: every layer's input is kept, each layer recomputed on its own.
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    raise ValueError(f"actor.megatron.recompute={recompute!r}: choose none, selective or full")


def build_transformer_config(
    arch: HFArch,
    layout: ParallelLayout,
    *,
    bf16: bool,
    on_cpu: bool,
    recompute: str = "none",
    attention: str = "sdpa",
    aux_loss_coeff: float = 0.0,
) -> TransformerConfig:
    """megatron TransformerConfig reproducing the HF model (local spec, no fused kernels).

    `aux_loss_coeff` (actor.moe.aux_loss_coeff): a mixture of experts' load-balancing loss weight; the actor sets
    the config's coefficient per micro-batch (recipe_gkd/actor/moe_stats.py `scaled_aux_loss_coeff`).
    """
    from megatron.core.transformer import TransformerConfig

    check_split(arch, layout.tp_size, layout.pp_size, layout.cp_size, ep_size=layout.ep_size)
    return TransformerConfig(
        **recompute_settings(recompute, attention),
        # The family's architecture: sizes, norms, biases, the gated MLP (a mixture of experts' router and experts).
        **arch.family.transformer_config(arch),
        **moe_settings(arch, layout, aux_loss_coeff),
        activation_func=ACTIVATIONS[arch.family.activation],
        # Distillation fine-tunes as HF does: no dropout (this also keeps TP=1 == TP=2 exact).
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp_size,
        pipeline_model_parallel_size=layout.pp_size,
        context_parallel_size=layout.cp_size,
        sequence_parallel=False,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        # Activations sent between pipeline stages: the compute dtype.
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        # Micro-batches are padded to their own longest sequence: stages exchange shapes first.
        variable_seq_lengths=True,
        # megatron rejects its default (allgather) dispatcher with variable lengths; alltoall also runs at EP = 1.
        moe_token_dispatcher_type="alltoall",
        bf16=bf16,
        # The loss is a token sum over the global token count: DDP must sum, not average.
        calculate_per_token_loss=True,
        attention_softmax_in_fp32=True,
        # Weights always come from the HF checkpoint: skip the random init.
        perform_initialization=False,
        use_cpu_initialization=on_cpu,
        # Fused kernels need CUDA/apex/TE; the plain torch paths run everywhere.
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )


def moe_settings(arch: HFArch, layout: ParallelLayout, aux_loss_coeff: float) -> dict[str, Any]:
    """The run's mixture-of-experts fields: the expert-parallel size (expert tensor parallel = TP, megatron's
    default) and the router's load-balancing loss (megatron's Switch-style "aux_loss"; "none" at 0)."""
    if not arch.is_moe:
        return {}
    return {
        "expert_model_parallel_size": layout.ep_size,
        "moe_router_load_balancing_type": "aux_loss" if aux_loss_coeff > 0 else "none",
        "moe_aux_loss_coeff": aux_loss_coeff,
    }


def torch_norm_block_spec(layer_spec: Any, config: TransformerConfig) -> Any:
    """The decoder block spec of this stage's layers with torch's RMSNorm as its final norm.

    Given a layer spec, megatron-core 0.16.1 builds the block's final norm from a module-level
    choice (transformer/transformer_block.py: `LayerNormImpl` = TENorm with Transformer Engine,
    FusedLayerNorm with Apex alone, else WrappedTorchNorm); Apex's FusedLayerNorm asserts
    normalization == "LayerNorm", so an RMSNorm student failed in setup wherever Apex is installed
    without TE. The layers' own norms are WrappedTorchNorm already (get_gpt_layer_local_spec with
    normalization="RMSNorm", models/backends.py LocalSpecProvider.layer_norm).
    """
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layers = get_num_layers_to_build(config)  # this pipeline stage's, as megatron counts them for a layer spec
    submodules = TransformerBlockSubmodules(layer_specs=[layer_spec] * layers, layer_norm=WrappedTorchNorm)
    return ModuleSpec(module=TransformerBlock, submodules=submodules)


def build_gpt_model(
    arch: HFArch,
    config: TransformerConfig,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    attention: str = "sdpa",
) -> GPTModel:
    """GPTModel with megatron's local (no Transformer Engine) layer spec.

    `pre_process` / `post_process`: this pipeline stage holds the embedding / the final norm and
    output layer (both for a single stage). `attention`: "sdpa" swaps the spec's core attention
    for `SDPAttention` (torch's fused kernels), "unfused" keeps megatron's DotProductAttention.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(**arch.family.layer_spec(arch))
    if attention == "sdpa":
        from recipe_gkd.actor.attention import SDPAttention

        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    elif attention != "unfused":
        raise ValueError(f"actor.megatron.attention={attention!r}: choose sdpa or unfused")
    model = GPTModel(
        config=config,
        transformer_layer_spec=torch_norm_block_spec(spec, config),
        vocab_size=padded_vocab_size(arch.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=arch.rope_theta,  # type: ignore[arg-type]  # a float base is what HF uses
    )
    if arch.llama3_rope is not None:
        _apply_llama3_rope(model, arch)
    mark_tensor_parallel_params(model)
    if arch.is_moe:
        _keep_experts_apart(model)
    return model


def _keep_experts_apart(model: torch.nn.Module) -> None:
    """Give the experts' parameters their own gradient buffers and optimizer at every expert-parallel size.

    megatron-core 0.16.1 marks an expert's weight `allreduce=False` only at EP > 1 (tensor_parallel/layers.py
    ColumnParallelLinear / RowParallelLinear with is_expert), and get_megatron_optimizer builds a second, expert
    optimizer from those (optimizer/__init__.py `is_expert_parallel`): at EP = 1 the experts would sit in the dense
    optimizer and a checkpoint's optimizer state would be laid out otherwise (one optimizer, not two chained ones),
    so a checkpoint saved at EP = 2 would not load at EP = 1. Marked at every EP, they are reduced over the
    expert-data-parallel group, which at EP = 1 is the data-parallel group: the same sums.
    """
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False  # type: ignore[attr-defined]


def _apply_llama3_rope(model: GPTModel, arch: HFArch) -> None:
    """Llama 3.x RoPE scaling with the model's own four parameters.

    megatron-core 0.16.1's GPTModel passes only the factor to RotaryEmbedding._apply_scaling and
    keeps low/high frequency factors 1/4 and an original context of 8192 (rotary_pos_embedding.py);
    the same function is called here with every parameter, on the unscaled frequencies, before
    any forward (its forward caches by sequence length).
    """
    rotary = model.rotary_pos_emb
    factor, low, high, original = arch.llama3_rope  # type: ignore[misc]
    dim = arch.head_dim
    device = rotary.inv_freq.device
    unscaled = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    rotary.inv_freq = rotary._apply_scaling(
        unscaled, factor=factor, low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=original
    )


def mark_tensor_parallel_params(model: torch.nn.Module) -> None:
    """Tag sharded weights the way megatron's weight init would have.

    With perform_initialization=False megatron 0.16 leaves `tensor_model_parallel` unset on
    linear and embedding weights, so its grad-norm helpers would count their shards on TP
    rank 0 only. The tags must match `partition_dim`.
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, param in model.named_parameters():
        dim = partition_dim(name)
        if dim is None:
            continue
        if getattr(param, "tensor_model_parallel", False):
            if param.partition_dim != dim:
                raise RuntimeError(f"{name}: megatron shards dim {param.partition_dim}, the converter dim {dim}")
            continue
        set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)
