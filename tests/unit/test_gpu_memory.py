"""cluster.gpu_memory_gib: the memory plan budgets the real GPU (recipe_gkd/gpu_memory.py), read with a stubbed
nvidia-smi; a configured size that is not the device's names the key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from recipe_gkd import gpu_memory
from recipe_gkd.config import CONFIG_DIR, ConfigError, load_config
from recipe_gkd.main import main

ONE_GPU = CONFIG_DIR / "presets" / "1x1_colocated.yaml"
# nvidia-smi's memory.total (MiB) of an 80 GB H100 and of a 40 GB A100.
H100_MIB, A100_40_MIB = 81559, 40960


def gpus(*mib: int) -> gpu_memory.GpuQuery:
    return lambda: [(str(i), f"GPU-{i:04d}", m) for i, m in enumerate(mib)]


@pytest.fixture(autouse=True)
def no_preset_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_zero_reads_the_device() -> None:
    got = gpu_memory.plan_gpu_memory(load_config(ONE_GPU), gpus(A100_40_MIB))
    assert got.gib == 40.0 and "GPU 0" in got.source


def test_a_configured_size_that_is_not_the_devices_names_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        gpu_memory.plan_gpu_memory(load_config(ONE_GPU, ["cluster.gpu_memory_gib=79"]), gpus(A100_40_MIB))
    assert err.value.key == "cluster.gpu_memory_gib" and "40.0 GiB" in str(err.value)
    # torch's and nvidia-smi's totals of one device differ by well under the tolerance.
    cfg = load_config(ONE_GPU, ["cluster.gpu_memory_gib=79.2"])
    assert gpu_memory.plan_gpu_memory(cfg, gpus(H100_MIB)).gib == 79.2


def test_no_gpu_keeps_the_plan_as_configured() -> None:
    assert gpu_memory.plan_gpu_memory(load_config(ONE_GPU), lambda: None).gib == gpu_memory.DEFAULT_GPU_MEMORY_GIB
    cfg = load_config(ONE_GPU, ["cluster.gpu_memory_gib=40"])
    assert gpu_memory.plan_gpu_memory(cfg, lambda: None).gib == 40.0


def test_the_plans_gpus_are_read_through_a_preset_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_VISIBLE_DEVICES=1: the run's GPU 0 is the node's GPU 1 (nvidia-smi lists every GPU of the node)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    got = gpu_memory.plan_gpu_memory(load_config(ONE_GPU), gpus(H100_MIB, A100_40_MIB))
    assert got.gib == 40.0 and "GPU 1" in got.source
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0001")
    assert gpu_memory.plan_gpu_memory(load_config(ONE_GPU), gpus(H100_MIB, A100_40_MIB)).gib == 40.0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with pytest.raises(ConfigError) as err:
        gpu_memory.plan_gpu_memory(load_config(ONE_GPU), gpus(H100_MIB, A100_40_MIB))
    assert err.value.key == "cluster.gpus_per_node"


def test_query_reads_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real query against a stand-in nvidia-smi on PATH (its csv,noheader,nounits output)."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\necho '0, GPU-aa, {H100_MIB}'\necho '1, GPU-bb, {A100_40_MIB}'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert gpu_memory.query_gpus() == [("0", "GPU-aa", H100_MIB), ("1", "GPU-bb", A100_40_MIB)]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert gpu_memory.query_gpus() is None


def test_dry_run_plans_the_real_gpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """On a 40 GB card the one-GPU preset is planned on 40 GiB, and a 79 configured for it exits 2 naming the key."""
    monkeypatch.setattr(gpu_memory, "query_gpus", gpus(A100_40_MIB))
    main(["--config", str(ONE_GPU), "--dry-run"])
    out = capsys.readouterr().out
    assert "GiB per GPU of 40.0 GiB, from GPU 0 of this node (nvidia-smi)" in out
    assert main(["--config", str(ONE_GPU), "--dry-run", "cluster.gpu_memory_gib=79"]) == 2
    assert "cluster.gpu_memory_gib" in capsys.readouterr().err
