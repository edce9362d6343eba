"""The CLI's exit code for each kind of error it reports in one line (recipe_gkd.exit_codes.exit_code_for)."""

from __future__ import annotations

import pytest

from recipe_gkd.config import ConfigError
from recipe_gkd.exit_codes import EXIT_BAD_CONFIG, EXIT_FAILED, error_line, exit_code_for
from teacher_server.client.zmq_client import TeacherDeadError, TeacherMismatchError
from teacher_server.vllm_version import UnsupportedVLLMError


class RayWrapped(Exception):
    """What Ray raises in the driver for a worker's error: the original under `cause`."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def test_a_mismatched_teacher_is_a_bad_input_exit_2_also_from_a_worker() -> None:
    mismatch = TeacherMismatchError("teacher 'sum': the server's tokenizer differs from the student's")
    assert exit_code_for(mismatch) == EXIT_BAD_CONFIG
    assert exit_code_for(RayWrapped(mismatch)) == EXIT_BAD_CONFIG


def test_other_teacher_errors_stay_exit_1_and_unknown_errors_are_not_ours() -> None:
    assert exit_code_for(TeacherDeadError("no teacher server answered")) == EXIT_FAILED
    assert exit_code_for(RayWrapped(ConfigError("data.teacher_key", "unknown teacher"))) == EXIT_BAD_CONFIG
    assert exit_code_for(RuntimeError("a bug")) is None


def test_an_unsupported_vllm_in_a_worker_is_exit_1() -> None:
    unsupported = UnsupportedVLLMError("vLLM 0.11.0 is installed but rollout.backend=vllm supports vllm>=0.24.0,<0.34")
    assert exit_code_for(RayWrapped(unsupported)) == EXIT_FAILED


def test_a_config_error_raised_in_a_ray_worker_is_exit_2_with_its_own_line(ray_local: None) -> None:
    """Ray's own wrapping of a worker's ConfigError (its two-argument constructor included): the driver finds the
    cause, exits 2 and prints the worker's message as one line naming the key."""
    import ray

    from recipe_gkd.data import encode_prompt  # what a rollout worker does with each record of its batch

    read = ray.remote(num_cpus=0)(encode_prompt)
    with pytest.raises(Exception) as info:
        ray.get(read.remote(None, {"question": "rev:hello"}, "prompt", False), timeout=120)
    assert exit_code_for(info.value) == EXIT_BAD_CONFIG
    line = error_line(info.value)
    assert line == "error: config error at `data.prompt_key`: record has no field 'prompt' (fields: ['question'])"


def _connect_to_nothing(address: str) -> None:
    """What a rollout worker's teacher client does at set-up, against an address nothing listens on."""
    from teacher_server.client.zmq_client import TeacherClient

    TeacherClient(address, timeout_s=0.5, retries=1).connect()


def test_an_unreachable_teacher_seen_by_a_ray_worker_is_exit_1_with_its_own_line(ray_local: None) -> None:
    """The worker's TeacherDeadError through Ray's own wrapping: exit 1, one line naming teacher.address."""
    import sys

    import ray

    from recipe_gkd.plan.ports import reserve_ports

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    address = f"tcp://127.0.0.1:{reserve_ports(1)[0]}"  # nothing listens there
    with pytest.raises(Exception) as info:
        ray.get(ray.remote(num_cpus=0)(_connect_to_nothing).remote(address), timeout=120)
    assert exit_code_for(info.value) == EXIT_FAILED
    line = error_line(info.value)
    assert line.startswith(f"error: no teacher server answered at teacher.address={address}"), line
    assert "\n" not in line
