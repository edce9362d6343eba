"""Preflight: named checks in order, one finding each, the first error stops, a ConfigError names its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipe_gkd.config import CONFIG_DIR, ConfigError, load_config
from recipe_gkd.models import UnsupportedModelError
from recipe_gkd.preflight import DRY_RUN_CHECKS, START_CHECKS, Check, Finding, Status, run_checks, student_split


def test_checks_run_in_order_until_the_first_error() -> None:
    ran: list[str] = []

    def ok(name: str) -> Check:
        return Check(name, lambda cfg: ran.append(name) or f"{name} fine")

    def broken(cfg: object) -> str:
        ran.append("broken")
        raise ConfigError("data.max_prompt_length", "too short for the first record")

    def warns(cfg: object) -> Finding:
        ran.append("warns")
        return Finding("warns", Status.warning, "close to the limit", "actor.micro_batch_size")

    cfg = load_config(None, [])
    findings = list(run_checks([ok("a"), Check("warns", warns), Check("broken", broken), ok("never")], cfg))
    assert ran == ["a", "warns", "broken"]
    assert [(f.check, f.status) for f in findings] == [
        ("a", Status.ok),
        ("warns", Status.warning),
        ("broken", Status.error),
    ]
    assert findings[0].line == "a fine" and not findings[1].failed
    assert findings[2].key == "data.max_prompt_length" and "too short" in findings[2].line


def test_a_missing_student_is_the_first_start_checks_error(tmp_path: Path) -> None:
    cfg = load_config(None, [f"model.student_path={tmp_path / 'nowhere'}"])
    findings = list(run_checks(START_CHECKS, cfg))
    assert [f.check for f in findings] == ["local paths"] and findings[0].key == "model.student_path"
    assert [c.name for c in DRY_RUN_CHECKS] == ["memory plan"]


def test_the_cpu_demo_passes_every_start_check(repo_root: Path) -> None:
    cfg = load_config(None, [])
    findings = list(run_checks(START_CHECKS, cfg))
    assert [f.status for f in findings] == [Status.ok] * len(START_CHECKS), [f.line for f in findings]
    assert {f.check for f in findings} == {c.name for c in START_CHECKS}


def test_a_python_tool_that_cannot_be_sandboxed_here_is_refused_before_the_workers(monkeypatch) -> None:
    from recipe_gkd.envs import sandbox

    cfg = load_config(None, ["rollout.env=python", "data.max_prompt_length=256"])
    environment = next(c for c in START_CHECKS if c.name == "environment")
    if not isinstance(sandbox.bubblewrap_isolation(), str):  # this machine can sandbox: the check passes
        assert environment.finding(cfg).status == Status.ok
    monkeypatch.setattr(sandbox, "bubblewrap_isolation", lambda: "bwrap is not on PATH")
    finding = environment.finding(cfg)
    assert finding.failed and finding.key == "rollout.tool_isolation" and "bwrap is not on PATH" in finding.line


def test_the_student_split_check_refuses_expert_parallelism_without_experts(tmp_path: Path) -> None:
    """actor.megatron.ep reaches the start check: a dense student (config.json only) is refused naming the key."""
    from transformers import Qwen3Config

    Qwen3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ).save_pretrained(tmp_path)
    preset = CONFIG_DIR / "presets" / "2x8_a8_r4_t4.yaml"  # 8 actor GPUs at TP 2: data parallel 4
    split = [f"model.student_path={tmp_path}", "actor.megatron.ep=2"]
    with pytest.raises(UnsupportedModelError, match=r"actor\.megatron\.ep=2 but the student is a dense model"):
        student_split(load_config(preset, split))
    assert student_split(load_config(preset, split[:1])).endswith("ep=1")


def test_the_student_split_check_refuses_a_mixture_of_experts_at_tensor_parallel(tmp_path: Path) -> None:
    """megatron's MoE layer does not train at TP > 1 without sequence parallelism: refused at start naming
    actor.megatron.tp, while TP=1 with the experts split over EP passes."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(
        vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    ).save_pretrained(tmp_path)  # fmt: skip
    preset = CONFIG_DIR / "presets" / "2x8_a8_r4_t4.yaml"  # 8 actor GPUs at TP 2
    with pytest.raises(UnsupportedModelError, match=r"actor\.megatron\.tp=2 with a mixture-of-experts student"):
        student_split(load_config(preset, [f"model.student_path={tmp_path}", "actor.megatron.ep=2"]))
    split = [f"model.student_path={tmp_path}", "actor.megatron.tp=1", "actor.megatron.ep=8"]
    assert student_split(load_config(preset, split)).endswith("ep=8")
    with pytest.raises(UnsupportedModelError, match=r"actor\.lora\.rank=8 with a mixture-of-experts student"):
        student_split(load_config(preset, [*split, "actor.lora.rank=8"]))
