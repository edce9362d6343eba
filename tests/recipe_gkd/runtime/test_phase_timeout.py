"""A phase over its bound names the key that bounds it: a step's phases debug.hang_timeout_s, set-up debug.setup_timeout_s."""

from __future__ import annotations

import pytest

from recipe_gkd.config import ConfigError, load_config
from recipe_gkd.runtime.watchdog import HANG_KEY, SETUP_KEY, PhaseTimeoutError, phase_timeout


def test_a_step_phase_names_the_hang_bound() -> None:
    err = phase_timeout("rollout of step 3", 600.0)
    assert isinstance(err, PhaseTimeoutError)
    assert str(err) == (
        "phase 'rollout of step 3' did not finish within debug.hang_timeout_s=600.0s; raise debug.hang_timeout_s "
        "if the step is legitimately this slow"
    )


def test_set_up_names_its_own_bound() -> None:
    message = str(phase_timeout("worker setup", 3600.0, SETUP_KEY))
    assert "within debug.setup_timeout_s=3600.0s" in message and "raise debug.setup_timeout_s if the set-up" in message
    assert HANG_KEY not in message


def test_the_set_up_bound_is_a_key_of_its_own() -> None:
    cfg = load_config(None, ["debug.hang_timeout_s=60"])
    assert (cfg.debug.hang_timeout_s, cfg.debug.setup_timeout_s) == (60.0, 3600.0)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["debug.setup_timeout_s=0"])
    assert err.value.key == "debug.setup_timeout_s"
