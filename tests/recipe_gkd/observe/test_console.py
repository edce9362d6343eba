"""Known-harmless third-party noise goes to the run's log; any other warning stays on the console."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from repo_paths import REPO_ROOT

SCRIPT = """
import logging, sys, warnings
warnings.simplefilter("always")
from recipe_gkd.observe import console
run_dir = sys.argv[1]
console.quiet_known_warnings(run_dir)
console.quiet_known_warnings(run_dir)  # twice: still one hook, one line per warning
warnings.warn("Apex is not installed. Falling back to Torch Norm")
warnings.warn("something nobody expected", RuntimeWarning)
logger = logging.getLogger("ray")
logger.addHandler(logging.StreamHandler(sys.stderr))  # what Ray installs on import
logger.setLevel(logging.INFO)
console.route_ray_logging(run_dir)
logging.getLogger("ray._private.worker").info("Started a local Ray instance.")
logging.getLogger("ray._private.auth").warning("Token authentication is enabled for this Ray cluster.")
logging.getLogger("ray._private.worker").warning("a worker died unexpectedly")
"""


def test_known_noise_goes_to_the_log_and_the_rest_to_the_console(tmp_path: Path) -> None:
    repo = REPO_ROOT
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=repo, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "logs" / "third_party.log").read_text()
    assert log.count("Apex is not installed") == 1
    assert "Started a local Ray instance" in log and "Token authentication" in log
    assert "a worker died unexpectedly" in log, "the log has everything Ray said"
    console = proc.stdout + proc.stderr
    assert "something nobody expected" in console, "an unexpected warning stays visible"
    assert "a worker died unexpectedly" in console
    for noise in ("Apex", "Started a local Ray", "Token authentication"):
        assert noise not in console, noise


VLLM_LIKE = """
import logging, sys
from recipe_gkd.observe import console
console.quiet_known_warnings(sys.argv[1])
console.quiet_known_lines(sys.argv[1])
console.quiet_known_lines(sys.argv[1])  # twice: one router per stream
handler = logging.StreamHandler(sys.stdout)  # vLLM's handler writes to sys.stdout (VLLM_LOGGING_STREAM)
handler.setFormatter(logging.Formatter("WARNING [%(filename)s] %(message)s"))
log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
log.addHandler(handler)
log.warning("RotaryEmbedding: Failed to load weights")
log.warning("Linear: Failed to load weights")
log.warning("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.")
print("a line of the run's own", flush=True)
sys.stderr.write("libtcmalloc is not found in LD_PRELOAD. For best performance, ...\\n")
sys.stderr.write("an unexpected ")
sys.stderr.write("error\\n")
sys.stderr.write("a partial line, flushed")
sys.stderr.flush()
"""


def test_known_vllm_lines_go_to_the_log_and_the_rest_to_the_console(tmp_path: Path) -> None:
    repo = REPO_ROOT
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_LIKE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["WARNING [<string>] Linear: Failed to load weights", "a line of the run's own"]
    assert "RotaryEmbedding" not in proc.stdout and "thread binding" not in proc.stdout
    assert proc.stderr == "an unexpected error\na partial line, flushed"
    log = (tmp_path / "logs" / "third_party.log").read_text()
    assert log.count("RotaryEmbedding: Failed to load weights") == 1 and log.count("thread binding") == 1
    assert log.count("libtcmalloc") == 1 and "Linear" not in log and "unexpected" not in log
