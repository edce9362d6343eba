"""The self-check (python -m recipe_gkd.selfcheck) on this CPU machine: what it records and what it skips.

The full CPU self-check runs five CLI runs (minutes); here the in-process loss check and the record,
and the figures read from a run directory's metrics.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipe_gkd import selfcheck


def test_the_loss_check_records_device_versions_figures_and_what_it_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert selfcheck.main(["--out", str(tmp_path), "--only", "loss"]) == 0
    record = json.loads((tmp_path / "selfcheck.json").read_text())
    assert record["machine"]["on_gpu"] is False and "torch" in record["machine"]["versions"]
    [check] = record["checks"]
    assert check["name"] == "loss_V32768_T1024_K64" and check["status"] == "passed"
    assert check["figures"]["forward_backward_s"] > 0 and check["figures"]["loss"] > 0
    # Without a GPU, every GPU-only check is listed with its reason; the CLI checks not asked for too.
    assert "NCCL weight sync" in record["skipped"] and record["skipped"]["colocated_vllm"] == "not asked for (--only)"
    markdown = (tmp_path / "selfcheck.md").read_text()
    assert "| loss_V32768_T1024_K64 | passed |" in markdown and "## Skipped" in markdown
    assert "record:" in capsys.readouterr().out


def test_an_unknown_check_exits_2_listing_the_known_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert selfcheck.main(["--out", str(tmp_path), "--only", "warp_drive"]) == 2
    assert "colocated_hf" in capsys.readouterr().err


def test_run_figures_from_a_run_directory(tmp_path: Path) -> None:
    rows = [
        {"generate_s": g, "teacher_s": 0.5, "train_s": 1.0, "sync_s": s, "step_s": 3.0, "response_tokens": 100}
        | ({"sync_logprob_diff": d} if d is not None else {})
        | {"actor0_gpu_peak_mb": peak}
        for g, s, d, peak in ((1.0, 0.2, 3e-6, 1000.0), (3.0, 0.4, None, 3000.0), (2.0, 0.3, 5e-6, 2000.0))
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "third_party.log").write_text("INFO ... GPU KV cache size: 118,805 tokens\n")
    figures = selfcheck.run_figures(tmp_path, student_bytes=3e9)
    assert figures["steps"] == 3 and figures["median_generate_s"] == 2.0 and figures["median_sync_s"] == 0.3
    assert figures["tokens_generated_per_s"] == pytest.approx(300 / 6.0)
    assert figures["sync_gb_per_s"] == pytest.approx(10.0)
    assert figures["sync_logprob_diff_max"] == 5e-6 and figures["peak_actor0_gpu_peak_mb"] == 3000.0
    assert figures["vllm_kv_cache_reported"] == ["GPU KV cache size: 118,805 tokens"]


def test_the_gpu_wheel_script_states_its_usage(repo_root: Path) -> None:
    """launch/gpu_wheels.sh needs the registry (run by hand, measured in docs/gpu_splits.md); without a directory it
    exits 2 with its usage, which names the install line for the node."""
    import subprocess

    done = subprocess.run(
        ["bash", str(repo_root / "launch" / "gpu_wheels.sh")], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2
    assert "pip install --no-index --find-links DIR -e '.[vllm]'" in done.stdout
