"""/dev/shm at launch (recipe_gkd/plan/shm.py): a GPU run refuses a container's 64 MB default, naming the fix."""

from __future__ import annotations

import os

import pytest

from recipe_gkd.config import CONFIG_DIR, ConfigError, load_config
from recipe_gkd.plan.shm import NCCL_SHM_MIB, check_shared_memory

ONE_GPU = CONFIG_DIR / "presets" / "1x1_colocated.yaml"
EIGHT_GPUS = CONFIG_DIR / "presets" / "1x8_a2_r2_t4.yaml"
MIB = 1024 * 1024


def shm_with(free_mib: int) -> object:
    """A statvfs of /dev/shm with `free_mib` available (4 KiB blocks)."""

    def statvfs(path: str) -> os.statvfs_result:
        assert path == "/dev/shm"
        blocks = free_mib * MIB // 4096
        return os.statvfs_result((4096, 4096, blocks * 2, blocks, blocks, 0, 0, 0, 0, 255))

    return statvfs


def test_dockers_default_64mb_is_refused_naming_the_fix() -> None:
    cfg = load_config(ONE_GPU)
    with pytest.raises(ConfigError) as err:
        check_shared_memory(cfg, 2400, shm_with(64))  # type: ignore[arg-type]
    assert err.value.key == "cluster.ray_object_store_mb"
    assert "--shm-size=3g" in str(err.value) and "64 MiB free" in str(err.value)


def test_room_for_the_store_and_nccl_passes() -> None:
    cfg = load_config(EIGHT_GPUS)  # actor ranks and the weight sync over NCCL
    check_shared_memory(cfg, 256, shm_with(256 + NCCL_SHM_MIB))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="NCCL"):
        check_shared_memory(cfg, 256, shm_with(256 + NCCL_SHM_MIB - 1))  # type: ignore[arg-type]


def test_a_joined_cluster_needs_room_for_nccl_only() -> None:
    cfg = load_config(EIGHT_GPUS, ["cluster.ray_address=auto"])  # its store was made by launch/ray_start.sh
    check_shared_memory(cfg, 100_000, shm_with(NCCL_SHM_MIB))  # type: ignore[arg-type]


def test_cpu_runs_are_not_checked() -> None:
    check_shared_memory(load_config(None), 256, shm_with(1))  # type: ignore[arg-type]
