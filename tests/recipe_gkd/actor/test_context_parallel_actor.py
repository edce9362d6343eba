"""Context parallelism on the megatron actor, on CPU over gloo: CP = 2 and CP = 4 against CP = 1 (one rank).

Each target kind and objective (the teacher's top-k, the sampled-token reverse KL, multi-turn masks, hidden
states), GQA (4 query heads over 2 groups) and Qwen3's q/k norms: the probe's logits, masked token logprobs, one
step's loss, grad norm, every gradient, the policy statistics, the eval losses and the weights after the step.
The reference is the same model at CP = 1, whose logits and losses tests/recipe_gkd/actor/test_megatron_actor.py
checks against HF transformers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from adam_bounds import assert_same_weights
from megatron_launch import LAUNCH_TIMEOUT_S, build_models, launch, prefixed, result, wait_all
from repo_paths import REPO_ROOT

JOBS = ("cp_topk", "cp_sampled", "cp_masked", "cp_hidden", "cp_qwen3")
FOUR_RANK_JOBS = ("cp_topk", "cp_masked", "cp_pp")  # cp_pp: CP = 2 x PP = 2, against cp_topk at one rank
LR = 1e-3
# fp32 sums over the sequence's keys in another grouping (each chunk's prefix, the gathered keys), and a gradient
# summed over the CP ranks' shares: a few float32 roundings of values ~1 (relative 1e-5 of the largest entry).
RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    models = build_models(tmp_path_factory.mktemp("cp_models"))
    root = tmp_path_factory.mktemp("cp_runs")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    one = launch(1, ",".join(JOBS), models, root / "w1", env)
    two = launch(2, ",".join((*JOBS, "cp_save")), models, root / "w2", env)
    wait_all(
        one + two, [root / "w1" / "rank0.log", *(root / "w2" / f"rank{r}.log" for r in range(2))], LAUNCH_TIMEOUT_S
    )
    four = launch(4, ",".join(FOUR_RANK_JOBS), models, root / "w4", env)
    resume = launch(1, "cp_resume", models, root / "r1", env)
    wait_all(
        four + resume, [*(root / "w4" / f"rank{r}.log" for r in range(4)), root / "r1" / "rank0.log"], LAUNCH_TIMEOUT_S
    )
    return {"w1": root / "w1", "w2": root / "w2", "w4": root / "w4", "r1": root / "r1"}


def grads(runs: dict[str, Path], world: str, job: str) -> list[dict[str, np.ndarray]]:
    out = []
    for path in sorted(runs[world].glob(f"{job}_grads_rank*.npz")):
        with np.load(path) as data:
            out.append({k: data[k] for k in data.files})
    return out


CASES = [("w2", job) for job in JOBS] + [("w4", job) for job in FOUR_RANK_JOBS]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "job"), CASES)
def test_context_parallel_trains_as_one_rank(runs: dict[str, Path], world: str, job: str) -> None:
    one, many = result(runs, "w1", "cp_topk" if job == "cp_pp" else job), result(runs, world, job)
    np.testing.assert_allclose(many["logits"], one["logits"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(many["probe_logprobs"], one["probe_logprobs"], rtol=0, atol=1e-5)
    for key in ("loss", "grad_norm", "num_tokens", "advantage_mean", "ratio_mean", "ratio_max", "ratio_min"):
        if key in one:
            np.testing.assert_allclose(many[key], one[key], rtol=RTOL, err_msg=key)
    assert json.loads(str(many["eval"]))["loss"] == pytest.approx(json.loads(str(one["eval"]))["loss"], rel=RTOL)
    reference = grads(runs, "w1", "cp_topk" if job == "cp_pp" else job)[0]
    ranks = grads(runs, world, job)
    assert len(ranks) == int(world[1:])
    for rank_grads in ranks:  # every CP rank holds the whole gradient (reduced over data x context parallel)
        if job == "cp_pp":  # a pipeline stage holds its layers' (global names), each on its CP ranks
            assert set(rank_grads) < set(reference)
        else:
            assert rank_grads.keys() == reference.keys()
        for name in rank_grads:
            grad = reference[name]
            scale = float(np.abs(grad).max())
            assert scale > 0, name
            np.testing.assert_allclose(rank_grads[name], grad, rtol=0, atol=RTOL * scale, err_msg=name)
    assert_same_weights(prefixed(one, "after"), prefixed(many, "after"), [LR])


@pytest.mark.slow
def test_a_checkpoint_saved_at_cp2_resumes_at_cp1(runs: dict[str, Path]) -> None:
    """The model and the Adam state (the distributed optimizer, sharded over data x context parallel) saved by two
    CP ranks, loaded by one: the same probe logprobs, the next step's loss and weights; the HF export unchanged."""
    saved, resumed = result(runs, "w2", "cp_save"), result(runs, "r1", "cp_resume")
    np.testing.assert_allclose(resumed["resumed_logprobs"], saved["saved_logprobs"], atol=1e-6, rtol=0)
    np.testing.assert_allclose(resumed["second_loss"], saved["second_loss"], rtol=RTOL)
    assert_same_weights(prefixed(saved, "after"), prefixed(resumed, "after"), [LR], first_step=2)
    one = result(runs, "w1", "cp_topk")
    assert prefixed(saved, "before").keys() == prefixed(one, "after").keys()  # the HF names, as at CP = 1
