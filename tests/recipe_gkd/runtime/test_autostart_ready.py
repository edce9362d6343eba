"""The driver waits for an autostarted teacher as long as the server waits for its replicas to load.

teacher.timeout_s is one request's limit (60 s in the CPU presets); a GPU teacher's load takes minutes,
and how many is the run's to say: teacher.ready_timeout_s (each teacher's own with `teachers:`).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import teacher_server.client.launcher
from recipe_gkd.config import load_config
from recipe_gkd.runtime.teacher_service import AUTOSTART_MARGIN_S, start_local_teacher
from teacher_server.server.settings import load_settings


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The arguments of every server start_local_teacher launches (the launch itself left out)."""
    seen: list[dict[str, Any]] = []

    @contextmanager
    def fake_start(config: Path, overrides: Any = (), **kwargs: Any) -> Any:
        seen.append({"config": config, **kwargs})
        yield None

    monkeypatch.setattr(teacher_server.client.launcher, "start_teacher", fake_start)
    return seen


def test_autostart_waits_for_the_servers_own_load_limit_not_the_request_timeout(
    tmp_path: Path, started: list[dict[str, Any]]
) -> None:
    cfg = load_config(None, [f"trainer.run_dir={tmp_path}", "teacher.timeout_s=7"])
    with start_local_teacher(cfg):
        pass
    assert started[0]["ready_timeout_s"] == 600.0 + AUTOSTART_MARGIN_S


def test_the_runs_ready_timeout_reaches_the_server_and_the_drivers_wait(
    tmp_path: Path, started: list[dict[str, Any]]
) -> None:
    cfg = load_config(None, [f"trainer.run_dir={tmp_path}", "teacher.ready_timeout_s=2400"])
    with start_local_teacher(cfg):
        pass
    assert started[0]["ready_timeout_s"] == 2400.0 + AUTOSTART_MARGIN_S
    # The server reads the resolved config the driver wrote: its replicas get as long.
    settings = load_settings(started[0]["config"], ["server.gpu_ids=[0]"])
    assert settings.teacher.ready_timeout_s == 2400.0


def test_each_teacher_has_its_own_ready_timeout(tmp_path: Path, started: list[dict[str, Any]]) -> None:
    cfg = load_config("configs/presets/cpu_two_teachers.yaml", [f"trainer.run_dir={tmp_path}"])
    names = list(cfg.teachers)
    cfg.teachers[names[1]].ready_timeout_s = 1500.0
    for name in names:
        with start_local_teacher(cfg, name):
            pass
    assert [s["ready_timeout_s"] for s in started] == [600.0 + AUTOSTART_MARGIN_S, 1500.0 + AUTOSTART_MARGIN_S]
    settings = load_settings(started[1]["config"], ["server.gpu_ids=[0]"])
    assert settings.teacher.ready_timeout_s == 1500.0


def test_a_ready_timeout_of_zero_is_refused_naming_the_key() -> None:
    from recipe_gkd.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(None, ["teacher.ready_timeout_s=0"])
    assert err.value.key == "teacher.ready_timeout_s"


@pytest.mark.parametrize(
    "mask", ["GPU-5a1c9e2f-0b7d-4c3a-9e8f-1a2b3c4d5e6f", "MIG-5c89a2f6-1d3e-5b8e-a1f0-9a3c2b1d4e5f"]
)
def test_a_uuid_mask_reaches_the_teacher_replicas(
    tmp_path: Path, started: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, mask: str
) -> None:
    """CUDA_VISIBLE_DEVICES of GPU or MIG UUIDs before the run: the autostarted server gets them as --gpu-ids, and its
    replica is started with that UUID as its own CUDA_VISIBLE_DEVICES."""
    from teacher_server.__main__ import flag_overrides, parse_args
    from teacher_server.server.supervisor import Supervisor

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    cfg = load_config("configs/presets/cpu_colocated.yaml", [f"trainer.run_dir={tmp_path}"])
    with start_local_teacher(cfg):
        pass
    extra = started[0]["extra_args"]
    assert extra[extra.index("--gpu-ids") + 1] == mask
    args = parse_args(["--config", str(started[0]["config"]), *extra])
    settings = load_settings(args.config, flag_overrides(args))
    (slot,) = settings.slots
    assert slot.gpu_ids == (mask,)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # the server's own mask is replaced, not inherited
    assert Supervisor(settings)._child_env(slot)["CUDA_VISIBLE_DEVICES"] == mask


def test_a_uuid_mask_splits_into_the_presets_teacher_replicas(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """launch/start_teacher.sh's argv on a node masked by UUIDs: the teacher's two GPUs, one replica of two."""
    from recipe_gkd.plan.placement import main as placement_cli

    uuids = [f"GPU-{i:08x}-0000-4000-8000-000000000000" for i in range(4)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(uuids))
    preset = "configs/presets/1x4_a1_r1_t2.yaml"
    assert placement_cli(["teacher-argv", "--config", preset]) == 0
    argv = capsys.readouterr().out.split()
    gpu_ids = argv[argv.index("--gpu-ids") + 1]
    assert gpu_ids == ",".join(uuids[2:])
    settings = load_settings(preset, [f"server.gpu_ids=[{gpu_ids}]"])
    assert [s.gpu_ids for s in settings.slots] == [tuple(uuids[2:])]
