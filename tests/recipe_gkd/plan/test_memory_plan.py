"""The per-GPU memory plan (recipe_gkd.plan.memory_plan) and --dry-run's use of it.

Model shapes are the published config.json numbers of the models the GPU presets name (and of
Qwen3-30B-A3B, a mixture-of-experts student, counted by hand below); they
are written into a private Hugging Face cache layout, so the plan reads them as it would on a
user's machine (config.json only, no weights, no network).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from recipe_gkd.config import CONFIG_DIR, REPO_ROOT, ConfigError, load_config
from recipe_gkd.main import main
from recipe_gkd.models import shape_from_config
from recipe_gkd.plan import memory_plan

QWEN25_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
}
# Qwen3-30B-A3B's published config.json (a mixture of experts: 128 experts, 8 per token, in every layer; no dense MLP,
# so its intermediate_size is counted nowhere): the student of the 2x8 mixture-of-experts split (docs/memory_plan.md).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
}
# Published shapes of every model the GPU presets name (the teachers of remote presets are not planned), and the
# mixture-of-experts student the 2x8 preset's overrides plan.
HUB_MODELS = {
    "Qwen/Qwen3-30B-A3B": QWEN3_30B_A3B,
    "Qwen/Qwen2.5-7B-Instruct": QWEN25_7B,
    # The two teachers of 1x8_two_teachers.yaml: Qwen2.5-7B's shape; the math model's context is 4096.
    "Qwen/Qwen2.5-Math-7B-Instruct": {**QWEN25_7B, "max_position_embeddings": 4096},
    "Qwen/Qwen2.5-Coder-7B-Instruct": QWEN25_7B,
    "Qwen/Qwen2.5-1.5B-Instruct": {
        **QWEN25_7B,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "Qwen/Qwen3-1.7B": {
        "model_type": "qwen3",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
    },
    "Qwen/Qwen3-0.6B": {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
    },
    "Qwen/Qwen3-8B": {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "max_position_embeddings": 40960,
    },
    # The teacher of 1x1_colocated_lora.yaml.
    "Qwen/Qwen3-14B": {
        "model_type": "qwen3",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "max_position_embeddings": 40960,
    },
    "Qwen/Qwen3-32B": {
        "model_type": "qwen3",
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "max_position_embeddings": 40960,
    },
    "meta-llama/Llama-3.2-1B-Instruct": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
    },
    "meta-llama/Llama-3.1-8B-Instruct": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "max_position_embeddings": 131072,
    },
}
GPU_PRESETS = sorted(p for p in (CONFIG_DIR / "presets").glob("*.yaml") if not p.name.startswith("cpu_"))
REMOTE_PRESET = CONFIG_DIR / "presets" / "1x8_a4_r4_t0_remote.yaml"
ONE_BY_EIGHT = CONFIG_DIR / "presets" / "1x8_a1_r3_t4.yaml"


@pytest.fixture(autouse=True)
def no_gpu_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans of the presets' own figures on any machine: no GPU to read (tests/recipe_gkd/plan/test_gpu_memory.py reads one)."""
    monkeypatch.setattr("recipe_gkd.plan.gpu_memory.query_gpus", lambda: None)


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face cache holding only config.json of every preset model (huggingface_hub's layout)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    for repo, config in HUB_MODELS.items():
        folder = cache / f"models--{repo.replace('/', '--')}"
        snapshot = folder / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps(config))
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def qwen7b_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "qwen2.5-7b-shaped"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(QWEN25_7B))
    return directory


def test_a_7b_student_on_one_actor_gpu_exits_2_naming_the_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    student = qwen7b_dir(tmp_path)
    one_gpu = ["actor.gpus_per_node=1", "actor.megatron.tp=1", "rollout.gpus_per_node=7"]
    one_gpu += ["data.train_batch_size=126", "data.eval_batch_size=63"]
    code = main(["--config", str(REMOTE_PRESET), "--dry-run", f"model.student_path={student}", *one_gpu])
    out, err = capsys.readouterr()
    assert code == 2
    assert "config error at `actor.megatron.tp`: actor rank does not fit" in err
    assert "actor rank (x1)" in out and "DOES NOT FIT" in out
    assert "GiB per GPU of 79.0 GiB, from cluster.gpu_memory_gib=0 and no GPU here" in out


def test_a_7b_student_at_the_presets_split_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--config", str(REMOTE_PRESET), "--dry-run", f"model.student_path={qwen7b_dir(tmp_path)}"])
    out, _ = capsys.readouterr()
    assert code == 0, out
    actor_line = next(line for line in out.splitlines() if line.strip().startswith("actor rank"))
    assert actor_line.strip().startswith("actor rank (x4)") and actor_line.endswith("fits")
    for part in ("weights", "gradient buffer", "optimizer state", "activations", "logits and loss", "KV cache"):
        assert part in out
    assert "not planned: teacher: teacher.location=remote" in out


@pytest.mark.parametrize("preset", GPU_PRESETS, ids=lambda p: p.name)
def test_every_gpu_preset_fits_its_own_plan(preset: Path, hub_cache: Path) -> None:
    plan = memory_plan.build_memory_plan(load_config(preset))
    assert plan is not None
    # Every model is in the cache: only a remote teacher (planned on its own host) is left out.
    assert all("teacher.location=remote" in reason for reason in plan.skipped), plan.skipped
    planned = {role.role for role in plan.roles}
    assert {"actor rank", "rollout GPU"} <= planned
    cfg = load_config(preset)
    # Every teacher planned, each on its own replicas (several teachers: `teacher NAME GPU`).
    assert {f"teacher {n} GPU" for n in cfg.teachers} <= planned
    if cfg.cluster.colocate:  # the GPU holding every role, planned as a whole too
        assert plan.roles[0].role.startswith("GPU (colocated") and "teacher GPU" in planned
    for role in plan.roles:
        assert role.fits, memory_plan.format_memory_plan(plan)
    memory_plan.check_memory_plan(plan)


def test_a_hub_id_missing_from_the_cache_is_reported_not_downloaded(
    hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--config", str(REMOTE_PRESET), "--dry-run", "model.student_path=org/not-cached"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "not planned: model.student_path='org/not-cached': no config.json here or in the Hugging Face cache" in out


def test_activation_overflow_names_recompute_then_the_micro_batch(tmp_path: Path) -> None:
    student = str(qwen7b_dir(tmp_path))
    long = [f"model.student_path={student}", "actor.micro_batch_size=16", "data.max_prompt_length=4096"]
    cfg = load_config(REMOTE_PRESET, long)
    plan = memory_plan.build_memory_plan(cfg)
    with pytest.raises(ConfigError) as err:
        memory_plan.check_memory_plan(plan)  # type: ignore[arg-type]
    assert err.value.key == "actor.megatron.recompute"
    cfg = load_config(REMOTE_PRESET, [*long, "actor.megatron.recompute=full"])
    with pytest.raises(ConfigError) as err:
        memory_plan.check_memory_plan(memory_plan.build_memory_plan(cfg))  # type: ignore[arg-type]
    assert err.value.key == "actor.micro_batch_size"
    # Recompute and a token budget bring the same step back under the GPU.
    fixed = [*long, "actor.megatron.recompute=selective", "actor.max_tokens_per_micro_batch=8192"]
    memory_plan.check_memory_plan(memory_plan.build_memory_plan(load_config(REMOTE_PRESET, fixed)))  # type: ignore[arg-type]


def test_a_rollout_share_too_small_for_the_weights_names_its_key(tmp_path: Path) -> None:
    cfg = load_config(
        REMOTE_PRESET, [f"model.student_path={qwen7b_dir(tmp_path)}", "rollout.gpu_memory_utilization=0.2"]
    )
    with pytest.raises(ConfigError) as err:
        memory_plan.check_memory_plan(memory_plan.build_memory_plan(cfg))  # type: ignore[arg-type]
    assert err.value.key == "rollout.gpu_memory_utilization"


def test_memory_check_false_prints_and_goes_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    student = qwen7b_dir(tmp_path)
    args = ["actor.gpus_per_node=1", "actor.megatron.tp=1", "rollout.gpus_per_node=7", "data.train_batch_size=126"]
    args += ["data.eval_batch_size=63", "debug.memory_check=false", f"model.student_path={student}"]
    assert main(["--config", str(REMOTE_PRESET), "--dry-run", *args]) == 0
    assert "warning: config error at `actor.megatron.tp`" in capsys.readouterr().out


def test_no_plan_on_cpu() -> None:
    assert memory_plan.build_memory_plan(load_config(None)) is None


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama_tied", "llama_untied", "qwen3_moe"])
def test_parameter_count_equals_transformers(family: str) -> None:
    """Shape.num_params against the same shape instantiated by transformers (an independent count); a mixture of
    experts' active parameters against its tensors, the experts' counted experts_per_token / num_experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(
        hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2
    )
    settings = {
        "qwen2": dict(model_type="qwen2", vocab_size=300, tie_word_embeddings=False),
        "qwen3": dict(model_type="qwen3", vocab_size=300, head_dim=16, tie_word_embeddings=True),
        "llama_tied": dict(model_type="llama", vocab_size=301, tie_word_embeddings=True),
        "llama_untied": dict(model_type="llama", vocab_size=301, tie_word_embeddings=False),
        # intermediate_size (176) is a dense MLP no layer has: counting it would miss.
        "qwen3_moe": dict(
            model_type="qwen3_moe",
            vocab_size=300,
            head_dim=16,
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            norm_topk_prob=True,
        ),
    }[family]
    config_dict = {**base, **settings}
    kwargs = {k: v for k, v in config_dict.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config_dict["model_type"], **kwargs))
    unique = {id(p): p.numel() for p in model.parameters()}
    assert shape_from_config(config_dict).num_params() == sum(unique.values())
    # The same reader on the transformers config object (the actor's HFArch reads its numbers through it).
    assert shape_from_config(model.config).num_params() == sum(unique.values())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    shape = shape_from_config(config_dict)
    assert shape.is_moe == (experts > 0)
    per_token = shape.experts_per_token / shape.num_experts if shape.is_moe else 1
    assert shape.active_params() == sum(unique.values()) - experts + experts * per_token


def test_the_7b_shape_counts_7_6_billion_parameters() -> None:
    # Qwen2.5-7B's model card: 7.61B parameters.
    assert shape_from_config(QWEN25_7B).num_params() == pytest.approx(7.61e9, rel=0.005)


def test_vllm_weights_and_kv_cache_are_in_the_engines_dtype(tmp_path: Path) -> None:
    """The rollout engine loads the student in the training precision: fp32 doubles weights and KV bytes per token."""
    student = f"model.student_path={qwen7b_dir(tmp_path)}"
    rollouts = {}
    for precision in ("bf16", "fp32"):
        cfg = load_config(REMOTE_PRESET, [student, f"actor.precision={precision}", "debug.memory_check=false"])
        plan = memory_plan.build_memory_plan(cfg)
        assert plan is not None
        rollouts[precision] = next(r for r in plan.roles if r.role == "rollout GPU")
    bf16_weights, fp32_weights = rollouts["bf16"].parts[0], rollouts["fp32"].parts[0]
    assert fp32_weights[1] == 2 * bf16_weights[1] and "fp32" in fp32_weights[0]
    shape = shape_from_config(QWEN25_7B)
    assert shape.kv_bytes_per_token(1, 4) == 2 * shape.kv_bytes_per_token(1, 2)
    assert "KiB each" in rollouts["fp32"].parts[-1][0] and rollouts["fp32"].parts[-1][1] < rollouts["bf16"].parts[-1][1]


COLOCATED = CONFIG_DIR / "presets" / "1x1_colocated.yaml"


def test_the_one_gpu_preset_prints_every_roles_share_and_the_sum(
    hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--config", str(COLOCATED), "--dry-run"]) == 0
    out = capsys.readouterr().out
    gpu = out[out.index("GPU (colocated") :].splitlines()
    assert gpu[0].startswith("GPU (colocated: actor rank, rollout engine, teacher replica) (x1):") and gpu[0].endswith(
        "fits"
    )
    shares = {"actor": 0.40, "rollout": 0.20, "teacher": 0.25}
    for role, share in shares.items():
        line = next(x for x in gpu if f"{role}.gpu_memory_utilization" in x)
        assert float(line.split()[0]) == pytest.approx(share * 79.0, abs=0.01)
    block = gpu[1 : next(i for i, x in enumerate(gpu) if "note:" in x)]
    outside = [x for x in block if "outside its share" in x]
    assert any("actor rank: CUDA context" in x for x in outside)
    assert any("teacher GPU: prompt log-prob buffers" in x for x in outside)
    # Each vLLM process's CUDA context, and the layer the rollout engine's in-place reload materialises.
    assert any("rollout GPU: CUDA context of the vLLM process" in x for x in outside)
    assert any("teacher GPU: CUDA context of the vLLM process" in x for x in outside)
    assert any("rollout GPU: in-place reload: one layer materialised" in x for x in outside)
    total = float(gpu[0].split("): ")[1].split()[0])
    assert total == pytest.approx(sum(float(x.split()[0]) for x in block), abs=0.06)  # rounded to 0.1 and 0.01
    assert "shares sum to 0.85 of the GPU" in out
    assert "GPU 0 of node 0 is shared (colocated): actor 0, rollout 0, teacher 0" in out


COLOCATED_LORA = CONFIG_DIR / "presets" / "1x1_colocated_lora.yaml"


def _header(preset: Path) -> str:
    """A preset's opening comment as one line of text."""
    lines = preset.read_text().splitlines()
    end = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    return " ".join(line.lstrip("#").strip() for line in lines[:end])


def test_the_one_gpu_lora_preset_fits_an_8b_student_beside_a_14b_teacher(
    hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Qwen3-14B -> Qwen3-8B at actor.lora.rank 32 on one 80 GB GPU: the actor holds the frozen base and the adapters'
    state, the rollout engine its LoRA slots; the yaml's header figures are the plan's."""
    assert main(["--config", str(COLOCATED_LORA), "--dry-run"]) == 0
    out = capsys.readouterr().out
    gpu = out[out.index("GPU (colocated") :].splitlines()[0]
    assert gpu.endswith("fits") and float(gpu.split("): ")[1].split()[0]) <= 79.0
    assert "base weights (bf16, 8.19B params on this rank, frozen: no gradient buffer, no optimizer state)" in out
    assert "LoRA adapters (bf16, rank 32 on qkv, proj, fc1, fc2 of 36 layers: 73.1M params on this rank)" in out
    assert "LoRA slots (max_lora_rank 32, max_loras 1, bf16" in out
    assert "weight sync: the LoRA adapter alone, 0.16 GiB a version" in out
    assert "in-place reload" not in out
    header = _header(COLOCATED_LORA)
    plan = memory_plan.build_memory_plan(load_config(COLOCATED_LORA))
    teacher = next(r for r in plan.roles if r.role == "teacher GPU")  # type: ignore[union-attr]
    assert f"Qwen3-14B's {teacher.parts[0][1] / memory_plan.GIB:.1f} GiB of bf16 weights fit" in header
    qwen3_32b = shape_from_config(HUB_MODELS["Qwen/Qwen3-32B"])
    assert f"Qwen3-32B's {qwen3_32b.num_params() * 2 / memory_plan.GIB:.0f} GiB do not" in header


def test_docs_paste_the_one_gpu_lora_presets_plan_as_it_prints(
    hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--config", str(COLOCATED_LORA), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = out[out.index("memory plan (estimate") : out.index("dry run: config valid")].rstrip("\n")
    doc = (REPO_ROOT / "docs" / "memory_plan.md").read_text()
    section = doc[doc.index("## A LoRA student") :]
    pasted = section[section.index("```\nmemory plan") + 4 :]
    assert pasted[: pasted.index("\n```")] == plan


def test_the_one_gpu_lora_preset_without_adapters_exits_2_naming_the_rank(
    hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole Qwen3-8B's model state (bf16 weights, fp32 gradients, master weights and Adam moments) exceeds the
    whole GPU: no share helps, and one GPU has no other to split over."""
    assert main(["--config", str(COLOCATED_LORA), "--dry-run", "actor.lora.rank=0"]) == 2
    out, err = capsys.readouterr()
    assert "actor rank (x1)" in out and "DOES NOT FIT" in out
    assert "config error at `actor.lora.rank`: actor rank does not fit" in err
    assert "more than the whole GPU: train low-rank adapters instead" in err
    whole = load_config(COLOCATED_LORA, ["actor.lora.rank=0"])
    parts = dict(memory_plan.actor_memory(whole, shape_from_config(HUB_MODELS["Qwen/Qwen3-8B"])).parts)
    state = sum(b for n, b in parts.items() if n.startswith(("weights", "gradient buffer", "optimizer state")))
    assert f"take {state / memory_plan.GIB:.0f} GiB: with actor.lora.rank=0" in _header(COLOCATED_LORA)


def test_the_one_gpu_shares_print_without_any_config_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(COLOCATED), "--dry-run", "model.student_path=org/a", "teacher.model_path=org/b"]) == 0
    out = capsys.readouterr().out
    assert "0.40 x 79.0: actor.gpu_memory_utilization" in out and "0.25 x 79.0: teacher.gpu_memory_utilization" in out
    assert "not planned: model.student_path='org/a'" in out


def test_colocated_roles_that_overfill_the_gpu_name_the_largest_share(hub_cache: Path) -> None:
    cfg = load_config(COLOCATED, ["actor.gpu_memory_utilization=0.5", "teacher.gpu_memory_utilization=0.3"])
    with pytest.raises(ConfigError) as err:
        memory_plan.check_memory_plan(memory_plan.build_memory_plan(cfg))  # type: ignore[arg-type]
    assert err.value.key == "actor.gpu_memory_utilization"
    assert "roles on one GPU need" in err.value.message


def test_an_actor_share_too_small_for_its_state_names_the_share(hub_cache: Path) -> None:
    cfg = load_config(COLOCATED, ["actor.gpu_memory_utilization=0.1"])
    with pytest.raises(ConfigError) as err:
        memory_plan.check_memory_plan(memory_plan.build_memory_plan(cfg))  # type: ignore[arg-type]
    assert err.value.key == "actor.gpu_memory_utilization"


def test_the_teachers_prompt_logprob_buffer_lies_outside_its_vllm_share(hub_cache: Path) -> None:
    """vLLM fills its whole share with KV cache (its profile run scores no prompt): the V1 runner's
    logits + fp32 copy + fp32 log-softmax of one chunk (12.4 GB at 8192 x 151936) must fit beside it."""
    preset = CONFIG_DIR / "presets" / "1x8_a1_r3_t4.yaml"
    cfg = load_config(preset, ["teacher.max_model_len=8192"])
    teacher = next(r for r in memory_plan.build_memory_plan(cfg).roles if r.role == "teacher GPU")  # type: ignore[union-attr]
    assert teacher.total == pytest.approx(cfg.teacher.gpu_memory_utilization * 79.0 * memory_plan.GIB)
    # Beside the buffers: the replica's CUDA context and its NCCL buffers (2 GPUs a replica), 0.5 GiB each.
    assert teacher.outside_total == pytest.approx(8192 * 151936 * 10 + 1.0 * memory_plan.GIB)
    # 0.9 x 79 GiB for vLLM + 11.6 GiB beside it > 79 GiB: the share to lower is named.
    with pytest.raises(ConfigError) as err:
        memory_plan.check_memory_plan(memory_plan.build_memory_plan(cfg))  # type: ignore[arg-type]
    assert err.value.key == "teacher.gpu_memory_utilization"
    memory_plan.check_memory_plan(  # the preset's 4096 tokens (5.8 GiB beside the share) fit
        memory_plan.build_memory_plan(load_config(preset))  # type: ignore[arg-type]
    )


def test_fp32_grouped_attention_counts_the_repeated_keys_and_values() -> None:
    shape = shape_from_config(HUB_MODELS["Qwen/Qwen3-0.6B"])
    bf16 = memory_plan.actor_bytes_per_token_and_layer(shape, 1, 2, 4096, "none", "sdpa")
    fp32 = memory_plan.actor_bytes_per_token_and_layer(shape, 1, 4, 4096, "none", "sdpa")
    # fp32: keys and values repeated to 16 heads (the memory-efficient kernel), no [s, s] term.
    assert fp32 - 2 * bf16 == pytest.approx(4 * (2 * 16 - 2 * 8) * 128)


def test_the_optimizer_steps_temporary_counts_where_it_exceeds_the_freed_activations(tmp_path: Path) -> None:
    """torch's foreach AdamW makes an fp32 sqrt(v) per parameter of the optimizer's shard at the step, when the
    activations and logits are already freed: 3.81B params on a rank, replicated optimizer -> 14.19 GiB, of
    which 14.19 - 0.75 (full recompute) - 3.26 (logits) = 10.18 GiB is beyond the backward pass's peak."""
    student = f"model.student_path={qwen7b_dir(tmp_path)}"
    lean = [student, "actor.megatron.recompute=full", "actor.max_tokens_per_micro_batch=2560"]
    lean.append("actor.megatron.distributed_optimizer=false")
    shape = shape_from_config(QWEN25_7B)
    parts = dict(memory_plan.actor_memory(load_config(REMOTE_PRESET, lean), shape).parts)
    (name,) = [n for n in parts if n.startswith("optimizer step temporary")]
    params = next(b for n, b in parts.items() if n.startswith("weights")) / 2  # bf16 weights
    activations = next(b for n, b in parts.items() if n.startswith("activations"))
    logits = next(b for n, b in parts.items() if n.startswith("logits"))
    assert parts[name] == pytest.approx(params * 4 - activations - logits)
    assert parts[name] / memory_plan.GIB == pytest.approx(10.18, abs=0.01) and "14.19 GiB" in name
    # The preset's own step (distributed over 2, no recompute): the temporary fits in the freed activations.
    parts = dict(memory_plan.actor_memory(load_config(REMOTE_PRESET, [student]), shape).parts)
    assert next(b for n, b in parts.items() if n.startswith("optimizer step temporary")) == 0.0


def test_each_vllm_process_has_its_context_and_the_rollout_its_reload_layer_outside_its_share() -> None:
    """Outside a vLLM share: the process's CUDA context (0.5 GiB), NCCL with tensor parallelism (0.5 GiB), and
    for a rollout engine the largest layer its in-place reload materialises (Qwen2.5-7B: the 152064 x 3584
    embedding, 1.09 GB in bf16 at TP 1, half at TP 2)."""
    shape = shape_from_config(QWEN25_7B)
    cfg = load_config(REMOTE_PRESET)
    for tp, nccl in ((1, 0.0), (2, 0.5)):
        role = memory_plan.vllm_memory(
            "rollout GPU",
            4,
            shape,
            tp,
            0.5,
            4096,
            cfg,
            dtype_bytes=2,
            beyond_profile=memory_plan.reload_layer(shape, tp, 2),
        )
        outside = dict(role.outside)
        assert outside["CUDA context of the vLLM process"] == 0.5 * memory_plan.GIB
        assert outside.get(f"NCCL buffers (tensor parallel {tp})", 0.0) == nccl * memory_plan.GIB
        (reload,) = [b for n, b in outside.items() if n.startswith("in-place reload")]
        assert reload == 152064 * 3584 * 2 / tp
    teacher = memory_plan.teacher_memory(cfg, shape)
    assert not any(n.startswith("in-place reload") for n, _ in teacher.outside)  # a teacher is never reloaded


def test_teacher_output_hidden_counts_the_teacher_head_its_hidden_states_and_the_loss_chunks(tmp_path: Path) -> None:
    """teacher.output=hidden on a Qwen2.5-7B-shaped actor at TP 2 with a teacher of the same shape: the head's
    rows of this rank (152064 / 2 x 3584 in bf16 = 545 MB), the micro-batch's 16-bit hidden states and the loss rows' copy, and the loss's
    chunk buffers (DEFAULT_CHUNK_BYTES in all, the numbers recipe_gkd/losses/hidden.py uses)."""
    from recipe_gkd.losses import hidden as hidden_loss
    from recipe_gkd.losses import student_logits

    assert memory_plan.HIDDEN_LOSS_CHUNK_BYTES == student_logits.DEFAULT_CHUNK_BYTES
    assert memory_plan.HIDDEN_CHUNK_BUFFERS == hidden_loss.HIDDEN_CHUNK_BUFFERS
    shape = shape_from_config(QWEN25_7B)
    cfg = load_config(REMOTE_PRESET, [f"model.student_path={qwen7b_dir(tmp_path)}"])
    without = dict(memory_plan.actor_memory(cfg, shape).parts)
    parts = dict(memory_plan.actor_memory(cfg, shape, teacher=shape).parts)
    added = {name: size for name, size in parts.items() if name not in without}
    tp = cfg.actor.megatron.tp
    tokens = cfg.actor.max_tokens_per_micro_batch or cfg.actor.micro_batch_size * (
        cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens
    )
    assert sorted(added.values()) == sorted(
        [152064 // tp * 3584 * 2, tokens * 3584 * 4, float(memory_plan.HIDDEN_LOSS_CHUNK_BYTES)]
    )


def two_colocated_teachers(tmp_path: Path, **shares: float) -> Path:
    """1x1_colocated.yaml with two vLLM teachers (its teacher twice, named math and code), each with its own share."""
    import yaml

    preset = yaml.safe_load(COLOCATED.read_text())
    teacher = preset.pop("teacher")
    preset["teachers"] = {name: {**teacher, "gpu_memory_utilization": share} for name, share in shares.items()}
    preset["data"] |= {"teacher_key": "teacher", "default_teacher": next(iter(shares))}
    path = tmp_path / "two_colocated.yaml"
    path.write_text(yaml.safe_dump(preset, sort_keys=False))
    return path


def test_two_colocated_teachers_each_share_every_gpu_within_its_own_share(
    hub_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """cluster.colocate with several teachers: each teacher's replica on every GPU, each its own memory share,
    all shares planned on the one GPU."""
    from recipe_gkd.plan.placement import build_plan

    path = two_colocated_teachers(tmp_path, math=0.15, code=0.10)
    cfg = load_config(path)
    plan = build_plan(cfg)
    assert [(s.teacher, s.gpu_ids) for s in plan.teacher] == [("math", (0,)), ("code", (0,))]
    assert plan.teacher_gpu_ids(0, "code") == plan.teacher_gpu_ids(0) == (0,) and plan.teacher_only_gpu_ids(0) == ()
    assert plan.shared_gpus(0) == {0: ["actor 0", "rollout 0", "teacher math 0", "teacher code 0"]}
    assert main(["--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    gpu = out[out.index("GPU (colocated") :].splitlines()
    assert gpu[0].startswith("GPU (colocated: actor rank, rollout engine, 2 teacher replicas (one per teacher)) (x1):")
    for key, share in (("teachers.math", 0.15), ("teachers.code", 0.10)):
        line = next(x for x in gpu if f"{share:.2f} x 79.0: {key}.gpu_memory_utilization, the teacher replica" in x)
        assert float(line.split()[0]) == pytest.approx(share * 79.0, abs=0.01)
    # Each teacher's vLLM process brings its own CUDA context outside its share.
    assert sum("teacher math GPU: CUDA context" in x or "teacher code GPU: CUDA context" in x for x in gpu) == 2
    assert "shares sum to 0.85 of the GPU" in out


@pytest.mark.parametrize(
    ("shares", "overrides", "key"),
    [
        ({"math": 0.25, "code": 0.25}, [], "actor.gpu_memory_utilization"),  # 0.4 + 0.2 + 0.25 + 0.25 > 1
        ({"math": 0.15, "code": 0.10}, ["teachers.code.replicas=2"], "teachers.code.replicas"),
    ],
)
def test_two_colocated_teachers_are_checked_each(
    tmp_path: Path, shares: dict[str, float], overrides: list[str], key: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(two_colocated_teachers(tmp_path, **shares), overrides)
    assert err.value.key == key, str(err.value)


def test_a_hidden_state_teacher_is_charged_no_prompt_logprob_buffers(hub_cache: Path) -> None:
    """teacher.output=hidden runs a pooling engine that asks for no prompt log-probs (its profile run pools a full
    batch inside its share): on the one-GPU preset the 3.1 GB of the log-prob teacher's buffers are not charged."""
    plans = {
        output: memory_plan.build_memory_plan(load_config(COLOCATED, [f"teacher.output={output}"]))
        for output in ("topk", "hidden")
    }
    teachers = {o: next(r for r in p.roles if r.role == "teacher GPU") for o, p in plans.items()}  # type: ignore[union-attr]
    (buffers,) = [b for n, b in teachers["topk"].outside if n.startswith("prompt log-prob buffers")]
    cfg = load_config(COLOCATED)
    shape = shape_from_config(HUB_MODELS[cfg.teacher.model_path])
    tokens = min(cfg.teacher.max_model_len or shape.max_position_embeddings, memory_plan.VLLM_BATCHED_TOKENS)
    assert buffers == tokens * shape.vocab_size * (2 + 4 + 4) and buffers / 1e9 == pytest.approx(3.1, abs=0.05)
    assert teachers["hidden"].outside == [("CUDA context of the vLLM process", 0.5 * memory_plan.GIB)]
    gpus = {o: p.roles[0] for o, p in plans.items()}  # type: ignore[union-attr]
    assert gpus["topk"].total - gpus["hidden"].total == pytest.approx(buffers)


def test_the_object_store_holds_the_hidden_states_of_the_batches_in_flight(hub_cache: Path) -> None:
    """teacher.output=hidden on 1x8_a1_r3_t4: every response token's teacher state crosses Ray's object store, in
    the wire's 16 bits (half the float32 1.5 GiB a step), for the batch trained and those the schedule runs ahead."""
    preset = CONFIG_DIR / "presets" / "1x8_a1_r3_t4.yaml"
    topk = load_config(preset)
    teacher_hidden = HUB_MODELS[topk.teacher.model_path]["hidden_size"]
    per_batch = topk.data.train_batch_size * topk.rollout.sampling.max_new_tokens * teacher_hidden * 2
    for schedule, batches in (("sync", 1), ("one_step_off", 2), ("two_step_off", 3)):
        cfg = load_config(preset, ["teacher.output=hidden", f"algorithm.schedule={schedule}"])
        assert memory_plan.hidden_shard_bytes(cfg) == batches * per_batch
        assert memory_plan.object_store_mib(cfg) == memory_plan.object_store_mib(topk) + math.ceil(
            batches * per_batch / 2**20
        )
    assert memory_plan.hidden_shard_bytes(topk) == 0


def test_the_cross_tokenizer_loss_at_tp_2_is_counted_over_the_gathered_vocabulary(tmp_path: Path) -> None:
    """Across tokenizers each TP rank gathers the whole vocabulary for the loss: the plan counts XTOK_GATHERED_BYTES
    per token per id of it, which the loss's measured peak on CPU (benchmarks/bench_cross_tokenizer_memory.py: the
    real loss, forward and backward, behind megatron's gather) must not exceed, and comes near."""
    shape = shape_from_config(QWEN25_7B)
    student = [f"model.student_path={qwen7b_dir(tmp_path)}", "algorithm.cross_tokenizer=span"]
    at_tp = {
        tp: dict(
            memory_plan.actor_memory(load_config(REMOTE_PRESET, [*student, f"actor.megatron.tp={tp}"]), shape).parts
        )
        for tp in (1, 2)
    }
    cfg = load_config(REMOTE_PRESET, [*student, "actor.megatron.tp=2"])
    tokens = cfg.actor.max_tokens_per_micro_batch or cfg.actor.micro_batch_size * (
        cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens
    )
    (gathered,) = [b for n, b in at_tp[2].items() if n.startswith("cross-tokenizer loss over the gathered vocabulary")]
    assert gathered == tokens * 152064 * memory_plan.XTOK_GATHERED_BYTES
    assert not any(n.startswith("cross-tokenizer loss") for n in at_tp[1])
    same_tokenizer = load_config(REMOTE_PRESET, [student[0], "actor.megatron.tp=2"])
    assert not any(
        n.startswith("cross-tokenizer loss") for n, _ in memory_plan.actor_memory(same_tokenizer, shape).parts
    )
    from benchmarks.bench_cross_tokenizer_memory import measured_bytes

    for objective in ("span", "uld"):
        measured = measured_bytes(objective, tokens=256, vocab=16384, tp=2)
        assert 0.7 * memory_plan.XTOK_GATHERED_BYTES <= measured <= memory_plan.XTOK_GATHERED_BYTES, objective


def test_a_teacher_with_its_own_prompt_is_planned_for_its_own_bound() -> None:
    """A teacher prompt of its own (data.teacher_prompt_key): the teacher scores up to data.max_teacher_prompt_length +
    rollout.sampling.max_new_tokens tokens; a model with fewer positions names the bound."""
    shape = shape_from_config(QWEN25_7B)
    plain = memory_plan.teacher_memory(load_config(ONE_BY_EIGHT, ["cluster.gpu_memory_gib=80"]), shape)
    assert not any("scores sequences" in n for n in plain.notes)
    cfg = load_config(
        ONE_BY_EIGHT,
        [
            "cluster.gpu_memory_gib=80",
            "teacher.max_model_len=0",
            "data.teacher_prompt_key=hint",
            "data.max_teacher_prompt_length=4096",
        ],
    )
    longest = 4096 + cfg.rollout.sampling.max_new_tokens
    teacher = memory_plan.teacher_memory(cfg, shape)
    assert f"scores sequences of up to {longest} tokens (data.max_teacher_prompt_length" in " ".join(teacher.notes)
    too_long = shape.max_position_embeddings - cfg.rollout.sampling.max_new_tokens + 1
    cfg = load_config(
        ONE_BY_EIGHT,
        [
            "cluster.gpu_memory_gib=80",
            "teacher.max_model_len=0",
            "data.teacher_prompt_key=hint",
            f"data.max_teacher_prompt_length={too_long}",
        ],
    )
    teacher = memory_plan.teacher_memory(cfg, shape)
    assert not teacher.fits and teacher.key == "data.max_teacher_prompt_length", teacher.problem


# ----------------------------------------------------------------------------- a mixture of experts: Qwen3-30B-A3B

TWO_NODES = CONFIG_DIR / "presets" / "2x8_a8_r4_t4.yaml"
# The 2x8 preset's actor node (8 GPUs) at TP 1 (data parallel 8), the experts split 8 ways, on H200s as CUDA sees them.
A3B_SPLIT = ["model.student_path=Qwen/Qwen3-30B-A3B", "actor.megatron.tp=1", "actor.megatron.ep=8"]
H200_GIB = 139.8

# Qwen3-30B-A3B by hand. One layer: the fused q/k/v rows ((32 + 2 x 4) heads x 128) and the output projection
# (32 x 128 -> 2048), two RMSNorms of 2048 and the q/k norms of 128, the router (128 x 2048), and 128 SwiGLU experts
# of gate, up [768, 2048] and down [2048, 768]. The model: 48 layers, the untied embedding and lm_head, the final norm.
A3B_ATTENTION = 2048 * (32 + 2 * 4) * 128 + 32 * 128 * 2048
A3B_NORMS = 2 * 2048 + 2 * 128
A3B_ROUTER = 128 * 2048
A3B_EXPERT = 3 * 2048 * 768
A3B_LAYER = A3B_ATTENTION + A3B_NORMS + A3B_ROUTER + 128 * A3B_EXPERT
A3B_EMBEDDINGS = 2 * 151936 * 2048 + 2048


def test_the_30b_a3b_shape_counts_every_expert_and_its_active_eight_by_hand() -> None:
    shape = shape_from_config(QWEN3_30B_A3B)
    assert (A3B_ATTENTION, A3B_NORMS, A3B_ROUTER, A3B_EXPERT) == (18_874_368, 4_352, 262_144, 4_718_592)
    assert A3B_LAYER == 623_120_640
    assert shape.layer_params() == A3B_LAYER
    assert shape.dense_layer_params() == A3B_ATTENTION + A3B_NORMS + A3B_ROUTER
    # On one rank of TP 2 x EP 8: 16 experts, half of each; the router replicated over TP.
    assert shape.expert_layer_params(2, 8) == 16 * A3B_EXPERT / 2
    assert shape.dense_layer_params(2) == A3B_ATTENTION / 2 + A3B_NORMS + A3B_ROUTER
    total = 48 * A3B_LAYER + A3B_EMBEDDINGS
    active = 48 * (A3B_ATTENTION + A3B_NORMS + A3B_ROUTER + 8 * A3B_EXPERT) + A3B_EMBEDDINGS
    assert (total, active) == (30_532_122_624, 3_353_032_704)
    assert shape.num_params() == total and shape.active_params() == active
    # The model card: 30.5B parameters, 3.3B activated.
    assert total == pytest.approx(30.5e9, rel=0.002) and active == pytest.approx(3.3e9, rel=0.02)
    # vLLM's FusedMoE holds a layer's 128 experts as one module: the largest its in-place reload materialises.
    assert shape.largest_module_params(1) == 128 * A3B_EXPERT
    assert shape.largest_module_params(4) == 128 * A3B_EXPERT / 4


def test_the_30b_a3b_student_on_the_2x8_split_prints_each_gpus_plan_with_its_experts(
    hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--config", str(TWO_NODES), "--dry-run", *A3B_SPLIT, f"cluster.gpu_memory_gib={H200_GIB}"])
    out = capsys.readouterr().out
    assert code == 0, out
    for role in ("actor rank (x8)", "rollout GPU (x4)", "teacher GPU (x4)"):
        assert next(x for x in out.splitlines() if x.strip().startswith(role)).endswith("fits"), out
    assert "1.54B dense + 3.62B experts, 16 of 128 in each of 48 layers" in out
    assert "the experts' 40.50 GiB over expert data parallel 1" in out
    assert "30.53B params, 3.35B active per token" in out
    assert "weights (bf16, 30.53B params / tp 1, 28.99B of them in all 128 experts)" in out  # the rollout engine's
    # Every part of the actor rank and of a rollout GPU, by hand.
    plan = memory_plan.build_memory_plan(load_config(TWO_NODES, [*A3B_SPLIT, f"cluster.gpu_memory_gib={H200_GIB}"]))
    assert plan is not None
    actor = dict(next(r for r in plan.roles if r.role == "actor rank").parts)
    dense = 48 * (A3B_ATTENTION + A3B_NORMS + A3B_ROUTER) + A3B_EMBEDDINGS  # every rank's: data parallel 8
    experts = 48 * 16 * A3B_EXPERT  # 128 / ep 8 of every layer
    tokens = 2 * (512 + 2048)  # the preset's micro-batch of 2 sequences of prompt + response
    # Kept per token and layer (values): norms 4h + q/k norm inputs, sdpa's q, k, v and output (bf16: grouped k, v),
    # 8 copies of the token with 6 x 768 of SwiGLU each, the router's fp32 [128] tensors and routing map (bytes / 2).
    per_layer = 4 * 2048 + (32 + 4) * 128 + (2 * 32 + 2 * 4) * 128 + 8 * (2048 + 6 * 768) + 128 * 13 / 2
    expected = {
        "weights": (dense + experts) * 2,
        "gradient buffer": (dense + experts) * 4,
        "optimizer state": dense * 12 / 8 + experts * 12 / 1,  # experts' state over the dp / ep = 1 rank holding them
        "activations": tokens * 48 * per_layer * 2,
        "logits and loss buffers": tokens * 151936 * (2 + 16),
        "all-to-all dispatcher buffers": 4 * tokens * 8 * 2048 * 2,
        "optimizer step temporary": 0.0,  # 4 x experts (14.5 GB) is below the freed activations and logits
    }
    for prefix, value in expected.items():
        assert next(b for n, b in actor.items() if n.startswith(prefix)) == pytest.approx(value, rel=1e-12), prefix
    rollout = next(r for r in plan.roles if r.role == "rollout GPU")
    assert rollout.parts[0][1] == (48 * A3B_LAYER + A3B_EMBEDDINGS) * 2  # vLLM holds every expert (no vLLM EP)
    reload = next(b for n, b in rollout.outside if n.startswith("in-place reload"))
    assert reload == 128 * A3B_EXPERT * 2  # one layer's FusedMoE


def test_experts_that_do_not_fit_name_the_expert_parallel_split(
    hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ep=1: every rank holds all 128 experts of every layer, 170 GiB of weights and gradients: ep is the key (its
    next size, 2). ep=8 on an 80 GB GPU: the experts' Adam state over dp / ep = 1 rank and its step's temporary
    leave no room whatever the micro-batch: more GPUs (no wider ep divides data parallel 8)."""
    one = [*A3B_SPLIT[:-1], "actor.megatron.ep=1"]
    for gib in (79.0, H200_GIB):
        assert main(["--config", str(TWO_NODES), "--dry-run", *one, f"cluster.gpu_memory_gib={gib}"]) == 2
        err = capsys.readouterr().err
        assert "config error at `actor.megatron.ep`: actor rank does not fit" in err
        assert "actor.megatron.ep=2: 64 each" in err
    cfg = load_config(TWO_NODES, [*A3B_SPLIT, "actor.max_tokens_per_micro_batch=2560", "actor.megatron.recompute=full"])
    with pytest.raises(ConfigError) as raised:
        memory_plan.check_memory_plan(memory_plan.build_memory_plan(cfg))  # type: ignore[arg-type]
    assert raised.value.key == "actor.megatron.tp" and "split the student over more GPUs" in raised.value.message


def test_expert_parallelism_needs_experts_that_split_evenly(
    tmp_path: Path, hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dense student with actor.megatron.ep > 1, and ep not dividing num_experts, exit 2 naming actor.megatron.ep
    (the dry run reads the student's config.json there)."""
    assert (
        main(
            [
                "--config",
                str(REMOTE_PRESET),
                "--dry-run",
                f"model.student_path={qwen7b_dir(tmp_path)}",
                "actor.megatron.ep=2",
            ]
        )
        == 2
    )
    assert "config error at `actor.megatron.ep`: actor.megatron.ep=2 but the student is a dense model" in (
        capsys.readouterr().err
    )
    odd = tmp_path / "a3b-100-experts"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "num_experts": 100}))
    split = [f"model.student_path={odd}", "actor.megatron.tp=1", f"cluster.gpu_memory_gib={H200_GIB}"]
    assert main(["--config", str(TWO_NODES), "--dry-run", *split, "actor.megatron.ep=8"]) == 2
    assert "actor.megatron.ep=8 must divide the student's num_experts=100" in capsys.readouterr().err
    # ep=4 divides the 100 experts: planned (25 a rank), whether or not it fits.
    four = memory_plan.build_memory_plan(load_config(TWO_NODES, [*split, "actor.megatron.ep=4"]))
    assert four is not None and "25 of 100 in each of 48 layers" in four.roles[0].parts[0][0]


def test_selective_recompute_keeps_the_experts_activations() -> None:
    """megatron's "mlp" recompute module skips MoE layers: selective saves a dense model its MLP, an MoE nothing of
    its experts; the remedy then is full recompute."""
    moe, dense = shape_from_config(QWEN3_30B_A3B), shape_from_config(HUB_MODELS["Qwen/Qwen3-8B"])
    per_layer = memory_plan.actor_bytes_per_token_and_layer
    assert per_layer(moe, 1, 2, 2560, "selective", "sdpa") == per_layer(moe, 1, 2, 2560, "none", "sdpa")
    assert per_layer(dense, 1, 2, 2560, "none", "sdpa") - per_layer(dense, 1, 2, 2560, "selective", "sdpa") == (
        2 * 4 * 12288
    )


def test_a_mixture_of_experts_no_family_reads_is_not_planned(tmp_path: Path) -> None:
    mixtral = {**QWEN25_7B, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
    dense_layers = {**QWEN3_30B_A3B, "mlp_only_layers": [0, 47]}
    for name, config in (("mixtral", mixtral), ("a3b-dense-layers", dense_layers)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    skipped: list[str] = []
    assert memory_plan.read_shape(str(tmp_path / "mixtral"), "teacher.model_path", skipped) is None
    assert memory_plan.read_shape(str(tmp_path / "a3b-dense-layers"), "teacher.model_path", skipped) is None
    assert "whose experts no family of recipe_gkd/models reads (model_type 'mixtral')" in skipped[0]
    assert "a mixture of experts with dense layers" in skipped[1]


# ----------------------------------------------------------------------------- context parallelism

LONG = CONFIG_DIR / "presets" / "1x8_a4_r2_t2_cp2.yaml"
# Qwen3-8B by hand (HUB_MODELS): h 4096, ffn 12288, 32 heads, 8 kv heads, head_dim 128, 36 layers, vocab 151936.
# Values one layer keeps a token at TP 1, no recompute, sdpa (actor_bytes_per_token_and_layer's docstring):
# norms 4h + Qwen3's q/k norm inputs (32 + 8) x 128 = 16384 + 5120; q, output, k, v (2 x 32 + 2 x 8) x 128 = 10240;
# the MLP's fc1 output, its two halves and their product 4 x 12288 = 49152. In bf16, 2 bytes each.
QWEN3_8B_LAYER_BYTES_PER_TOKEN = (16384 + 5120 + 10240 + 49152) * 2  # 161792
# One layer's keys and values of a whole 32768-token sequence after the gather: 2 x 8 kv heads x 128 x 2 bytes a token.
QWEN3_8B_GATHERED_KV_ONE_LAYER = 32768 * 2 * 8 * 128 * 2  # 134217728 = 128 MiB
# The loss's buffers per token and logits column: bf16 logits, fp32 copy, fp32 log-softmax and two fp32 gradients.
LOGITS_BYTES = 2 + 4 + 4 + 4 + 4


def _long_actor(overrides: list[str]) -> dict[str, float]:
    """The actor rank's parts of the long-trace preset (Qwen3-8B, 32768 tokens, 4 actor GPUs) with `overrides`."""
    shape = shape_from_config(HUB_MODELS["Qwen/Qwen3-8B"])
    return dict(memory_plan.actor_memory(load_config(LONG, overrides), shape).parts)


def _part(parts: dict[str, float], prefix: str) -> float:
    (found,) = [b for n, b in parts.items() if n.startswith(prefix)]
    return found


def test_one_layer_at_cp_4_against_a_hand_count() -> None:
    """TP 1 x CP 4, no recompute, one 32768-token sequence: each rank keeps 8192 tokens of every layer's activations,
    its 8192 tokens' logits, and every layer's gathered keys and values of all 32768 (plus one in flight: the
    backward's gradient of them); the optimizer state over data parallel 1 x context parallel 4."""
    split = ["actor.megatron.tp=1", "actor.megatron.cp=4", "actor.megatron.recompute=none"]
    parts = _long_actor(split)
    layers, rank_tokens = 36, 32768 // 4
    assert _part(parts, "activations (1 micro-batch(es) of 8192 tokens per context-parallel rank") == (
        layers * rank_tokens * QWEN3_8B_LAYER_BYTES_PER_TOKEN  # 36 x 8192 x 161792 = 47.7 GB
    )
    assert _part(parts, "logits and loss buffers (8192 tokens x 151936") == rank_tokens * 151936 * LOGITS_BYTES
    assert _part(parts, "gathered keys and values (32768 tokens of the whole sequence x 37 layers") == (
        (layers + 1) * QWEN3_8B_GATHERED_KV_ONE_LAYER
    )
    params = shape_from_config(HUB_MODELS["Qwen/Qwen3-8B"]).num_params()
    # Weights and gradients whole on every rank; master weights + 2 Adam moments (12 bytes) over dp x cp = 4.
    assert _part(parts, "weights (bf16") == params * 2 and _part(parts, "gradient buffer") == params * 4
    assert _part(parts, "optimizer state (fp32 master + Adam moments, distributed over data parallel x context ") == (
        params * 12 / 4
    )
    assert memory_plan.kv_gather_bytes(shape_from_config(HUB_MODELS["Qwen/Qwen3-8B"]), 1, 2, 32768) == (
        QWEN3_8B_GATHERED_KV_ONE_LAYER
    )


def test_cp_4_holds_a_quarter_of_cp_1s_per_token_buffers_and_the_same_model_state() -> None:
    at = {cp: _long_actor(["actor.megatron.tp=1", f"actor.megatron.cp={cp}"]) for cp in (1, 4)}
    activations = {cp: _part(parts, "activations") for cp, parts in at.items()}
    logits = {cp: _part(parts, "logits and loss buffers") for cp, parts in at.items()}
    assert activations[1] == 4 * activations[4] and logits[1] == 4 * logits[4]
    for state in ("weights", "gradient buffer", "optimizer state"):  # dp 4 at cp 1, dp 1 x cp 4: the same shards
        assert _part(at[1], state) == _part(at[4], state)
    # cp = 1: no gather, and the lines read as they always did.
    assert not any(n.startswith("gathered keys") for n in at[1])
    assert "activations (1 micro-batch(es) of 32768 tokens x 36 layers, recompute full, sdpa attention)" in at[1]
    assert "optimizer state (fp32 master + Adam moments, distributed over data parallel 4)" in at[1]


def test_the_gathered_keys_and_values_follow_what_recompute_keeps() -> None:
    """Full recompute keeps no layer's gather: the recomputed layer's and its gradient (2 layers); selective keeps
    sdpa's (every layer + 1); fp32 repeats the keys and values to every query head (32, not 8), 4-byte values."""
    split = ["actor.megatron.tp=1", "actor.megatron.cp=4"]
    full = _part(_long_actor(split), "gathered keys and values (32768 tokens of the whole sequence x 2 layers")
    assert full == 2 * QWEN3_8B_GATHERED_KV_ONE_LAYER
    selective = _long_actor([*split, "actor.megatron.recompute=selective"])
    assert _part(selective, "gathered keys and values") == 37 * QWEN3_8B_GATHERED_KV_ONE_LAYER
    fp32 = _long_actor([*split, "actor.precision=fp32"])
    assert _part(fp32, "gathered keys and values") == 2 * 32768 * 2 * 32 * 128 * 4
    # At TP 2 each rank gathers its 4 of the 8 kv heads.
    tp2 = _long_actor(["actor.megatron.tp=2", "actor.megatron.cp=2"])
    assert _part(tp2, "gathered keys and values") == 2 * QWEN3_8B_GATHERED_KV_ONE_LAYER / 2


def test_an_odd_length_is_padded_to_the_zigzag_chunks() -> None:
    """32764 tokens at cp 4: padded to 32768 (8 chunks of 4096, not 4 of 8191), 8192 a rank; at cp 1 nothing is
    padded."""
    odd = ["rollout.sampling.max_new_tokens=30716", "teacher.max_model_len=32765", "actor.megatron.tp=1"]
    parts = _long_actor([*odd, "actor.megatron.cp=4"])
    assert _part(parts, "logits and loss buffers (8192 tokens") == 8192 * 151936 * LOGITS_BYTES
    assert _part(parts, "gathered keys and values (32768 tokens") == 2 * QWEN3_8B_GATHERED_KV_ONE_LAYER
    dense = _long_actor([*odd, "actor.megatron.cp=1"])
    assert _part(dense, "logits and loss buffers (32764 tokens") == 32764 * 151936 * LOGITS_BYTES


def test_the_long_preset_prints_its_context_parallel_plan(hub_cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(LONG), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "actor rank (x4): 75.2 of 79.0 GiB, fits" in out
    assert "16384 tokens per context-parallel rank (32768 padded / cp 2)" in out
    # 36 layers x 2 x 4 kv heads (8 over TP 2) x 128 x 32768 tokens x 2 bytes x (cp - 1) / cp = 1.125 GiB.
    assert "1.12 GiB received per rank and sequence in the forward" in out


def test_a_sequence_too_long_for_the_split_exits_2_naming_context_parallelism(
    hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At cp = 1 one 32768-token sequence needs 102 GiB of a TP-2 rank even at full recompute (its logits alone take
    41.7 GiB): no recompute or micro-batch helps, a larger cp does, and the dry run names it before anything starts."""
    assert main(["--config", str(LONG), "--dry-run", "actor.megatron.cp=1"]) == 2
    err = capsys.readouterr().err
    assert "config error at `actor.megatron.cp`: actor rank does not fit: needs 102.0 GiB of 79.0 GiB" in err
    assert "split every sequence over context-parallel ranks (actor.megatron.cp=2: 16384 tokens of each" in err


def test_the_remedies_keep_their_order_around_context_parallelism(hub_cache: Path) -> None:
    def key(overrides: list[str]) -> str:
        with pytest.raises(ConfigError) as err:
            plan = memory_plan.build_memory_plan(load_config(LONG, overrides))
            memory_plan.check_memory_plan(plan)  # type: ignore[arg-type]
        return err.value.key

    # The sequence fits at full recompute at this cp: recompute first, as for a short sequence.
    assert key(["actor.megatron.recompute=selective"]) == "actor.megatron.recompute"
    # Two sequences a micro-batch at full recompute: the micro-batch (one sequence fits).
    assert key(["actor.micro_batch_size=2"]) == "actor.micro_batch_size"
    # TP 1 x CP 4: 8192 tokens a rank, but the whole 8B state on each of them leaves too little (76.3 GiB with the
    # optimizer step's temporary); no cp these 4 GPUs take fits: split the student.
    assert key(["actor.megatron.tp=1", "actor.megatron.cp=4"]) == "actor.megatron.tp"
    # cp = 1 and selective recompute: recompute alone cannot fit the sequence, cp (with full recompute) does.
    with pytest.raises(ConfigError) as err:
        plan = memory_plan.build_memory_plan(
            load_config(LONG, ["actor.megatron.cp=1", "actor.megatron.recompute=selective"])
        )
        memory_plan.check_memory_plan(plan)  # type: ignore[arg-type]
    assert err.value.key == "actor.megatron.cp"
    assert "actor.megatron.cp=2: 16384 tokens of each per rank, with actor.megatron.recompute=full" in err.value.message


def test_the_long_presets_longest_sequence_in_docs_is_the_plans_boundary() -> None:
    """docs/context_parallel.md's table (benchmarks/cp_lengths_table.py): the preset's actor fits 37,328 tokens at its
    cp 2 and not one more; at cp 1, 18,751."""
    shape = shape_from_config(HUB_MODELS["Qwen/Qwen3-8B"])

    def fits(length: int, cp: int) -> bool:
        response, model_len = length - 2048, length + 1  # its 2048-token prompt
        over = [f"rollout.sampling.max_new_tokens={response}", f"teacher.max_model_len={model_len}"]
        over += [f"actor.megatron.cp={cp}", "cluster.gpu_memory_gib=79.0"]
        role = memory_plan.actor_memory(load_config(LONG, over), shape)
        return role.total <= role.capacity

    assert fits(37328, 2) and not fits(37329, 2)
    assert fits(18751, 1) and not fits(18752, 1)
