"""A LoRA student's memory-plan figures (recipe_gkd.plan.lora_memory and its lines in recipe_gkd.plan.memory_plan),
against counts written out by hand for a tiny Qwen3 of known sizes at rank 8, TP 1 and 2.

The tiny Qwen3: hidden 64, intermediate 160, 2 layers, 4 heads and 2 KV heads of 16, vocabulary 1000, untied. Its
fused linears (in -> out): qkv 64 -> (4 + 2 x 2) x 16 = 128, proj 64 -> 64, fc1 64 -> 2 x 160 = 320, fc2 160 -> 64.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from recipe_gkd.config import CONFIG_DIR, ConfigError, load_config
from recipe_gkd.config.derived import vllm_max_lora_rank
from recipe_gkd.config.schema import LoRAConfig
from recipe_gkd.models import shape_from_config
from recipe_gkd.plan import lora_memory, memory_plan

TINY_QWEN3 = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 1000,
    "tie_word_embeddings": False,
    "max_position_embeddings": 8192,
}
SHAPE = shape_from_config(TINY_QWEN3)
RANK8 = LoRAConfig(rank=8)
# Four actor GPUs, rollout engines at TP 1 (the plan's own config rules hold with the tiny model's shape).
PRESET = CONFIG_DIR / "presets" / "1x8_a4_r4_t0_remote.yaml"
ONE_GPU_LORA = CONFIG_DIR / "presets" / "1x1_colocated_lora.yaml"
# A micro-batch of tokens (above the preset's longest sequence).
TOKENS = 8192

# ---- the hand counts (rank 8), one decoder layer ----
# Actor, TP 1: A [8, in] + B [out, 8] on each fused linear.
ACTOR_TP1 = (8 * 64 + 128 * 8) + (8 * 64 + 64 * 8) + (8 * 64 + 320 * 8) + (8 * 160 + 64 * 8)  # = 7424
# Actor, TP 2: qkv and fc1 (column-parallel) keep A whole and halve B; proj and fc2 (row-parallel) halve A, keep B.
ACTOR_TP2 = (8 * 64 + 64 * 8) + (8 * 32 + 64 * 8) + (8 * 64 + 160 * 8) + (8 * 80 + 64 * 8)  # = 4736
# vLLM, TP 1, one slot at max_lora_rank 8: q, k, v slices with an A each; gate and up likewise.
VLLM_TP1 = (3 * 8 * 64 + (64 + 32 + 32) * 8) + (8 * 64 + 64 * 8) + (2 * 8 * 64 + 2 * 160 * 8) + (8 * 160 + 64 * 8)
# vLLM, TP 2: B of q/k/v and gate/up their shard's rows, A of o_proj and down_proj their shard's columns.
VLLM_TP2 = (3 * 8 * 64 + (32 + 16 + 16) * 8) + (8 * 32 + 64 * 8) + (2 * 8 * 64 + 2 * 80 * 8) + (8 * 80 + 64 * 8)
# vLLM, TP 4: one query head a GPU; the 2 KV heads replicated, one on each GPU (vLLM keeps at least one).
VLLM_TP4 = (3 * 8 * 64 + (16 + 16 + 16) * 8) + (8 * 16 + 64 * 8) + (2 * 8 * 64 + 2 * 40 * 8) + (8 * 40 + 64 * 8)
# vLLM's embedding (A [1000, 8], B [64, 8]) and LM head (A [8, 64], B [1000, 8]), whole on every GPU.
VLLM_HEADS = (1000 * 8 + 64 * 8) + (8 * 64 + 1000 * 8)
# punica: four int64 [16384] and three int64 [1024]; two kernel metas of two int32 [16384] and int32 [2], [2], [3].
PUNICA = 4 * 16384 * 8 + 3 * 1024 * 8 + 2 * (2 * 16384 * 4 + (2 + 2 + 3) * 4)


@pytest.fixture(autouse=True)
def no_gpu_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("recipe_gkd.plan.gpu_memory.query_gpus", lambda: None)


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3))
    return tmp_path


def test_the_actors_adapters_at_tp_1_and_2_against_a_hand_count() -> None:
    assert ACTOR_TP1 == 7424 and ACTOR_TP2 == 4736
    assert lora_memory.actor_adapter_params(SHAPE, RANK8, 1) == ACTOR_TP1
    assert lora_memory.actor_adapter_params(SHAPE, RANK8, 2) == ACTOR_TP2
    # One target: fc2 alone (row-parallel), A [8, 160 / 2] + B [64, 8].
    assert lora_memory.actor_adapter_params(SHAPE, LoRAConfig(rank=8, targets=["fc2"]), 2) == 8 * 80 + 64 * 8


def test_the_sync_form_counts_every_hf_projection_of_a_transformers_qwen3() -> None:
    """The sync form (PEFT's names and shapes) against transformers' own Qwen3 modules: r x in + out x r for each
    q/k/v/o/gate/up/down projection, read off the nn.Linear layers (an independent route to the shapes)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = {k: v for k, v in TINY_QWEN3.items() if k != "model_type"}
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**fields))
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    linears = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in projections]
    assert len(linears) == 2 * 7
    reference = sum(8 * m.in_features + m.out_features * 8 for m in linears)
    assert lora_memory.sync_adapter_params(SHAPE, RANK8) == reference == 2 * 8960


def test_vllms_slots_at_tp_1_and_2_against_a_hand_count() -> None:
    assert VLLM_TP1 == 8960 and VLLM_TP2 == 6272 and VLLM_TP4 == 5056 and VLLM_HEADS == 17024 and PUNICA == 811064
    for tp, layer in ((1, VLLM_TP1), (2, VLLM_TP2), (4, VLLM_TP4)):
        assert lora_memory.vllm_layer_slot_params(SHAPE, 8, tp) == layer
        slots = lora_memory.vllm_lora_slots(SHAPE, 8, tp, 2, 16384)
        assert slots == (2 * layer + VLLM_HEADS) * 2 + PUNICA  # bf16, one slot
    # fp32 engines hold their slots in fp32 (lora_dtype auto: the model's).
    assert lora_memory.vllm_lora_slots(SHAPE, 8, 1, 4, 16384) == (2 * VLLM_TP1 + VLLM_HEADS) * 4 + PUNICA


def test_vllm_preallocates_at_the_smallest_rank_it_serves() -> None:
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 32, 33, 300, 320, 321, 512)] == [
        1, 8, 8, 16, 32, 64, 320, 320, 512, 512
    ]  # fmt: skip
    with pytest.raises(ValueError):
        vllm_max_lora_rank(513)


def test_a_rank_above_vllms_largest_is_refused_naming_the_rank() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(PRESET, ["actor.lora.rank=600"])
    assert err.value.key == "actor.lora.rank" and "512" in err.value.message


def test_the_adapters_activations_against_a_hand_count() -> None:
    """Each adapter keeps A x: 8 values a token in bf16; selective recompute recomputes the MLP's two adapters, full
    all four; dropout (TP 1) adds the dropped input and its bool mask, 3 bytes per input value."""
    per_token = lora_memory.adapter_activation_bytes
    assert per_token(SHAPE, RANK8, 1, 2, "none") == 4 * 8 * 2
    assert per_token(SHAPE, RANK8, 1, 2, "selective") == 2 * 8 * 2
    assert per_token(SHAPE, RANK8, 1, 2, "full") == 0
    dropout = LoRAConfig(rank=8, dropout=0.1)
    assert per_token(SHAPE, dropout, 1, 2, "none") == 4 * 8 * 2 + (64 + 64 + 64 + 160) * 3


def _actor(tiny_dir: Path, *overrides: str) -> dict[str, float]:
    cfg = load_config(PRESET, [f"model.student_path={tiny_dir}", *overrides])
    return dict(memory_plan.actor_memory(cfg, SHAPE).parts)


def _part(parts: dict[str, float], prefix: str) -> float:
    (value,) = [b for name, b in parts.items() if name.startswith(prefix)]
    return value


@pytest.mark.parametrize(("tp", "per_layer"), [(1, ACTOR_TP1), (2, ACTOR_TP2)])
def test_the_actor_rank_holds_a_frozen_base_and_the_adapters_whole_state(
    tiny_dir: Path, tp: int, per_layer: int
) -> None:
    """bf16, distributed optimizer over dp = 4 / tp: adapter weights 2 B, gradients 4 B, master + moments 12 / dp B a
    parameter; the base keeps the full student's weights line and nothing else."""
    dp = 4 // tp
    adapter = 2 * per_layer  # two layers
    split = [f"actor.megatron.tp={tp}", f"actor.max_tokens_per_micro_batch={TOKENS}"]
    full = _actor(tiny_dir, *split)
    lora = _actor(tiny_dir, *split, "actor.lora.rank=8")
    assert _part(lora, "base weights (bf16") == _part(full, "weights (bf16")
    assert "frozen: no gradient buffer, no optimizer state" in next(n for n in lora if n.startswith("base weights"))
    assert _part(lora, "LoRA adapters (bf16, rank 8 on qkv, proj, fc1, fc2 of 2 layers") == adapter * 2
    assert _part(lora, "adapter gradient buffer (fp32)") == adapter * 4
    optimizer = _part(
        lora, f"adapter optimizer state (fp32 master + Adam moments, distributed over data parallel {dp})"
    )
    assert optimizer == adapter * 12 / dp
    assert not [n for n in lora if n.startswith(("gradient buffer", "optimizer state"))]
    # One micro-batch in flight (pp 1) of TOKENS tokens x 2 layers: each of the 4 adapters' A x, 8 bf16 values.
    assert _part(lora, "adapter activations") == TOKENS * 2 * 4 * 8 * 2
    # The rest of the rank is the full student's: the same activations and logits.
    assert _part(lora, "activations (") == _part(full, "activations (")
    assert _part(lora, "logits and loss") == _part(full, "logits and loss")


def test_full_recompute_keeps_the_recomputed_layers_adapter_activations(tiny_dir: Path) -> None:
    parts = _actor(
        tiny_dir, "actor.lora.rank=8", "actor.megatron.recompute=full", f"actor.max_tokens_per_micro_batch={TOKENS}"
    )
    assert _part(parts, "adapter activations") == TOKENS * 4 * 8 * 2  # one layer's, recomputed at "none"


def test_a_lora_rollout_engine_holds_its_slots_in_its_share_and_reloads_no_layer(tiny_dir: Path) -> None:
    """The slots come out of the KV cache (the share is fixed); outside the share an adapter update replaces the
    in-place reload's layer; the sync notes the adapter's object store (256 MiB: the least Ray's store is given)."""
    student = f"model.student_path={tiny_dir}"
    plans = {r: memory_plan.build_memory_plan(load_config(PRESET, [student, f"actor.lora.rank={r}"])) for r in (0, 5)}
    rollout = {r: next(x for x in p.roles if x.role == "rollout GPU") for r, p in plans.items()}  # type: ignore[union-attr]
    slots = _part(dict(rollout[5].parts), "LoRA slots (max_lora_rank 8, max_loras 1, bf16")
    assert slots == (2 * VLLM_TP1 + VLLM_HEADS) * 2 + PUNICA  # rank 5 is served at vLLM's rank 8
    assert rollout[0].parts[-1][1] - rollout[5].parts[-1][1] == pytest.approx(slots)  # the KV cache
    assert not any(n.startswith("LoRA slots") for n, _ in rollout[0].parts)
    outside = dict(rollout[5].outside)
    assert _part(outside, "adapter update: one version") == 2 * 8960 * 5 / 8 * 2  # the sync form at rank 5, bf16
    assert not any(n.startswith("in-place reload") for n in outside)
    assert any(n.startswith("in-place reload") for n, _ in rollout[0].outside)
    assert any("weight sync: the LoRA adapter alone" in n and "0.25 GiB" in n for n in rollout[5].notes)
    assert any("CPU cache of adapters (max_cpu_loras 1)" in n for n in rollout[5].notes)


def test_the_object_store_is_sized_for_the_adapter_not_the_student(tmp_path: Path) -> None:
    """Twice one version + 128 MiB: Qwen3-8B's bf16 export (8.19B params, 30.6 GiB in all) against its rank-32
    adapter's sync form: per layer q/k/v's three A [32, 4096] and B [6144, 32], o's A [32, 4096] and B [4096, 32],
    gate/up's two A [32, 4096] and B [24576, 32], down's A [32, 12288] and B [4096, 32], x 36 layers."""
    qwen3_8b = {**TINY_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36}
    qwen3_8b.update(num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936)
    (tmp_path / "config.json").write_text(json.dumps(qwen3_8b))
    per_layer = (3 * 32 * 4096 + 6144 * 32) + (32 * 4096 + 4096 * 32) + (2 * 32 * 4096 + 24576 * 32)
    per_layer += 32 * 12288 + 4096 * 32
    adapter_mib = 36 * per_layer * 2 / 2**20
    student = f"model.student_path={tmp_path}"
    lora = memory_plan.object_store_mib(load_config(ONE_GPU_LORA, [student]))
    full = memory_plan.object_store_mib(load_config(ONE_GPU_LORA, [student, "actor.lora.rank=0"]))
    assert lora == math.ceil(2 * adapter_mib) + 128 == 461
    assert full == math.ceil(2 * shape_from_config(qwen3_8b).num_params() * 2 / 2**20) + 128
    assert full / 1024 == pytest.approx(30.6, abs=0.05)


def test_a_mixture_of_experts_with_adapters_is_refused_naming_the_rank(tiny_dir: Path) -> None:
    moe = shape_from_config(
        {
            **TINY_QWEN3,
            "model_type": "qwen3_moe",
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        }
    )
    cfg = load_config(PRESET, [f"model.student_path={tiny_dir}", "actor.lora.rank=8"])
    with pytest.raises(ConfigError) as err:
        memory_plan.actor_memory(cfg, moe)
    assert err.value.key == "actor.lora.rank"
