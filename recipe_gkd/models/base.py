"""What a model-family spec holds: its config.json reading, its HF <-> megatron tensor table, its megatron layer fields.

A family (one module of `recipe_gkd/models/`) is a `ModelFamily` subclass: the HF `model_type`s it covers, what it
refuses (`refuse`), its shape facts (`qkv_bias`, `qk_layernorm`), the tensors of one decoder layer (`layer`: each
megatron tensor with the HF tensors it is made of and how, `LayerTensor`), and the megatron TransformerConfig and
layer-spec fields that build it (`transformer_config`, `layer_spec`). The base is a dense decoder-only transformer
with Llama's layer; the memory plan reads a model of no listed family (a teacher, say) through it. Pure Python: the
torch conversions are recipe_gkd/actor/hf_convert.py's, the megatron model recipe_gkd/actor/mcore_model.py's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

SUPPORTED_ROPE_TYPES = ("default", "llama3")

# Megatron's names outside the decoder layers, and each layer's prefix (HF's beside them).
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
MCORE_LAYER = "decoder.layers.{i}."
HF_EMBEDDING = "model.embed_tokens.weight"
HF_OUTPUT_LAYER = "lm_head.weight"
HF_FINAL_NORM = "model.norm.weight"
HF_LAYER = "model.layers.{i}."

# How one megatron tensor is made of its HF tensors (recipe_gkd/actor/hf_convert.py implements each both ways).
COPY = "copy"  # one HF tensor as it is
FUSED_QKV = "fused_qkv"  # q, k, v interleaved per GQA group
GATED_FC1 = "gated_fc1"  # [gate; up]


class UnsupportedModelError(ValueError):
    """The HF checkpoint uses a feature the megatron actor does not reproduce exactly."""


@dataclass(frozen=True)
class LayerTensor:
    """One megatron tensor of a decoder layer and the HF tensors it converts from (names after the layer prefix)."""

    mcore: str
    hf: tuple[str, ...]
    conversion: str = COPY


@dataclass(frozen=True)
class StackedTensor:
    """A parameter transformers holds for every expert of a layer at once ([E, rows, cols], its modeling code) where the
    checkpoint has one tensor per expert and part: expert e's [rows, cols] is its `parts` (with {e} filled in)
    concatenated along the rows. Names after the layer prefix."""

    name: str
    parts: tuple[str, ...]


INPUT_NORM = LayerTensor("input_layernorm.weight", ("input_layernorm.weight",))
QKV = LayerTensor("self_attention.linear_qkv.weight", tuple(f"self_attn.{p}_proj.weight" for p in "qkv"), FUSED_QKV)
QKV_BIAS = LayerTensor("self_attention.linear_qkv.bias", tuple(f"self_attn.{p}_proj.bias" for p in "qkv"), FUSED_QKV)
Q_NORM = LayerTensor("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",))
K_NORM = LayerTensor("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",))
ATTENTION_OUT = LayerTensor("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",))
MLP_NORM = LayerTensor("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",))
# Unsharded fc1 is [gate; up]; hf_convert.shard_for_tp regroups it per rank.
FC1 = LayerTensor("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), GATED_FC1)
FC2 = LayerTensor("mlp.linear_fc2.weight", ("mlp.down_proj.weight",))
# Llama's decoder layer, in megatron's parameter order (the HF order follows from it).
DENSE_LAYER = (INPUT_NORM, QKV, ATTENTION_OUT, MLP_NORM, FC1, FC2)


@dataclass(frozen=True)
class Shape:
    """The numbers of a decoder-only transformer the plan needs (from its config.json): dense, or a mixture of
    experts in every layer."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_layernorm: bool = False
    max_position_embeddings: int = 0
    # A mixture of experts (0 experts: dense): routed experts per MoE layer, experts each token goes to, and each
    # expert's MLP width (its `intermediate_size` is then the dense MLP's, which a Qwen3-MoE layer does not have).
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def dense_layer_params(self, tp: int = 1) -> float:
        """Parameters of one decoder layer outside its routed experts, on one of `tp` tensor-parallel ranks: attention
        and norms, then the dense MLP, or (a mixture of experts) the router, E x H, replicated over TP (megatron's
        TopKRouter weight; a dense parameter: reduced and sharded over all of data parallel)."""
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        sharded = self.hidden_size * qkv_rows + self.num_heads * self.head_dim * self.hidden_size
        sharded += qkv_rows if self.qkv_bias else 0
        replicated = 2 * self.hidden_size + (2 * self.head_dim if self.qk_layernorm else 0)
        if self.is_moe:  # the router; a Qwen3-MoE layer has no dense MLP (its intermediate_size is unused)
            replicated += self.num_experts * self.hidden_size
        else:
            sharded += 3 * self.hidden_size * self.intermediate_size
        return sharded / tp + replicated

    def expert_params(self) -> int:
        """One routed expert's parameters: a SwiGLU MLP, gate and up [I_moe, H] and down [H, I_moe] (0: dense)."""
        return 3 * self.hidden_size * self.moe_intermediate_size if self.is_moe else 0

    def expert_layer_params(self, tp: int = 1, ep: int = 1) -> float:
        """One decoder layer's routed experts on one rank: num_experts / `ep` of them (expert parallelism), a 1/`tp`
        shard of each (megatron's expert tensor parallel size is the tensor-parallel size). 0 for a dense model."""
        return (self.num_experts // ep) * self.expert_params() / tp

    def layer_params(self, tp: int = 1, ep: int = 1) -> float:
        """Parameters of one decoder layer on one of `tp` tensor-parallel ranks (of `ep` expert-parallel ones)."""
        return self.dense_layer_params(tp) + self.expert_layer_params(tp, ep)

    def embedding_params(self) -> int:
        """The embedding, the output layer when untied, and the final norm."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    def num_params(self) -> float:
        """Every parameter of the model (a mixture of experts: every expert of every layer)."""
        return self.num_layers * self.layer_params() + self.embedding_params()

    def active_params(self) -> float:
        """The parameters one token goes through: a mixture of experts' attention, norms and router and its
        `experts_per_token` experts of each layer, the embeddings (a dense model: num_params)."""
        per_layer = self.dense_layer_params() + self.experts_per_token * self.expert_params()
        return self.num_layers * per_layer + self.embedding_params()

    def largest_module_params(self, tp: int) -> float:
        """The parameters of the largest module on one of `tp` ranks: embedding / lm_head, qkv, the fused gate_up
        (a dense MLP), or a mixture of experts' routed experts of one layer (vLLM's FusedMoE holds them as one
        module, w13 [E, 2 I_moe / tp, H] and w2 [E, H, I_moe / tp]) and its router (E x H, replicated)."""
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        if self.is_moe:
            sharded = [self.vocab_size, qkv_rows, self.num_experts * 3 * self.moe_intermediate_size]
            return max(max(rows * self.hidden_size for rows in sharded) / tp, self.num_experts * self.hidden_size)
        per_rank = [self.vocab_size, 2 * self.intermediate_size, qkv_rows, self.intermediate_size]
        return max(rows * self.hidden_size for rows in per_rank) / tp

    def kv_bytes_per_token(self, tp: int, dtype_bytes: int) -> float:
        """K and V of every layer for one token on one of `tp` ranks (vLLM keeps >= 1 KV head per rank)."""
        return 2 * self.num_layers * max(1.0, self.num_kv_heads / tp) * self.head_dim * dtype_bytes


@dataclass(frozen=True, kw_only=True)
class HFArch(Shape):
    """The student's architecture as the megatron actor reproduces it: its Shape, its family, and the numbers only the
    actor needs (norm epsilon, RoPE, init range)."""

    family: ModelFamily
    model_type: str
    rms_norm_eps: float
    rope_theta: float
    initializer_range: float = 0.02
    # Llama 3.x rope_type "llama3": (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
    llama3_rope: tuple[float, float, float, int] | None = None
    # A mixture of experts: the top-k routing weights renormalised to sum to 1 (HF norm_topk_prob).
    norm_topk_prob: bool = False

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads


_REQUIRED = object()


def config_field(config: Mapping[str, Any] | Any, key: str, default: Any = _REQUIRED) -> Any:
    """`key` of a config.json dict or of a transformers config object; KeyError naming it when required and absent."""
    value = config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)
    if value is _REQUIRED:
        raise KeyError(key)
    return value


class ModelFamily:
    """A dense decoder-only transformer with Llama's layer; each family module's class refines it."""

    # The HF config's model_type values this family covers.
    model_types: ClassVar[tuple[str, ...]] = ()
    # One decoder layer's tensors, in megatron's parameter order (a family whose layer depends on the model's numbers,
    # its experts, overrides `layer_tensors`).
    layer: ClassVar[tuple[LayerTensor, ...]] = DENSE_LAYER
    # The parameters transformers stacks over a layer's experts (the HF rollout engine's names for them); none when
    # its modeling code holds every checkpoint tensor as a parameter of its own.
    stacked: ClassVar[tuple[StackedTensor, ...]] = ()
    # An RMSNorm over each head's query and key (HF q_norm / k_norm, megatron q/k_layernorm).
    qk_layernorm: ClassVar[bool] = False
    # The MLP's gated activation (HF hidden_act): SwiGLU.
    activation: ClassVar[str] = "silu"

    def __repr__(self) -> str:
        return type(self).__name__

    # A family is its class: equal (and hashed) by type, so an HFArch compares equal after a pickle round trip.
    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def layer_tensors(self, arch: Shape) -> tuple[LayerTensor, ...]:
        """One decoder layer's tensors of the model `arch`, in megatron's parameter order (the unsharded layout: an
        expert under its global number)."""
        return self.layer

    # ------------------------------------------------------------------------- config.json

    def qkv_bias(self, config: Mapping[str, Any] | Any) -> bool:
        """Whether the q/k/v projections have biases (transformers' own default is false when the key is absent)."""
        return bool(config_field(config, "attention_bias", False))

    def shape(self, config: Mapping[str, Any] | Any) -> Shape:
        """The Shape from a config.json dict or a transformers config (Llama / Qwen2 / Qwen3 / Mistral field names).

        The one reading of a model's dense-transformer numbers: the memory plan's and the actor's (`read_arch` adds
        the fields only the actor needs, after its checks).
        """
        heads = int(config_field(config, "num_attention_heads"))
        hidden = int(config_field(config, "hidden_size"))
        return Shape(
            vocab_size=int(config_field(config, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(config_field(config, "intermediate_size")),
            num_layers=int(config_field(config, "num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(config_field(config, "num_key_value_heads", None) or heads),
            head_dim=int(config_field(config, "head_dim", None) or hidden // heads),
            # transformers' own default for these families is false when the key is absent.
            tie_word_embeddings=bool(config_field(config, "tie_word_embeddings", False)),
            qkv_bias=self.qkv_bias(config),
            qk_layernorm=self.qk_layernorm,
            max_position_embeddings=int(config_field(config, "max_position_embeddings", None) or 0),
        )

    def refuse(self, hf_config: Any) -> None:
        """Raise UnsupportedModelError for a feature of this family the megatron layer spec does not reproduce."""

    def read_arch(self, hf_config: Any) -> HFArch:
        """HFArch from a transformers config (or any object with its fields), accepting only what the megatron local
        layer spec reproduces exactly (UnsupportedModelError otherwise)."""
        if getattr(hf_config, "hidden_act", self.activation) != self.activation:
            raise UnsupportedModelError(
                f"hidden_act={hf_config.hidden_act!r}: only SwiGLU ({self.activation}) is supported"
            )
        rope = _rope_parameters(hf_config)
        if rope.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type={rope.get('rope_type')!r} (rope scaling) is not supported; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
        self.refuse(hf_config)
        # The dense-transformer numbers through the memory plan's reader (one reading of a config); the actor's own below.
        shape = self.shape(hf_config)
        return HFArch(
            # Shape's qkv_bias is the actor's after `refuse` turned down any bias the family's layer lacks.
            **dataclasses.asdict(shape),
            **self.actor_fields(hf_config, shape, rope),
        )

    def actor_fields(self, hf_config: Any, shape: Shape, rope: dict[str, Any]) -> dict[str, Any]:
        """The HFArch fields beyond the Shape: the numbers only the actor needs (a family adds its own)."""
        if shape.max_position_embeddings <= 0:
            raise UnsupportedModelError("model.student_path holds a config without max_position_embeddings")
        return {
            "family": self,
            "model_type": getattr(hf_config, "model_type", ""),
            "rms_norm_eps": float(hf_config.rms_norm_eps),
            "rope_theta": float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))),
            "initializer_range": float(getattr(hf_config, "initializer_range", 0.02)),
            "llama3_rope": _llama3_rope(rope),
        }

    # ------------------------------------------------------------------------- megatron

    def transformer_config(self, arch: HFArch) -> dict[str, Any]:
        """megatron TransformerConfig fields of this family's architecture (the run's parallel, precision and kernel
        fields are recipe_gkd/actor/mcore_model.py's, which maps `activation` to torch's function)."""
        return {
            "num_layers": arch.num_layers,
            "hidden_size": arch.hidden_size,
            "ffn_hidden_size": arch.intermediate_size,
            "num_attention_heads": arch.num_heads,
            "num_query_groups": arch.num_kv_heads,
            "kv_channels": arch.head_dim,
            "normalization": "RMSNorm",
            "layernorm_epsilon": arch.rms_norm_eps,
            "gated_linear_unit": True,
            "add_bias_linear": False,
            "add_qkv_bias": arch.qkv_bias,
            "qk_layernorm": self.qk_layernorm,
            "init_method_std": arch.initializer_range,
        }

    def layer_spec(self, arch: HFArch) -> dict[str, Any]:
        """The arguments of megatron's get_gpt_layer_local_spec for this family's decoder layer."""
        return {"normalization": "RMSNorm", "qk_layernorm": self.qk_layernorm}


def _llama3_rope(rope: dict[str, Any]) -> tuple[float, float, float, int] | None:
    """Llama 3.x's frequency-dependent RoPE scaling parameters (rope_type "llama3"), else None."""
    if rope.get("rope_type", "default") != "llama3":
        return None
    try:
        return (
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]),
        )
    except KeyError as err:
        raise UnsupportedModelError(
            f"rope_type='llama3' without {err.args[0]} in the model's rope parameters"
        ) from None


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    # transformers 5 keeps RoPE settings in `rope_parameters`; 4.x used rope_theta/rope_scaling.
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    return dict(params)
