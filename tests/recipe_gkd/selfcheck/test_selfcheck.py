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


@pytest.mark.parametrize(("measured", "fits"), [(0.012, True), (0.06, False)])
def test_the_bf16_sync_difference_is_recorded_against_the_default_tolerance(
    tmp_path: Path, measured: float, fits: bool
) -> None:
    """The self-check says whether weight_sync.check_tolerance's bf16 default (0.1) fits the device: a measured
    difference must stay 2x below it, or the record names the key and the value to set."""
    from recipe_gkd.config import load_config, to_yaml

    row = {"generate_s": 1.0, "teacher_s": 1.0, "train_s": 1.0, "sync_s": 1.0, "step_s": 4.0, "response_tokens": 9}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(row | {"sync_logprob_diff": measured}) + "\n")
    (tmp_path / "resolved_config.yaml").write_text(to_yaml(load_config(None, ["actor.precision=bf16"])))
    figures = selfcheck.run_figures(tmp_path, student_bytes=1e9)
    assert figures["sync_precision"] == "bf16" and figures["sync_tolerance_default"] == 0.1
    assert figures["sync_tolerance_default_fits"] is fits
    if fits:
        assert figures["sync_tolerance_verdict"].startswith("fits: the largest difference measured, 0.012, is 8x below")
    else:
        assert "set weight_sync.check_tolerance >= 0.12" in figures["sync_tolerance_verdict"]


def test_the_gpu_wheel_script_states_its_usage(repo_root: Path) -> None:
    """launch/gpu_wheels.sh needs the registry (run by hand, measured in docs/gpu_splits.md); without a directory it
    exits 2 with its usage, which names the install line for the node."""
    import subprocess

    done = subprocess.run(
        ["bash", str(repo_root / "launch" / "gpu_wheels.sh")], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2
    assert "pip install --no-index --find-links DIR -e '.[vllm]'" in done.stdout


def fake_vllm_wheel(directory: Path, version: str, torch_pin: str) -> Path:
    """A wheel shaped as vLLM's (its METADATA pins torch exactly, as 0.24.0's `torch==2.11.0` and 0.33.0's
    `torch==2.14.0` do), holding nothing else."""
    import zipfile

    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"vllm-{version}-py3-none-any.whl"
    info = f"vllm-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\nRequires-Dist: torch=={torch_pin}\n"
    metadata += "Requires-Dist: torchaudio==2.11.0\n"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{info}/METADATA", metadata)
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return wheel


def test_the_gpu_wheel_script_takes_the_torch_its_vllm_release_pins(repo_root: Path, tmp_path: Path) -> None:
    """--vllm 0.33.0 resolves against torch 2.14.0 (its wheel's pin), not a fixed 2.11.0; a --torch that is not
    the pin exits 2 naming it. Offline: pip reads a local directory holding a vLLM-shaped wheel only."""
    import os
    import subprocess
    import sys

    links = tmp_path / "index"
    fake_vllm_wheel(links, "0.33.0", "2.14.0")
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links), "PYTHON": sys.executable}
    script = [str(repo_root / "launch" / "gpu_wheels.sh"), str(tmp_path / "out"), "--vllm", "0.33.0"]
    done = subprocess.run(["bash", *script], capture_output=True, text=True, timeout=120, env=env)
    # The resolution that follows needs the registry (ray, megatron-core, ...): it fails here, after the pin.
    assert "resolving for Python 3.12, vllm 0.33.0, torch 2.14.0" in done.stdout, done.stdout + done.stderr
    done = subprocess.run(["bash", *script, "--torch", "2.11.0"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and "vllm 0.33.0 pins torch==2.14.0" in done.stderr


def test_torch_pin_reads_the_wheels_metadata(repo_root: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    for version, pin in (("0.24.0", "2.11.0"), ("0.33.0", "2.14.0")):  # as their PyPI wheels' METADATA say
        wheel = fake_vllm_wheel(tmp_path, version, pin)
        done = subprocess.run(
            [sys.executable, str(repo_root / "launch" / "torch_pin.py"), str(wheel)], capture_output=True, text=True
        )
        assert done.stdout.strip() == pin


# ----------------------------------------------------------------------------- stage 0 (no Ray, no vLLM)


def test_stage0_a_failing_check_keeps_its_traceback_and_the_rest_still_run(tmp_path: Path) -> None:
    """A check that raises (an unknown loss kind) is recorded failed with its traceback; the next one runs, and
    the record written after each check names the checks not reached yet."""
    from recipe_gkd.selfcheck.record import Check
    from recipe_gkd.selfcheck.sizes import TINY
    from recipe_gkd.selfcheck.stage0 import StageCheck, loss_check, run_checks

    written: list[tuple[list[str], dict[str, str]]] = []

    def after_each(done: list[Check], skipped: dict[str, str]) -> None:
        written.append(([c.status for c in done], dict(skipped)))

    checks = [
        StageCheck("loss_warp", 0.0, lambda: loss_check("warp", TINY)),
        StageCheck("loss_topk", 0.0, lambda: loss_check("topk", TINY)),
    ]
    done, skipped = run_checks(checks, budget_s=60.0, after_each=after_each)
    assert [c.status for c in done] == ["failed", "passed"] and not skipped
    assert "KeyError: 'warp'" in done[0].detail and "Traceback" in done[0].detail
    assert written[0] == (["failed"], {"loss_topk": "not reached (the run stopped before it)"})
    assert written[1] == (["failed", "passed"], {})


def test_stage0_skips_what_its_time_budget_cannot_hold(tmp_path: Path) -> None:
    from recipe_gkd.selfcheck.record import Check
    from recipe_gkd.selfcheck.sizes import TINY
    from recipe_gkd.selfcheck.stage0 import StageCheck, loss_check, run_checks

    checks = [
        StageCheck("loss_topk", 1.0, lambda: loss_check("topk", TINY)),
        StageCheck("loop", 100.0, lambda: Check("loop", "passed")),
    ]
    done, skipped = run_checks(checks, budget_s=30.0, after_each=lambda done, skipped: None)
    assert [c.name for c in done] == ["loss_topk"]
    assert skipped["loop"].startswith("time budget: ") and skipped["loop"].endswith("of 30 s, estimated 100 s")


def test_stage0_device_facts_and_losses_on_a_cpu(tmp_path: Path) -> None:
    """Without a GPU: no nvidia-smi rows, CUDA not available, and the plan's fallback size (an 80 GB card) said
    with its reason; the losses at the tiny sizes are finite, each with its plan line."""
    assert (
        selfcheck.main(["--stage", "0", "--sizes", "tiny", "--out", str(tmp_path), "--only", "device,loss_hidden"]) == 0
    )
    record = json.loads((tmp_path / "selfcheck.json").read_text())
    device, hidden = record["checks"]
    assert device["figures"]["cuda"] == "not available" and device["figures"]["plan_gpu_gib"] == 79.0
    assert "no GPU here" in device["figures"]["plan_source"]
    packages = (tmp_path / "image_packages.txt").read_text().splitlines()
    assert len(packages) == device["figures"]["installed_distributions"] and any(
        p.startswith("torch==") for p in packages
    )
    assert hidden["status"] == "passed" and 0 < hidden["figures"]["T64_loss"] < 10
    # The hidden loss's plan line: the logits' buffers at T=64, V=2048 plus the chunk buffers (256 MiB).
    assert hidden["figures"]["T64_plan_gib"] == pytest.approx(64 * 2048 * 18 / 2**30 + 0.25)
    assert record["skipped"]["loop"] == "not asked for (--only)"
    assert "stage 0 (tiny sizes" in (tmp_path / "selfcheck.md").read_text()


def test_stage0_refuses_unknown_checks_and_gpu_sizes_without_a_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert selfcheck.main(["--stage", "0", "--out", str(tmp_path), "--only", "warp_drive"]) == 2
    assert "actor_topk_recompute_selective" in capsys.readouterr().err
    assert selfcheck.main(["--stage", "0", "--out", str(tmp_path), "--sizes", "gpu"]) == 2
    assert "--sizes gpu needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("output", ["topk", "hidden"])
def test_stage0_gpu_configs_validate_here(tmp_path: Path, output: str) -> None:
    """What stage 0 runs on the GPU is a valid config (found here, not in the GPU's minutes): the one-GPU preset with
    the HF engines, bf16, the distributed optimizer, each recompute setting, the stage's sizes."""
    from recipe_gkd.config import Device, Precision
    from recipe_gkd.selfcheck.sizes import GPU
    from recipe_gkd.selfcheck.stage0_actor import stage0_config

    for recompute in ("none", "selective", "full"):
        overrides = (f"actor.megatron.recompute={recompute}", f"teacher.output={output}")
        cfg = stage0_config(tmp_path, tmp_path / "models", GPU, "a", *overrides)
        assert cfg.actor.megatron.recompute.value == recompute and cfg.teacher.output.value == output
        assert cfg.cluster.device == Device.cuda and cfg.actor.precision == Precision.bf16
        assert cfg.actor.megatron.distributed_optimizer and cfg.actor.max_tokens_per_micro_batch == 4096
        assert cfg.teacher.max_model_len >= cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens + 1


FAKE_NVIDIA_SMI = """#!/bin/sh
# nvidia-smi as an H100 node of two GPUs prints it (csv, noheader; nounits for the memory plan's query)
case "$1" in
  --query-gpu=index,uuid,memory.total) printf '0, GPU-aaaa, 81559\\n1, GPU-bbbb, 81559\\n' ;;
  --query-gpu=index,uuid,memory.total,mig.mode.current) printf '0, GPU-aaaa, 81559 MiB, Disabled\\n1, GPU-bbbb, 81559 MiB, Enabled\\n' ;;
  *) exit 9 ;;
esac
"""


# CUDA's view of that node under each mask: whole H100s by index or UUID, and a 3g.40gb MIG instance.
CUDA_DEVICES = {
    None: ("NVIDIA H100 80GB HBM3", 81079),
    "GPU-bbbb": ("NVIDIA H100 80GB HBM3", 81079),
    "MIG-0c1d": ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 40192),
}


@pytest.mark.parametrize(("visible", "plan_gib"), [(None, 79.2), ("GPU-bbbb", 79.2), ("MIG-0c1d", 39.2)])
def test_stage0_device_check_reads_what_the_memory_plan_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, visible: str | None, plan_gib: float
) -> None:
    """The device check records nvidia-smi's rows and the size the plan reads as CUDA sees it through
    CUDA_VISIBLE_DEVICES: a MIG instance at its own size, not its parent's (nvidia-smi's row)."""
    from recipe_gkd.plan import gpu_memory
    from recipe_gkd.selfcheck.sizes import TINY
    from recipe_gkd.selfcheck.stage0 import device_check

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(gpu_memory, "query_gpus", lambda: [gpu_memory.VisibleGpu(*CUDA_DEVICES[visible])])
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    check = device_check(tmp_path, tmp_path / "models", TINY)
    assert check.figures["nvidia_smi"][1] == "1, GPU-bbbb, 81559 MiB, Enabled"
    assert check.figures["CUDA_VISIBLE_DEVICES"] == (visible or "(unset)")
    assert check.status == "passed" and check.figures["plan_gpu_gib"] == plan_gib
    name = CUDA_DEVICES[visible][0]
    assert check.figures["plan_source"] == f"GPU {visible or '0'} of this node ({name}), as CUDA sees it"


@pytest.mark.parametrize("name", ["learn_demo", "learn_tools"])
def test_stage0_learning_checks_run_the_cpu_presets_as_shipped_on_the_gpu_in_bf16(tmp_path: Path, name: str) -> None:
    """The learning checks' GPU configs (found valid here, not in the GPU's minutes): the preset's objective,
    schedule, learning rate and batch unchanged; CUDA, bf16 and the distributed optimizer; the preset's 150 steps,
    evaluated before the first and after the last; the assets' paths made absolute (the check runs anywhere)."""
    from recipe_gkd.config import Device, Precision, load_config
    from recipe_gkd.selfcheck.sizes import GPU
    from recipe_gkd.selfcheck.stage0_learn import LEARN_PRESETS, learn_config

    preset = load_config(LEARN_PRESETS[name], [])
    cfg = learn_config(name, tmp_path, GPU)
    assert cfg.cluster.device == Device.cuda and cfg.actor.precision == Precision.bf16
    assert cfg.actor.megatron.distributed_optimizer and not cfg.cluster.fake_gpus
    assert cfg.trainer.total_steps == preset.trainer.total_steps == 150 and cfg.trainer.eval_every == 150
    assert cfg.data.eval_batch_size == 200 and cfg.trainer.save_every == 0
    assert (cfg.algorithm, cfg.actor.optim, cfg.rollout.sampling) == (
        preset.algorithm,
        preset.actor.optim,
        preset.rollout.sampling,
    )
    assert cfg.data.train_batch_size == preset.data.train_batch_size and cfg.rollout.env == preset.rollout.env
    for path in (cfg.model.student_path, cfg.teacher.model_path, *cfg.data.train_files, *cfg.data.eval_files):
        assert Path(path).is_absolute() and Path(path).exists(), path
    assert Path(cfg.trainer.run_dir) == tmp_path / name


def test_stage0_learning_verdict_asks_for_every_step_both_evaluations_and_the_gain() -> None:
    """The learning check fails, saying why, on a missing step, a loss not finite, an evaluation missing at the
    first or last step, or a gain below the sizes' least; it passes with the accuracies in its detail."""
    from recipe_gkd.selfcheck.sizes import GPU
    from recipe_gkd.selfcheck.stage0_learn import learn_verdict

    rows = [{"step": s, "loss": 0.1} for s in range(1, 151)]
    evals = [{"step": 0, "eval_reward": 0.27}, {"step": 150, "eval_reward": 0.79}]
    assert learn_verdict(rows, evals, GPU) == ("passed", "held-out accuracy 27.0% -> 79.0% (+52.0%)")
    assert learn_verdict(rows[:-1], evals, GPU)[1] == "149 of 150 steps logged, or a loss not finite"
    assert learn_verdict([*rows[:-1], {"step": 150, "loss": float("nan")}], evals, GPU)[0] == "failed"
    assert learn_verdict(rows, evals[1:], GPU) == ("failed", "evaluations at steps [150], expected 0 and 150")
    assert learn_verdict(rows, evals[:1], GPU) == ("failed", "evaluations at steps [0], expected 0 and 150")
    status, detail = learn_verdict(rows, [evals[0], {"step": 150, "eval_reward": 0.45}], GPU)
    assert status == "failed" and "a gain of +18.0%, below the 20%" in detail


def test_a_learning_record_keeps_the_trend_of_its_steps() -> None:
    """The first and last ten steps' means of each logged column the record keeps (a single-turn run has no
    tool columns); a column a row lacks or logs as None is left out of its means."""
    from recipe_gkd.selfcheck.stage0_learn import trend

    rows = [{"loss": float(s), "grad_norm": 1.0, "tool_calls": None, "reward": s / 100} for s in range(1, 31)]
    got = trend(rows)
    assert got["loss"] == [5.5, 25.5] and got["grad_norm"] == [1.0, 1.0]
    assert got["reward"] == pytest.approx([0.055, 0.255]) and "tool_calls" not in got and "turns" not in got
