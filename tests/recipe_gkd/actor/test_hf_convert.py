"""HF <-> megatron weight layout and TP sharding (pure torch: megatron itself is not imported).

The end-to-end checks (megatron logits == HF logits, the round trip through a real
GPTModel at TP=1 and TP=2 over gloo) live in tests/recipe_gkd/actor/test_megatron_actor.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from repo_paths import REPO_ROOT
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from recipe_gkd.actor import hf_arch, hf_convert, mcore_model
from recipe_gkd.models import HFArch, UnsupportedModelError, read_hf_arch
from recipe_gkd.parallel_layout import padded_vocab_size

SHAPE = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def llama(vocab: int = 101, kv_heads: int = 2, tied: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, num_key_value_heads=kv_heads, tie_word_embeddings=tied, **SHAPE)
    return LlamaForCausalLM(config)


def qwen2(kv_heads: int = 1) -> torch.nn.Module:
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=90, num_key_value_heads=kv_heads, **SHAPE))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    return model


def qwen3(kv_heads: int = 2, tied: bool = True) -> torch.nn.Module:
    """Qwen3: per-head q/k RMSNorm, a head_dim of its own (not hidden / heads), no biases."""
    torch.manual_seed(4)
    config = Qwen3Config(vocab_size=97, num_key_value_heads=kv_heads, head_dim=16, tie_word_embeddings=tied, **SHAPE)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # HF initialises the norms to 1: random ones make the q/k norm mapping real
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    return model


def hf_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


MODELS = {
    "llama_tied": lambda: llama(tied=True),
    "llama_untied": lambda: llama(tied=False),
    "llama_mha_untied": lambda: llama(kv_heads=4, tied=False),
    "qwen2_bias_kv1": qwen2,
    "qwen3_qknorm": qwen3,
    "qwen3_qknorm_untied": lambda: qwen3(tied=False),
}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("which", sorted(MODELS))
def test_round_trip_through_tp_shards_is_bitwise(which: str, tp: int) -> None:
    model = MODELS[which]()
    arch = read_hf_arch(model.config)
    hf_arch.check_parallel_layout(arch, tp)
    state = hf_params(model)
    full = hf_convert.hf_to_mcore_full(state, arch, tp)
    assert list(full) == hf_convert.mcore_param_names(arch)
    shards = {name: [hf_convert.shard_for_tp(name, t, r, tp) for r in range(tp)] for name, t in full.items()}
    for name, parts in shards.items():
        if hf_convert.partition_dim(name) is not None:
            assert sum(p.numel() for p in parts) == full[name].numel()
    rebuilt = {name: hf_convert.unshard_from_tp(name, parts) for name, parts in shards.items()}
    back = hf_convert.mcore_full_to_hf(rebuilt, arch)
    assert back.keys() == state.keys()  # tied: embed_tokens only, as HF's named_parameters
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_vocabulary_is_padded_to_a_multiple_of_tp() -> None:
    arch = read_hf_arch(llama(vocab=101, tied=False).config)
    full = hf_convert.hf_to_mcore_full(hf_params(llama(vocab=101, tied=False)), arch, tp_size=2)
    assert padded_vocab_size(101, 2) == 102
    assert padded_vocab_size(102, 2) == 102
    assert full[hf_convert.EMBEDDING].shape == (102, 48)
    assert full[hf_convert.OUTPUT_LAYER].shape == (102, 48)
    assert torch.all(full[hf_convert.OUTPUT_LAYER][101:] == 0)


def test_fused_qkv_is_interleaved_per_kv_group() -> None:
    """Rows tagged with their head: group g holds q heads 2g, 2g+1, then k_g, then v_g."""
    arch = read_hf_arch(llama(kv_heads=2).config)  # 4 q heads, 2 groups, head_dim 12
    dim = arch.head_dim
    q = torch.arange(4).repeat_interleave(dim)[:, None].float().expand(-1, 48)
    k = (10 + torch.arange(2)).repeat_interleave(dim)[:, None].float().expand(-1, 48)
    v = (20 + torch.arange(2)).repeat_interleave(dim)[:, None].float().expand(-1, 48)
    fused = hf_convert.fuse_qkv(q, k, v, arch)
    heads = fused[::dim, 0].tolist()
    assert heads == [0, 1, 10, 20, 2, 3, 11, 21]
    assert all(torch.equal(a, b) for a, b in zip(hf_convert.split_qkv(fused, arch), (q, k, v), strict=True))


def test_tp_shards_follow_megatron_layouts() -> None:
    arch = read_hf_arch(llama(kv_heads=2).config)
    gate = torch.arange(64.0)[:, None].expand(-1, 48)
    up = 100 + gate
    fc1 = torch.cat([gate, up])
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    rank1 = hf_convert.shard_for_tp(name, fc1, tp_rank=1, tp_size=2)
    # SwiGLU chunks the local output in two: each rank must hold [gate_r; up_r].
    assert rank1[:, 0].tolist() == list(range(32, 64)) + list(range(132, 164))
    proj = torch.arange(48.0 * 64).reshape(48, 64)
    assert torch.equal(hf_convert.shard_for_tp("x.self_attention.linear_proj.weight", proj, 1, 2), proj[:, 32:])
    norm = torch.ones(48)
    assert hf_convert.shard_for_tp("decoder.final_layernorm.weight", norm, 1, 2) is norm
    assert hf_convert.partition_dim("decoder.layers.3.self_attention.linear_qkv.bias") == 0
    del arch


def test_parallel_layout_errors_name_the_tp_key() -> None:
    arch = read_hf_arch(llama(kv_heads=2).config)
    with pytest.raises(UnsupportedModelError, match=r"actor\.megatron\.tp=3"):
        hf_arch.check_parallel_layout(arch, 3)
    hf_arch.check_parallel_layout(read_hf_arch(qwen2(kv_heads=1).config), 4)  # kv=1 < tp is fine


def test_pipeline_stages_must_split_the_layers_evenly() -> None:
    arch = read_hf_arch(llama().config)  # 2 layers
    hf_arch.check_parallel_layout(arch, 1, 2)
    with pytest.raises(UnsupportedModelError, match=r"actor\.megatron\.pp=3 must divide .*num_hidden_layers=2"):
        hf_arch.check_parallel_layout(arch, 1, 3)


def test_expert_parallelism_splits_a_mixture_of_experts_evenly_naming_the_ep_key() -> None:
    """ep > 1 needs experts, as many on every rank; a dense student's split checks keep their old call."""
    from transformers import Qwen3MoeConfig

    dense = read_hf_arch(llama().config)
    hf_arch.check_split(dense, 1, 1, 1)
    with pytest.raises(UnsupportedModelError, match=r"actor\.megatron\.ep=2 but the student is a dense model"):
        hf_arch.check_split(dense, 1, 1, 1, ep_size=2)
    moe = Qwen3MoeConfig(
        vocab_size=97,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=18,
        **{**SHAPE, "intermediate_size": 5},
    )
    arch = read_hf_arch(moe)
    for ep in (1, 2, 3, 6):
        hf_arch.check_split(arch, 1, 1, 1, ep_size=ep)
    with pytest.raises(UnsupportedModelError, match=r"actor\.megatron\.ep=4 must divide the student's num_experts=6"):
        hf_arch.check_split(arch, 1, 1, 1, ep_size=4)
    # TP shards each expert's moe_intermediate_size (18), not the config's unused dense intermediate_size (5) ...
    hf_arch.check_parallel_layout(arch, 2, 1)
    with pytest.raises(UnsupportedModelError, match=r"actor\.megatron\.tp=4 must divide .*moe_intermediate_size=18"):
        hf_arch.check_parallel_layout(arch, 4, 1)
    # ... but the actor trains a mixture of experts at TP=1 (megatron's MoE layer needs sequence parallelism).
    with pytest.raises(UnsupportedModelError, match=r"actor\.megatron\.tp=2 with a mixture-of-experts student"):
        hf_arch.check_split(arch, 2, 1, 1)


def test_a_context_parallel_size_the_zigzag_split_does_not_take_is_refused_naming_the_key() -> None:
    for cp in (1, 2, 4, 8):
        hf_arch.check_context_parallel(cp)
    with pytest.raises(UnsupportedModelError, match=r"actor\.megatron\.cp=3: choose one of \(1, 2, 4, 8\)"):
        hf_arch.check_context_parallel(3)


def six_layer_arch(tied: bool) -> HFArch:
    config = LlamaConfig(vocab_size=101, tie_word_embeddings=tied, **{**SHAPE, "num_hidden_layers": 6})
    return read_hf_arch(config)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("pp", [1, 2, 3, 6])
def test_pipeline_stages_partition_the_model(tied: bool, pp: int) -> None:
    """Every parameter lives on exactly one stage (its owner), under a name with the stage's local layer number."""
    arch = six_layer_arch(tied)
    stages = [hf_convert.stage_param_names(arch, rank, pp) for rank in range(pp)]
    owned = [{g for local, g in stage.items() if local == g or g != hf_convert.EMBEDDING} for stage in stages]
    assert sorted(g for names in owned for g in names) == sorted(hf_convert.mcore_param_names(arch))
    for rank, names in enumerate(owned):
        assert all(hf_convert.owner_stage(g, arch, pp) == rank for g in names)
    for rank, stage in enumerate(stages):
        layers = hf_convert.stage_layers(arch, rank, pp)
        for local, g in stage.items():
            if g.startswith("decoder.layers."):
                assert hf_convert.layer_index(g) == layers.start + hf_convert.layer_index(local)
                assert local.split(".", 3)[3] == g.split(".", 3)[3]
    assert hf_convert.EMBEDDING in stages[0] and hf_convert.FINAL_NORM in stages[-1]
    # Tied and pipelined: the last stage holds a copy of the embedding as its output layer.
    copy = stages[-1].get(hf_convert.OUTPUT_LAYER)
    assert copy == (hf_convert.EMBEDDING if tied and pp > 1 else None if tied else hf_convert.OUTPUT_LAYER)


def read_all(model_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    reader = hf_convert.HFCheckpointReader(model_dir)
    return {name: reader.read(name) for name in names}


def test_checkpoint_reader_reads_safetensors(tmp_path: Path) -> None:
    model = llama(tied=False)
    model.save_pretrained(tmp_path)
    state = read_all(tmp_path, list(hf_params(model)))
    for name, tensor in hf_params(model).items():
        assert torch.equal(state[name], tensor)
    with pytest.raises(FileNotFoundError, match=r"model\.student_path"):
        hf_convert.HFCheckpointReader(tmp_path / "missing")


def test_importing_the_actor_does_not_import_megatron() -> None:
    code = (
        "import sys, recipe_gkd, recipe_gkd.actor.megatron_actor, recipe_gkd.actor.hf_convert, recipe_gkd.actor.hf_arch, recipe_gkd.actor.mcore_model;"
        "bad = [m for m in sys.modules if m.startswith('megatron')]; assert not bad, bad"
    )
    root = REPO_ROOT
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=120)


def test_checkpoint_reader_follows_a_sharded_index(tmp_path: Path) -> None:
    model = llama(tied=False)
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / hf_arch.SAFETENSORS_INDEX).is_file()
    (tmp_path / "adapter_model.safetensors").write_bytes(b"not part of the model")
    state = read_all(tmp_path, list(hf_params(model)))
    for name, tensor in hf_params(model).items():
        assert torch.equal(state[name], tensor)


@pytest.mark.parametrize(("tied", "tp", "pp"), [(False, 2, 2), (True, 1, 2), (True, 2, 1)])
def test_a_rank_reads_only_its_stage_and_gets_its_shards(tmp_path: Path, tied: bool, tp: int, pp: int) -> None:
    """load_stage_shards == slicing the full conversion, and it reads no tensor of another stage."""
    model = llama(tied=tied)
    model.save_pretrained(tmp_path, max_shard_size="50KB")  # several files behind an index
    arch = read_hf_arch(model.config)
    full = hf_convert.hf_to_mcore_full(hf_params(model), arch, tp)
    for stage in range(pp):
        names = list(hf_convert.stage_param_names(arch, stage, pp).values())
        for tp_rank in range(tp):
            reader = hf_convert.HFCheckpointReader(tmp_path)
            shards = hf_convert.load_stage_shards(reader, arch, names, tp_rank, tp)
            assert set(shards) == set(names)
            for name in names:
                assert torch.equal(shards[name], hf_convert.shard_for_tp(name, full[name], tp_rank, tp)), name
            layers = hf_convert.stage_layers(arch, stage, pp)
            other = [i for i in range(arch.num_layers) if i not in layers]
            read_layers = {int(n.split(".")[2]) for n in reader.read_names if n.startswith("model.layers.")}
            assert read_layers == set(layers) and not read_layers & set(other)
            assert ("model.embed_tokens.weight" in reader.read_names) == (stage == 0 or (tied and stage == pp - 1))
            assert ("model.norm.weight" in reader.read_names) == (stage == pp - 1)
    assert hf_convert.HFCheckpointReader(tmp_path).numel("model.norm.weight") == arch.hidden_size
    with pytest.raises(KeyError, match=r"model\.student_path"):
        hf_convert.HFCheckpointReader(tmp_path).read("model.nope")


@pytest.mark.parametrize(
    ("recompute", "attention", "expected"),
    [
        ("none", "sdpa", {"recompute_granularity": None}),
        ("selective", "sdpa", {"recompute_granularity": "selective", "recompute_modules": ["mlp"]}),
        ("selective", "unfused", {"recompute_granularity": "selective", "recompute_modules": ["mlp", "core_attn"]}),
        (
            "full",
            "sdpa",
            {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        ),
    ],
)
def test_recompute_setting_maps_to_megatrons_fields(recompute: str, attention: str, expected: dict) -> None:
    assert mcore_model.recompute_settings(recompute, attention) == expected


def test_the_drivers_json_read_refuses_what_the_actor_refuses(tmp_path: Path) -> None:
    from transformers import MistralConfig

    MistralConfig(sliding_window=4096, **SHAPE).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="sliding_window=4096"):
        hf_arch.read_student_arch(tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"has no config\.json"):
        hf_arch.read_student_arch(tmp_path / "missing")


def test_a_config_without_max_position_embeddings_is_refused_by_name(tmp_path: Path) -> None:
    """The plan's reader takes a missing max_position_embeddings as 0 (unknown); the actor needs it for RoPE."""
    from transformers import LlamaConfig

    LlamaConfig(**SHAPE).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="max_position_embeddings"):
        hf_arch.read_student_arch(tmp_path)


def qwen3_moe_checkpoint(out: Path) -> tuple[HFArch, dict[str, torch.Tensor]]:
    """A tiny Qwen3-MoE saved as transformers saves it (per-expert names), and its saved tensors."""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(6)
    config = Qwen3MoeConfig(
        vocab_size=97, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, norm_topk_prob=True, tie_word_embeddings=False, **SHAPE,
    )  # fmt: skip
    Qwen3MoeForCausalLM(config).save_pretrained(out)
    return read_hf_arch(config), load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize(("tp", "ep"), [(1, 2), (2, 2), (1, 4)])
def test_an_expert_parallel_rank_reads_and_holds_only_its_experts(tmp_path: Path, tp: int, ep: int) -> None:
    """Every megatron tensor of a Qwen3-MoE is on exactly one expert-parallel rank or on all (the dense ones),
    global expert = ep_rank x E/EP + local; a rank reads the HF tensors of its experts only; the whole conversion
    round-trips HF -> megatron -> HF bit-exactly, one expert per export unit."""
    arch, saved = qwen3_moe_checkpoint(tmp_path)
    full = hf_convert.hf_to_mcore_full(saved, arch, tp)
    holders: dict[str, list[int]] = {}
    for ep_rank in range(ep):
        names = hf_convert.stage_param_names(arch, 0, 1, ep_rank, ep)
        for local, global_name in names.items():
            holders.setdefault(global_name, []).append(ep_rank)
            if ".local_experts." in local:  # local l on rank r is global r x E/EP + l
                local_e = int(local.split(".local_experts.")[1].split(".")[0])
                global_e = int(global_name.split(".local_experts.")[1].split(".")[0])
                assert global_e == ep_rank * (arch.num_experts // ep) + local_e
        reader = hf_convert.HFCheckpointReader(tmp_path)
        shards = hf_convert.load_stage_shards(reader, arch, list(names.values()), tp - 1, tp)
        for name, shard in shards.items():
            assert torch.equal(shard, hf_convert.shard_for_tp(name, full[name], tp - 1, tp)), name
        read_experts = {int(n.split(".experts.")[1].split(".")[0]) for n in reader.read_names if ".experts." in n}
        assert read_experts == set(range(ep_rank * (arch.num_experts // ep), (ep_rank + 1) * (arch.num_experts // ep)))
    assert holders.keys() == full.keys()
    for name, ranks in holders.items():
        assert ranks == ([ranks[0]] if ".local_experts." in name else list(range(ep))), name
    units = hf_convert.mcore_units(arch)
    assert "decoder.layers.1.mlp.experts.local_experts.3" in units and len(units) == 3 + arch.num_layers * 5
    back = hf_convert.mcore_full_to_hf(full, arch)
    assert back.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(back[name], tensor), name


def test_a_mixture_of_experts_is_refused_at_context_parallel() -> None:
    from transformers import Qwen3MoeConfig

    moe = Qwen3MoeConfig(
        vocab_size=97, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, **SHAPE,
    )  # fmt: skip
    arch = read_hf_arch(moe)
    hf_arch.check_split(arch, 1, 1, 1, ep_size=2)
    with pytest.raises(UnsupportedModelError, match=r"actor\.megatron\.cp=2 with a mixture-of-experts student"):
        hf_arch.check_split(arch, 1, 1, 2)
    hf_arch.check_split(read_hf_arch(qwen3().config), 1, 1, 2)  # a dense student at CP=2
