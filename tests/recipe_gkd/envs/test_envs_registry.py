"""rollout.env by name or as a class of one's own (package.module:Class): imported where it is built, refused with
a line naming rollout.env when it does not import or is no environment."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from recipe_gkd.config import ConfigError, load_config
from recipe_gkd.envs.registry import build_environment, environment_class
from recipe_gkd.preflight import START_CHECKS, Status

USER_MODULE = '''
from recipe_gkd.envs.protocol import StepResult, tool_message


class Countdown:
    """A user's environment: answers each turn with how many turns are left, done after `max_turns`."""

    name = "countdown"

    def __init__(self, max_turns=8, **options):
        self.max_turns, self.options, self.turns = max_turns, options, 0

    def reset(self, record, seed=0):
        self.turns = 0
        return [{"role": "user", "content": str(record["prompt"])}]

    def step(self, assistant_message):
        self.turns += 1
        done = self.turns >= self.max_turns
        return StepResult([] if done else [tool_message(str(self.max_turns - self.turns))], done, float(done))

    def tools(self):
        return []


class NoStep:
    def reset(self, record, seed=0):
        return []

    def tools(self):
        return []
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_envs.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_envs"


def test_a_class_of_ones_own_is_built_with_the_runs_options(user_module: str) -> None:
    env = build_environment(f"{user_module}:Countdown", max_turns=2, prompt_key="prompt", tool_timeout_s=3.0)
    assert env.reset({"prompt": "go"}) == [{"role": "user", "content": "go"}]
    first = env.step({"role": "assistant", "content": "x"})
    assert not first.done and first.observations == [{"role": "tool", "content": "1"}]
    assert env.step({"role": "assistant", "content": "y"}).done
    assert env.options == {"prompt_key": "prompt", "tool_timeout_s": 3.0}  # type: ignore[attr-defined]
    assert environment_class("calculator").name == "calculator"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("my_envs:Missing", "holds no class 'Missing'"),
        ("my_envs:NoStep", "a class without step"),
        ("no_such_module_here:Env", "module 'no_such_module_here' does not import"),
        ("calc", "unknown environment 'calc'"),
    ],
)
def test_what_is_no_environment_is_refused_naming_it(user_module: str, name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        environment_class(name)


def test_the_preflight_builds_it_on_the_driver_and_names_the_key(user_module: str) -> None:
    check = next(c for c in START_CHECKS if c.name == "environment")
    ok = check.finding(load_config(None, [f"rollout.env={user_module}:Countdown", "data.max_prompt_length=256"]))
    assert ok.status == Status.ok and "my_envs:Countdown environment builds here" in ok.line
    bad = check.finding(load_config(None, [f"rollout.env={user_module}:NoStep", "data.max_prompt_length=256"]))
    assert bad.failed and bad.key == "rollout.env" and "a class without step" in bad.line
    with pytest.raises(ConfigError) as info:  # not a name and not an import path: the config refuses it at once
        load_config(None, ["rollout.env=not a path", "data.max_prompt_length=256"])
    assert info.value.key == "rollout.env"
