"""The CLI's exit codes, and the errors it reports itself in one line (the rest are bugs: their traceback is the report).

`python -m recipe_gkd.main` and `python -m recipe_gkd.doctor` both exit with these (docs/checkpoints_and_failures.md).
"""

from __future__ import annotations

from recipe_gkd.config import ConfigError

EXIT_FAILED = 1
EXIT_BAD_CONFIG = 2
# The run stopped on purpose after saving what it could (e.g. the teacher server stayed down).
EXIT_STOPPED = 3
# A phase exceeded debug.hang_timeout_s: the workers' stacks are in <run_dir>/hang_<phase>_<time>/.
EXIT_HANG = 4
# trainer.stop_on_divergence: the objective diverged; the run saved a checkpoint and stopped (docs/divergence.md).
EXIT_DIVERGED = 5


def error_line(err: BaseException) -> str:
    """The last line the CLI prints for an error it reports itself. Ray wraps an error raised in a worker; its
    cause carries the one-line message."""
    return f"error: {getattr(err, 'cause', None) or err}"


def exit_code_for(err: BaseException) -> int | None:
    """The exit code of an error whose message is written for the user (naming what to change), else None."""
    from recipe_gkd.actor.hf_arch import UnsupportedModelError
    from recipe_gkd.runtime.checkpoint import CheckpointError
    from recipe_gkd.weight_sync import WeightSyncError
    from teacher_server.client.launcher import TeacherLaunchError
    from teacher_server.client.zmq_client import TeacherError, TeacherMismatchError
    from teacher_server.vllm_version import UnsupportedVLLMError

    cause = getattr(err, "cause", None) or err
    # A teacher that does not fit the run (another tokenizer or vocabulary, top_k or temperature it does not
    # offer), found at connect time before training: the run's inputs are wrong, as with a bad config.
    if isinstance(cause, ConfigError | UnsupportedModelError | TeacherMismatchError):
        return EXIT_BAD_CONFIG
    if isinstance(cause, TeacherError | TeacherLaunchError | WeightSyncError | CheckpointError | UnsupportedVLLMError):
        return EXIT_FAILED
    return None
