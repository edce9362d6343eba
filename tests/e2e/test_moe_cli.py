"""The mixture-of-experts preset through the CLI: a Qwen3-MoE student at actor.megatron.ep=2 on Ray's fake GPUs, its
experts synced into the HF rollout engine every step and checked, the router's statistics in metrics.jsonl, the
exported student a Qwen3MoeForCausalLM (the 150-step runs at EP=2 and EP=1: docs/moe.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from cli_runs import run_to_end

from recipe_gkd.observe.metrics import read_metrics

STEPS = 3
EXPERTS = 4


@pytest.mark.slow
def test_the_moe_preset_trains_at_ep2_through_the_cli(tmp_path: Path, repo_root: Path) -> None:
    run_dir = tmp_path / "moe"
    cmd = [sys.executable, "-m", "recipe_gkd.main", "--config", str(repo_root / "configs/presets/cpu_moe.yaml")]
    cmd += [f"trainer.total_steps={STEPS}", f"trainer.eval_every={STEPS}", "data.eval_batch_size=16"]
    cmd += [f"trainer.run_dir={run_dir}", "weight_sync.check_every=1"]
    proc = run_to_end(cmd)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        loads = [row[f"moe_expert_load_{e}"] for e in range(EXPERTS)]
        assert sum(loads) == pytest.approx(1.0) and min(loads) > 0
        assert row["moe_load_min_ratio"] <= 1.0 <= row["moe_load_max_ratio"]
        assert 0 < row["moe_router_entropy"] < row["moe_router_entropy_uniform"]
        # 2 layers x 4 experts x 3 tensors among those compared with the engine's, every step (check_every=1).
        assert row["sync_tensors_checked"] >= 2 * EXPERTS * 3 and row["sync_logprob_diff"] < 1e-5
    from transformers import AutoModelForCausalLM

    assert type(AutoModelForCausalLM.from_pretrained(run_dir / "final_student")).__name__ == "Qwen3MoeForCausalLM"
