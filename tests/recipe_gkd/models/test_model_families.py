"""The model families: each reads its config once (the plan's Shape and the actor's HFArch), refuses what the megatron
layer spec does not reproduce, and lists exactly the HF tensors of its decoder layer."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from recipe_gkd.actor.hf_arch import read_student_arch
from recipe_gkd.models import (
    DENSE,
    FAMILIES,
    SUPPORTED_MODEL_TYPES,
    HFArch,
    ModelFamily,
    Shape,
    UnsupportedModelError,
    family_of,
    read_hf_arch,
    shape_from_config,
)
from recipe_gkd.models.base import HF_LAYER

SHAPE = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)

CONFIGS = {
    "llama": lambda: LlamaConfig(vocab_size=101, num_key_value_heads=2, **SHAPE),
    "mistral": lambda: MistralConfig(vocab_size=101, sliding_window=None, **SHAPE),
    "qwen2": lambda: Qwen2Config(vocab_size=90, num_key_value_heads=1, **SHAPE),
    "qwen3": lambda: Qwen3Config(vocab_size=97, num_key_value_heads=2, head_dim=16, **SHAPE),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        vocab_size=97,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=True,
        **SHAPE,
    ),
}


def test_the_registry_covers_the_supported_model_types_once() -> None:
    assert SUPPORTED_MODEL_TYPES == ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
    assert sorted(CONFIGS) == sorted(SUPPORTED_MODEL_TYPES)
    assert all(family_of(t) is f for f in FAMILIES for t in f.model_types)
    assert family_of("gpt2") is None


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_a_familys_layer_table_is_exactly_hfs_decoder_layer(model_type: str, tmp_path: Path) -> None:
    """The checkpoint transformers saves of its own model of the config (an independent listing; a Qwen3-MoE model
    holds its experts fused and saves them per expert, as hub checkpoints ship them) has the tensors the family's
    table names."""
    from safetensors import safe_open

    config = CONFIGS[model_type]()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as saved:
        names = list(saved.keys())
    prefix = HF_LAYER.format(i=0)
    hf_layer = [name[len(prefix) :] for name in names if name.startswith(prefix)]
    arch = read_hf_arch(config)
    family, table = arch.family, arch.family.layer_tensors(arch)
    assert family is family_of(model_type)
    assert sorted(name for tensor in table for name in tensor.hf) == sorted(hf_layer)
    # Each table lists the megatron tensors once.
    assert len({tensor.mcore for tensor in table}) == len(table)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_the_plans_shape_and_the_actors_arch_are_one_reading(model_type: str) -> None:
    config = CONFIGS[model_type]()
    arch = read_hf_arch(config)
    shape = shape_from_config(config.to_dict())
    assert isinstance(arch, Shape) and shape == Shape(
        **{f.name: getattr(arch, f.name) for f in dataclasses.fields(Shape)}
    )
    assert arch.qkv_bias == (model_type == "qwen2") and arch.qk_layernorm == model_type.startswith("qwen3")
    assert (arch.num_experts, arch.experts_per_token) == ((4, 2) if model_type == "qwen3_moe" else (0, 0))


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(lambda: LlamaConfig(**SHAPE), id="llama"),
        pytest.param(lambda: LlamaConfig(tie_word_embeddings=False, **SHAPE), id="llama-untied"),
        pytest.param(lambda: LlamaConfig(rope_parameters=LLAMA3_ROPE, **SHAPE), id="llama3.1-rope"),
        pytest.param(lambda: MistralConfig(sliding_window=None, **SHAPE), id="mistral"),
        pytest.param(lambda: Qwen2Config(**SHAPE), id="qwen2"),
        pytest.param(lambda: Qwen3Config(**SHAPE), id="qwen3"),
        pytest.param(CONFIGS["qwen3_moe"], id="qwen3_moe"),
    ],
)
def test_the_drivers_json_read_equals_the_actors_autoconfig_read(config, tmp_path: Path) -> None:
    """The driver checks the student from config.json without transformers (hf_arch.read_student_arch); the actor
    reads it via AutoConfig: one family, one reading."""
    from transformers import AutoConfig

    config().save_pretrained(tmp_path)
    assert read_student_arch(tmp_path) == read_hf_arch(AutoConfig.from_pretrained(tmp_path))


def test_an_arch_survives_a_pickle_round_trip() -> None:
    """A family compares by its class: an HFArch sent to another process equals the one read here."""
    arch = read_hf_arch(CONFIGS["qwen3"]())
    assert pickle.loads(pickle.dumps(arch)) == arch
    assert repr(arch.family) == "Qwen3"


def test_a_model_of_no_family_is_read_as_a_dense_model_for_the_plan() -> None:
    config = {"model_type": "gemma", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128}
    config |= {"num_hidden_layers": 2, "num_attention_heads": 4, "attention_bias": True}
    shape = shape_from_config(config)
    assert shape.qkv_bias and not shape.qk_layernorm and shape.head_dim == 16 and shape.num_kv_heads == 4
    assert type(DENSE) is ModelFamily and shape == DENSE.shape(config)
    with pytest.raises(KeyError, match="vocab_size"):
        shape_from_config({k: v for k, v in config.items() if k != "vocab_size"})


def test_qwen2_has_qkv_biases_whatever_its_config_says() -> None:
    shape = shape_from_config({**CONFIGS["qwen2"]().to_dict(), "attention_bias": False})
    assert shape.qkv_bias


# Llama 3.1/3.2's frequency-dependent RoPE scaling.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_llama3_rope_scaling_is_read_whole() -> None:
    rope = dict(LLAMA3_ROPE)
    arch = read_hf_arch(LlamaConfig(rope_parameters=rope, **SHAPE))
    assert arch.llama3_rope == (32.0, 1.0, 4.0, 8192) and arch.rope_theta == 5e5
    assert read_hf_arch(LlamaConfig(**SHAPE)).llama3_rope is None
    del rope["low_freq_factor"]
    with pytest.raises(UnsupportedModelError, match="rope_type='llama3' without low_freq_factor"):
        read_hf_arch(_with(LlamaConfig(**SHAPE), rope_parameters=rope))  # transformers' own check is on __init__


def test_read_hf_arch_reads_gqa_rope_and_bias() -> None:
    config = CONFIGS["qwen2"]()
    assert read_hf_arch(config) == HFArch(
        family=family_of("qwen2"),  # type: ignore[arg-type]
        model_type="qwen2",
        vocab_size=90,
        hidden_size=48,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=12,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_parameters["rope_theta"],
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        qkv_bias=True,
        initializer_range=0.02,
    )


def _with(config: PretrainedConfig, **change: object) -> PretrainedConfig:
    for key, value in change.items():
        setattr(config, key, value)
    return config


# Each refusal and its whole message, as the actor and the driver print them.
REFUSED = [
    (lambda: _with(LlamaConfig(**SHAPE), hidden_act="gelu"), "hidden_act='gelu': only SwiGLU (silu) is supported"),
    (
        lambda: _with(LlamaConfig(**SHAPE), rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
        "rope_type='linear' (rope scaling) is not supported; supported: ('default', 'llama3')",
    ),
    (
        lambda: _with(LlamaConfig(**SHAPE), rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5}),
        "partial_rotary_factor != 1 is not supported",
    ),
    (lambda: LlamaConfig(attention_bias=True, **SHAPE), "Llama attention_bias / mlp_bias = true is not supported"),
    (lambda: LlamaConfig(mlp_bias=True, **SHAPE), "Llama attention_bias / mlp_bias = true is not supported"),
    (
        lambda: MistralConfig(attention_bias=True, sliding_window=None, **SHAPE),
        "Llama attention_bias / mlp_bias = true is not supported",
    ),
    (
        lambda: MistralConfig(sliding_window=4096, **SHAPE),
        "mistral sliding_window=4096 is not supported (only null)",
    ),
    (lambda: Qwen2Config(use_sliding_window=True, **SHAPE), "qwen2 use_sliding_window=true is not supported"),
    (lambda: Qwen3Config(use_sliding_window=True, **SHAPE), "qwen3 use_sliding_window=true is not supported"),
    (lambda: Qwen3Config(attention_bias=True, **SHAPE), "Qwen3 attention_bias=true is not supported"),
    (
        lambda: _with(LlamaConfig(**SHAPE), model_type="gpt2"),
        "model.student_path holds a 'gpt2' model; the megatron actor supports ('llama', 'mistral', 'qwen2', 'qwen3', 'qwen3_moe')",
    ),
    (
        lambda: _with(CONFIGS["qwen3_moe"](), mlp_only_layers=[1]),
        "Qwen3-MoE with dense layers (decoder_sparse_step=1, mlp_only_layers=[1]) is not supported: "
        "the megatron actor builds experts in every layer",
    ),
    (
        lambda: _with(CONFIGS["qwen3_moe"](), decoder_sparse_step=2),
        "Qwen3-MoE with dense layers (decoder_sparse_step=2, mlp_only_layers=[]) is not supported: "
        "the megatron actor builds experts in every layer",
    ),
    (
        lambda: _with(LlamaConfig(**SHAPE), model_type="qwen2_moe"),
        "model.student_path holds a 'qwen2_moe' model; the megatron actor supports "
        "('llama', 'mistral', 'qwen2', 'qwen3', 'qwen3_moe')",
    ),
    (
        lambda: _with(LlamaConfig(**SHAPE), max_position_embeddings=0),
        "model.student_path holds a config without max_position_embeddings",
    ),
]


@pytest.mark.parametrize(("config", "message"), REFUSED)
def test_what_the_layer_spec_does_not_reproduce_is_refused_by_name(config, message: str) -> None:
    with pytest.raises(UnsupportedModelError) as caught:
        read_hf_arch(config())
    assert str(caught.value) == message


def test_a_config_object_without_a_model_type_is_refused() -> None:
    class Gpt2Like:
        model_type = "gpt2"

    with pytest.raises(UnsupportedModelError, match=r"model\.student_path"):
        read_hf_arch(Gpt2Like())


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_each_familys_megatron_fields_are_transformer_config_fields(model_type: str) -> None:
    from megatron.core.transformer import TransformerConfig

    arch = read_hf_arch(CONFIGS[model_type]())
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert set(arch.family.transformer_config(arch)) <= fields
    assert arch.family.transformer_config(arch)["add_qkv_bias"] == arch.qkv_bias
    assert arch.family.layer_spec(arch)["qk_layernorm"] == arch.qk_layernorm


def test_the_specs_and_the_layout_import_neither_torch_nor_megatron() -> None:
    """The driver reads the student's family before anything starts (a dry run imports no torch)."""
    import subprocess
    import sys

    from repo_paths import REPO_ROOT

    code = (
        "import sys, recipe_gkd.models, recipe_gkd.parallel_layout, recipe_gkd.actor.hf_arch, recipe_gkd.plan.model_shape;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'transformers')]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, timeout=120)
