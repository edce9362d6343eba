"""What a run prints: the project's lines on the console; known-harmless third-party noise in a log.

Every process of a run (the driver, each Ray worker through Ray's `worker_process_setup_hook`)
sends the third-party warnings listed in KNOWN_HARMLESS, and Ray's own INFO banners and its
known-harmless warnings, to `<run_dir>/logs/third_party.log` instead of the console. Any other
warning stays on the console: a warning nobody expected is worth seeing. Progress bars of the
libraries that load models (transformers, huggingface_hub) are turned off in the workers: the
driver's own bar (metrics.py) is the one on the screen.
"""

from __future__ import annotations

import logging
import os
import re
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
    """Ray's worker_process_setup_hook: this worker's known warnings to the run's log."""
    run_dir = os.environ.get(RUN_DIR_VAR)
    if run_dir:
        quiet_known_warnings(run_dir)


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
