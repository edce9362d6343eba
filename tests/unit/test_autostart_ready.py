"""The driver waits for an autostarted teacher as long as the server waits for its replicas to load.

teacher.timeout_s is one request's limit (60 s in the CPU presets); a GPU teacher's load takes minutes,
and how many is the run's to say: teacher.ready_timeout_s (each teacher's own with `teachers:`).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import teacher_server.launcher
from recipe_gkd.config import load_config
from recipe_gkd.rollout.teacher import AUTOSTART_MARGIN_S, start_local_teacher
from teacher_server.settings import load_settings


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The arguments of every server start_local_teacher launches (the launch itself left out)."""
    seen: list[dict[str, Any]] = []

    @contextmanager
    def fake_start(config: Path, overrides: Any = (), **kwargs: Any) -> Any:
        seen.append({"config": config, **kwargs})
        yield None

    monkeypatch.setattr(teacher_server.launcher, "start_teacher", fake_start)
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
