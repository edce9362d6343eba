"""launch/ray_start.sh, start_teacher.sh and run_gkd.sh take one argument list: `--config PRESET key=value ...`.

The scripts run for real, on CPU: `ray` and the final `python -m teacher_server` / `python -m recipe_gkd.main` are
stand-ins on PATH that print what they were given; the plan the scripts ask recipe_gkd.plan.placement for is the real one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipe_gkd.config import CONFIG_DIR, REPO_ROOT, load_config

LAUNCH = REPO_ROOT / "launch"
PRESET = CONFIG_DIR / "presets" / "1x8_a1_r3_t4.yaml"
# One list for every script: a changed split (actor 1 + rollout 1, the teacher's 3 x 2 GPUs on 2-7), the teacher's
# own keys, the student, and a key of the standalone server only.
RUN_ARGS = [
    "--config",
    str(PRESET),
    "rollout.gpus_per_node=1",
    "teacher.replicas=3",
    "teacher.top_k=32",
    "model.student_path=/models/student",
    "server.ready_timeout_s=900",
]
SCRIPT_TIMEOUT_S = 60


@pytest.fixture()
def stand_ins(tmp_path: Path) -> Path:
    """A bin/ with `ray` and `python` stand-ins: each prints its argv; `python -m recipe_gkd.plan.placement` is real."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text('#!/usr/bin/env bash\necho "ray CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES $*"\n')
    (bin_dir / "python").write_text(
        "#!/usr/bin/env bash\n"
        f'if [[ "$2" == recipe_gkd.plan.placement ]]; then exec {sys.executable} "$@"; fi\n'
        'printf "python"; printf " %s" "$@"; echo\n'
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def run_script(name: str, args: list[str], bin_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHON": str(bin_dir / "python"),
        "PYTHONPATH": str(REPO_ROOT),
    }
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(
        [str(LAUNCH / name), *args],
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
        env=env,
        cwd=REPO_ROOT,
        check=False,
    )


def test_ray_start_takes_the_runs_overrides(stand_ins: Path) -> None:
    preset = run_script("ray_start.sh", ["--config", str(PRESET), "--node-rank", "0", "--head"], stand_ins)
    assert preset.returncode == 0, preset.stderr
    assert "ray CUDA_VISIBLE_DEVICES=0,1,2,3 start --head --port 6379 --num-gpus 4 " in preset.stdout
    changed = run_script("ray_start.sh", [*RUN_ARGS, "--node-rank", "0", "--head"], stand_ins)
    assert changed.returncode == 0, changed.stderr
    ray_line = changed.stdout.splitlines()[-1]
    assert ray_line.startswith("ray CUDA_VISIBLE_DEVICES=0,1 start --head --port 6379 --num-gpus 2 --resources ")
    assert "recipe_gkd_node_0" in ray_line
    worker = run_script("ray_start.sh", [*RUN_ARGS, "--node-rank", "0", "--address", "head:6379"], stand_ins)
    assert worker.stdout.splitlines()[-1].startswith("ray CUDA_VISIBLE_DEVICES=0,1 start --address head:6379 ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["rollout.gpus_per_nod=1"], "`rollout.gpus_per_node`"),  # the key's own "did you mean"
        (["teacher.replicas=1"], "teacher.replicas"),  # the split no longer adds up
        (["--bogus"], "unknown argument: --bogus"),
        (["gpus"], "unknown argument: gpus (an override is key=value)"),
        (["--node-rank"], "--node-rank needs a value"),
    ],
)
def test_ray_start_refuses_bad_arguments_with_exit_2(stand_ins: Path, args: list[str], message: str) -> None:
    proc = run_script("ray_start.sh", ["--config", str(PRESET), "--head", *args], stand_ins)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "ray " not in proc.stdout, "ray started despite the error"


def test_start_teacher_and_run_gkd_take_the_same_list(stand_ins: Path) -> None:
    """The teacher's overrides given once in the list reach the teacher server and the driver alike."""
    teacher = run_script("start_teacher.sh", RUN_ARGS, stand_ins)
    assert teacher.returncode == 0, teacher.stderr
    served = teacher.stdout.split()
    assert served[:3] == ["python", "-m", "teacher_server"]
    assert served[served.index("--gpu-ids") + 1] == "2,3,4,5,6,7"
    # The teacher's and the server's keys reach the server; the trainer's shape the plan only.
    assert {"teacher.replicas=3", "teacher.top_k=32", "server.ready_timeout_s=900"} <= set(served)
    assert "model.student_path=/models/student" not in served

    driver_args = [a for a in RUN_ARGS if not a.startswith("server.")]
    driver = run_script("run_gkd.sh", driver_args, stand_ins)
    assert driver.returncode == 0, driver.stderr
    assert driver.stdout.split() == ["python", "-m", "recipe_gkd.main", *driver_args]
    cfg = load_config(PRESET, driver_args[2:])
    assert (cfg.teacher.top_k, cfg.teacher.replicas, cfg.rollout.gpus_per_node) == (32, 3, 1)


def test_start_teacher_with_a_hub_id_not_downloaded_says_how_to_get_it(tmp_path: Path) -> None:
    """start_teacher.sh reads the cache only (HF_HUB_OFFLINE=1): a teacher not downloaded on this node is one line,
    exit 2, with the command that downloads it (or a shared HF_HOME), before anything starts."""
    import socket

    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "PYTHON": sys.executable, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("HF_HUB_OFFLINE", None)
    proc = subprocess.run(
        [str(LAUNCH / "start_teacher.sh"), "--config", str(PRESET)],
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
        env=env,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("teacher_server: config error at `teacher.model_path`: "), lines
    assert f"Qwen/Qwen3-8B is not in the Hugging Face cache of node {socket.gethostname()}" in lines[0]
    assert "(hf download Qwen/Qwen3-8B)" in lines[0] and "HF_HOME" in lines[0]
    assert "READY" not in proc.stdout
