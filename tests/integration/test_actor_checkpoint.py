"""The actor's dist checkpoint: a resumed step equals the uninterrupted one, also at another TP or PP size.

Each rank is a subprocess (tests/integration/checkpoint_scenarios.py). Phase 1 trains two steps
at size 1 and at size 2 and saves; phase 2 loads each checkpoint at the other size and trains the
third step, which must match the third step of the run that never stopped. (Same-size resume is
exercised end to end by test_crash_resume.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from adam_bounds import assert_same_weights

from recipe_gkd.ports import reserve_ports
from recipe_gkd.tiny_models import TinyModelSpec, build_tiny_causal_lm

SCRIPT = Path(__file__).with_name("checkpoint_scenarios.py")
PHASE_TIMEOUT_S = 240
# Different TP sizes sum the vocabulary-parallel loss in another order: fp32 rounding only.
RESHARD_TOL = 1e-5
RESUMED_STEP = 3  # the step taken after loading; its weights are compared as adam_bounds allows


def _free_ports(count: int) -> list[int]:
    return reserve_ports(count)


def _run_phase(jobs: list[tuple[int, str, Path, Path]], model: Path, logs: Path, parallel: str = "tp") -> None:
    """jobs: (world, mode, checkpoint, out), world = the `parallel` size. All ranks run at once; each must exit 0."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent), str(SCRIPT.parents[2]), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    procs: list[tuple[subprocess.Popen, Path]] = []
    try:
        for (world, mode, ckpt, out), port in zip(jobs, _free_ports(len(jobs)), strict=True):
            for rank in range(world):
                log = logs / f"{out.stem}_rank{rank}.log"
                cmd = [sys.executable, str(SCRIPT), f"--rank={rank}", f"--world={world}", f"--port={port}"]
                cmd += [f"--model={model}", f"--checkpoint={ckpt}", f"--mode={mode}", f"--out={out}"]
                cmd.append(f"--parallel={parallel}")
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


def _resume_at_the_other_size(model: Path, tmp_path: Path, parallel: str) -> None:
    """Save at size 1 and 2, resume each at the other size: the third step equals the uninterrupted one's."""
    ck1, ck2 = tmp_path / f"ck_{parallel}1", tmp_path / f"ck_{parallel}2"
    save1, save2 = tmp_path / f"save_{parallel}1.npz", tmp_path / f"save_{parallel}2.npz"
    _run_phase([(1, "save", ck1, save1), (2, "save", ck2, save2)], model, tmp_path, parallel)
    assert (ck1 / "metadata.json").is_file() and (ck2 / "metadata.json").is_file()
    one_from_two, two_from_one = tmp_path / f"{parallel}1_from_2.npz", tmp_path / f"{parallel}2_from_1.npz"
    _run_phase([(1, "load", ck2, one_from_two), (2, "load", ck1, two_from_one)], model, tmp_path, parallel)
    for resumed, reference in ((one_from_two, _load(save2)), (two_from_one, _load(save1))):
        got = _load(resumed)
        assert set(got) == set(reference)
        np.testing.assert_allclose(got["loss"], reference["loss"], rtol=RESHARD_TOL, err_msg=resumed.stem)
        assert float(got["lr"]) == float(reference["lr"]), "the lr schedule resumes at its step"
        weights = [k for k in reference if k not in ("loss", "lr")]
        assert weights, f"{resumed.stem}: no weights exported"
        assert_same_weights(
            {k: reference[k] for k in weights},
            {k: got[k] for k in weights},
            [float(reference["lr"])],
            first_step=RESUMED_STEP,
        )


@pytest.mark.slow
def test_resume_equals_uninterrupted_at_the_same_and_another_tp_size(tmp_path: Path) -> None:
    # Untied embeddings and 4 kv heads: every kind of TP sharding (vocab, qkv, mlp) is exercised.
    model = build_tiny_causal_lm(
        tmp_path / "model", seed=0, spec=TinyModelSpec(num_kv_heads=4, tie_word_embeddings=False)
    )
    _resume_at_the_other_size(model, tmp_path, "tp")


@pytest.mark.slow
def test_resume_equals_uninterrupted_at_another_pipeline_size(tmp_path: Path) -> None:
    # Tied embeddings: at PP=2 the last stage's output layer is a copy of the first stage's embedding,
    # saved once and loaded into both stages; 4 layers, so stage 1 holds layers 2-3 as its 0-1.
    model = build_tiny_causal_lm(tmp_path / "model", seed=0, spec=TinyModelSpec(num_layers=4))
    _resume_at_the_other_size(model, tmp_path, "pp")


@pytest.mark.slow
def test_distributed_optimizer_resumes_at_another_data_parallel_size(tmp_path: Path) -> None:
    # The optimizer state is sharded over data parallel: saved at DP=1 and DP=2, each loaded at the other.
    model = build_tiny_causal_lm(tmp_path / "model", seed=0, spec=TinyModelSpec(tie_word_embeddings=False))
    _resume_at_the_other_size(model, tmp_path, "dp")
