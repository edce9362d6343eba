"""cluster.gpu_memory_gib: the memory plan budgets the real GPU as CUDA sees it (recipe_gkd/plan/gpu_memory.py), read
through a stand-in for CUDA's view of a node (whole GPUs and a MIG slice, index and UUID masks); a configured size
that is not the device's names the key."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from recipe_gkd.config import CONFIG_DIR, ConfigError, load_config
from recipe_gkd.main import main
from recipe_gkd.plan import gpu_memory

ONE_GPU = CONFIG_DIR / "presets" / "1x1_colocated.yaml"
# CUDA's total (MiB) of an 80 GB H100, a 40 GB A100, and a 3g.40gb MIG slice of an 80 GB A100.
H100_MIB, A100_40_MIB, MIG_3G_40GB_MIB = 81079, 40326, 40192
MIG = "MIG-5c89a2f6-1d3e-5b8e-a1f0-9a3c2b1d4e5f"
# A node as CUDA would show it: index and UUID of each GPU, and one MIG instance on a third GPU.
NODE = {
    ("0", "GPU-0000"): ("NVIDIA H100 80GB HBM3", H100_MIB),
    ("1", "GPU-0001"): ("NVIDIA A100-SXM4-40GB", A100_40_MIB),
    (MIG,): ("NVIDIA A100-SXM4-80GB MIG 3g.40gb", MIG_3G_40GB_MIB),
}


def cuda_view() -> list[gpu_memory.VisibleGpu]:
    """What CUDA enumerates under this process's CUDA_VISIBLE_DEVICES: the mask's devices in its order (all
    whole GPUs without one); it stops at the first entry that names no device."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    keys = [k for k in NODE if k[0].isdigit()] if mask is None else [(e.strip(),) for e in mask.split(",")]
    seen = []
    for key in keys:
        found = [v for k, v in NODE.items() if key[0] in k]
        if not found:
            break
        seen.append(gpu_memory.VisibleGpu(*found[0]))
    return seen


def gpus(*mib: int) -> gpu_memory.GpuQuery:
    return lambda: [gpu_memory.VisibleGpu(f"GPU model {i}", m) for i, m in enumerate(mib)]


@pytest.fixture(autouse=True)
def no_preset_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_zero_reads_the_device() -> None:
    got = gpu_memory.plan_gpu_memory(load_config(ONE_GPU), gpus(A100_40_MIB))
    assert got.gib == 39.4 and "GPU 0 of this node (GPU model 0)" in got.source


def test_a_configured_size_that_is_not_the_devices_names_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        gpu_memory.plan_gpu_memory(load_config(ONE_GPU, ["cluster.gpu_memory_gib=79"]), gpus(A100_40_MIB))
    assert err.value.key == "cluster.gpu_memory_gib" and "39.4 GiB" in str(err.value)
    # nvidia-smi's and CUDA's totals of one device differ by well under the tolerance.
    cfg = load_config(ONE_GPU, ["cluster.gpu_memory_gib=79.6"])
    assert gpu_memory.plan_gpu_memory(cfg, gpus(H100_MIB)).gib == 79.6


def test_no_gpu_keeps_the_plan_as_configured() -> None:
    assert gpu_memory.plan_gpu_memory(load_config(ONE_GPU), lambda: None).gib == gpu_memory.DEFAULT_GPU_MEMORY_GIB
    cfg = load_config(ONE_GPU, ["cluster.gpu_memory_gib=40"])
    assert gpu_memory.plan_gpu_memory(cfg, lambda: None).gib == 40.0


@pytest.mark.parametrize(
    ("mask", "gib", "device"),
    [
        ("1", 39.4, "GPU 1 of this node (NVIDIA A100-SXM4-40GB)"),
        ("GPU-0001", 39.4, "GPU GPU-0001 of this node (NVIDIA A100-SXM4-40GB)"),
        # A MIG slice is planned at its own 39.2 GiB, not its parent's 80 GB (nvidia-smi --query-gpu's figure).
        (MIG, 39.2, f"GPU {MIG} of this node (NVIDIA A100-SXM4-80GB MIG 3g.40gb)"),
    ],
)
def test_the_plans_gpus_are_the_masks_devices(
    monkeypatch: pytest.MonkeyPatch, mask: str, gib: float, device: str
) -> None:
    """An index, GPU- or MIG- UUID mask: the run's GPU 0 is the device CUDA shows first."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    got = gpu_memory.plan_gpu_memory(load_config(ONE_GPU), cuda_view)
    assert (got.gib, got.source) == (gib, f"{device}, as CUDA sees it")


def test_a_mask_narrower_than_the_split_names_gpus_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with pytest.raises(ConfigError) as err:
        gpu_memory.plan_gpu_memory(load_config(ONE_GPU), cuda_view)
    assert err.value.key == "cluster.gpus_per_node" and "CUDA shows this node 0 GPU(s)" in str(err.value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{MIG},1")
    cfg = load_config(CONFIG_DIR / "presets" / "1x4_a1_r1_t2.yaml")
    with pytest.raises(ConfigError) as err:
        gpu_memory.plan_gpu_memory(cfg, cuda_view)
    assert err.value.key == "cluster.gpus_per_node"
    assert f"is 4 but CUDA shows this node 2 GPU(s) (CUDA_VISIBLE_DEVICES={MIG},1)" in str(err.value)


def test_the_cuda_query_runs_in_a_child_and_is_parsed() -> None:
    """The real child script (no CUDA on this machine: no GPU), a child's output as a GPU node prints it, and a
    child that fails: the error names cluster.gpu_memory_gib unless a size is configured."""
    assert gpu_memory.run_cuda_query([sys.executable, "-c", gpu_memory.CUDA_QUERY]) == []
    printed = f"import json; print(json.dumps([[{NODE[(MIG,)][0]!r}, {MIG_3G_40GB_MIB * 2**20}]]))"
    assert gpu_memory.run_cuda_query([sys.executable, "-c", printed]) == [gpu_memory.VisibleGpu(*NODE[(MIG,)])]
    failing = [sys.executable, "-c", "import sys; sys.exit('CUDA driver version is insufficient')"]
    with pytest.raises(gpu_memory.GpuReadError, match=r"exit 1\): CUDA driver version is insufficient"):
        gpu_memory.run_cuda_query(failing)

    def broken() -> None:
        gpu_memory.run_cuda_query(failing)

    with pytest.raises(ConfigError) as err:
        gpu_memory.plan_gpu_memory(load_config(ONE_GPU), broken)  # type: ignore[arg-type]
    assert err.value.key == "cluster.gpu_memory_gib"
    got = gpu_memory.plan_gpu_memory(load_config(ONE_GPU, ["cluster.gpu_memory_gib=40"]), broken)  # type: ignore[arg-type]
    assert got.gib == 40.0 and "not checked" in got.source


def test_a_query_that_hangs_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_memory, "QUERY_TIMEOUT_S", 0.5)
    with pytest.raises(gpu_memory.GpuReadError, match="took over"):
        gpu_memory.run_cuda_query([sys.executable, "-c", "import time; time.sleep(30)"])


def test_no_driver_starts_no_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_memory, "DRIVER_MARKERS", (tmp_path / "nvidiactl",))
    monkeypatch.setattr(gpu_memory, "run_cuda_query", lambda cmd: pytest.fail(f"started {cmd}"))
    assert gpu_memory.query_gpus() is None


def test_dry_run_plans_the_real_gpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """On a MIG slice the one-GPU preset is planned on the slice's size, and a 79 configured for it exits 2."""
    monkeypatch.setattr(gpu_memory, "query_gpus", cuda_view)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG)
    assert main(["--config", str(ONE_GPU), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"GiB per GPU of 39.2 GiB, from GPU {MIG} of this node" in out
    assert main(["--config", str(ONE_GPU), "--dry-run", "cluster.gpu_memory_gib=79"]) == 2
    assert "cluster.gpu_memory_gib" in capsys.readouterr().err
