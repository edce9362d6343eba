"""The driver waits for an autostarted teacher as long as the server waits for its replicas to load.

teacher.timeout_s is one request's limit (60 s in the CPU presets); a GPU teacher's load takes minutes.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import teacher_server.launcher
from recipe_gkd.config import load_config
from recipe_gkd.rollout.teacher import AUTOSTART_READY_TIMEOUT_S, start_local_teacher
from teacher_server.settings import ServerSection


def test_autostart_waits_for_the_servers_own_load_limit_not_the_request_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    @contextmanager
    def fake_start(config: Path, overrides: Any = (), **kwargs: Any) -> Any:
        seen.update(kwargs)
        yield None

    monkeypatch.setattr(teacher_server.launcher, "start_teacher", fake_start)
    cfg = load_config(None, [f"trainer.run_dir={tmp_path}", "teacher.timeout_s=7"])
    with start_local_teacher(cfg):
        pass
    assert seen["ready_timeout_s"] == AUTOSTART_READY_TIMEOUT_S
    assert AUTOSTART_READY_TIMEOUT_S > ServerSection().ready_timeout_s
