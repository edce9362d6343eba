"""The actor's dist checkpoint: a resumed step equals the uninterrupted one, also at another TP or PP size.

Each rank is a subprocess (tests/support/checkpoint_scenarios.py) serving the TP, PP and DP
(distributed optimizer) scenarios in turn. Phase 1 trains two steps at size 1 and at size 2 and saves;
phase 2 loads each checkpoint at the other size and trains the third step, which must match the third
step of the run that never stopped. (Through the CLI, after kill -9: test_crash_resume.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from adam_bounds import assert_same_weights
from repo_paths import SUPPORT_DIR

from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm
from recipe_gkd.plan.ports import reserve_ports

SCRIPT = SUPPORT_DIR / "checkpoint_scenarios.py"
PHASE_TIMEOUT_S = 240
# Different TP sizes sum the vocabulary-parallel loss in another order: fp32 rounding only.
RESHARD_TOL = 1e-5
RESUMED_STEP = 3  # the step taken after loading; its weights are compared as adam_bounds allows


# The scenarios (parallel kind -> its model's spec): each saved at size 1 and 2 and resumed at the other size.
MODELS = {
    "tp": TinyModelSpec(num_kv_heads=4, tie_word_embeddings=False),
    "pp": TinyModelSpec(num_layers=4),
    "dp": TinyModelSpec(tie_word_embeddings=False),
}


def _run_phase(jobs: dict[int, list[str]], logs: Path, phase: str) -> None:
    """jobs: world size -> job specs (checkpoint_scenarios.py --job), every rank of each world size at once, each
    running its world's jobs in turn; every process must exit 0."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent), str(SCRIPT.parents[2]), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    procs: list[tuple[subprocess.Popen, Path]] = []
    try:
        for world, specs in jobs.items():
            for rank in range(world):
                log = logs / f"{phase}_world{world}_rank{rank}.log"
                cmd = [sys.executable, str(SCRIPT), f"--rank={rank}", f"--world={world}"]
                cmd += [f"--job={spec}" for spec in specs]
                with log.open("w") as f:
                    procs.append((subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env), log))
        for proc, log in procs:
            rc = proc.wait(timeout=PHASE_TIMEOUT_S)
            assert rc == 0, f"{log}:\n{log.read_text()[-4000:]}"
    finally:
        for proc, _ in procs:  # only what this test started
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def _load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every scenario saved at size 1 and 2 (phase 1), then each checkpoint loaded at the other size for the third
    step (phase 2); one process per rank and phase serves all three kinds (megatron's start-up dominates a rank)."""
    root = tmp_path_factory.mktemp("ckpt")
    models = {kind: build_tiny_causal_lm(root / f"model_{kind}", seed=0, spec=spec) for kind, spec in MODELS.items()}
    ports = iter(reserve_ports(4 * len(MODELS)))

    def specs(mode: str, checkpoint_size: dict[int, int], out: str) -> dict[int, list[str]]:
        jobs: dict[int, list[str]] = {1: [], 2: []}
        for world in jobs:
            for kind, model in models.items():
                other = checkpoint_size[world]
                ckpt, dest = root / f"ck_{kind}{other}", root / out.format(kind=kind, world=world, other=other)
                jobs[world].append(f"{kind},{model},{ckpt},{mode},{dest},{next(ports)}")
        return jobs

    _run_phase(specs("save", {1: 1, 2: 2}, "save_{kind}{world}.npz"), root, "save")
    for kind in MODELS:
        assert (root / f"ck_{kind}1" / "metadata.json").is_file() and (root / f"ck_{kind}2" / "metadata.json").is_file()
    _run_phase(specs("load", {1: 2, 2: 1}, "{kind}{world}_from_{other}.npz"), root, "load")
    return root


def _assert_resumed_equals_uninterrupted(root: Path, kind: str) -> None:
    """Each checkpoint resumed at the other size: its third step equals the uninterrupted run's."""
    for resumed_file, reference_file in ((f"{kind}1_from_2", f"save_{kind}2"), (f"{kind}2_from_1", f"save_{kind}1")):
        got, reference = _load(root / f"{resumed_file}.npz"), _load(root / f"{reference_file}.npz")
        assert set(got) == set(reference)
        np.testing.assert_allclose(got["loss"], reference["loss"], rtol=RESHARD_TOL, err_msg=resumed_file)
        assert float(got["lr"]) == float(reference["lr"]), "the lr schedule resumes at its step"
        weights = [k for k in reference if k not in ("loss", "lr")]
        assert weights, f"{resumed_file}: no weights exported"
        assert_same_weights(
            {k: reference[k] for k in weights},
            {k: got[k] for k in weights},
            [float(reference["lr"])],
            first_step=RESUMED_STEP,
        )


@pytest.mark.slow
def test_resume_equals_uninterrupted_at_the_same_and_another_tp_size(resumed: Path) -> None:
    _assert_resumed_equals_uninterrupted(resumed, "tp")


@pytest.mark.slow
def test_resume_equals_uninterrupted_at_another_pipeline_size(resumed: Path) -> None:
    _assert_resumed_equals_uninterrupted(resumed, "pp")


@pytest.mark.slow
def test_distributed_optimizer_resumes_at_another_data_parallel_size(resumed: Path) -> None:
    _assert_resumed_equals_uninterrupted(resumed, "dp")
