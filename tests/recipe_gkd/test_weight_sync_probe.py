"""After a sync, the rollout's logprobs on a fixed probe equal the actor's (fp32, <= 1e-5).

Also with a 2-stage pipeline-parallel actor: the second stage sends its layers to rank 0 for the export.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from recipe_gkd.batch import ScoredSequence, TrainShard
from recipe_gkd.config import WeightTransport, load_config
from recipe_gkd.plan.ports import reserve_ports
from recipe_gkd.rollout.worker import make_engine
from recipe_gkd.runtime.ray_pools import RayRolloutWorker, open_weight_sync, ray_actor_worker_class, ray_transport
from recipe_gkd.targets import actor_kinds, build_target
from teacher_server.wire.protocol import scores_from_logprobs

TOP_K = 4


class EngineOnlyRollout(RayRolloutWorker):
    """The real rollout worker with its engine only (no teacher, no data): what the sync touches."""

    def setup(self, scorer: Any = None, teacher_address: str | None = None) -> dict[str, Any]:
        self.engine = make_engine(self.cfg)
        return {"rank": self.rank}

    def get_weight_version(self) -> int:
        return self.weight_version


def _shard(rng: np.random.Generator, vocab: int, n: int) -> TrainShard:
    sequences = []
    for i in range(n):
        prompt, response = rng.integers(6, vocab, 5), rng.integers(6, vocab, 7)
        logits = rng.standard_normal((len(response), vocab))
        logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        scores = scores_from_logprobs(logprobs, response, TOP_K)
        sequences.append(
            ScoredSequence(
                sample_id=i,
                input_ids=np.concatenate([prompt, response]).astype(np.int32),
                response_start=len(prompt),
                on_policy=True,
                teacher_topk_logprobs=scores.topk_logprobs,
                teacher_topk_ids=scores.topk_ids,
                teacher_tail_logmass=scores.tail_logmass,
                teacher_sampled_logprob=scores.sampled_logprob,
            )
        )
    return TrainShard(step=0, weight_version=0, sequences=sequences)


def _free_port() -> int:
    return reserve_ports(1)[0]


# Each case starts its own actor and rollout processes (~20-40 s of the suite): the fp32 logprob equality over both
# transports at one stage; two pipeline stages in bf16 over both transports, where the checksums compare every weight
# exactly (gloo: bf16 buckets straight from the gathered shards, the GPU path's code, stage 2's layers sent in bf16;
# the object store: int16 bit patterns in numpy, viewed back as bf16 by the rollout worker). Into vLLM's workers:
# tests/recipe_gkd/rollout/test_rollout_vllm.py (both paths, every TP worker) and tests/e2e/test_colocated.py (the
# engine samples with the actor's weights after each sync, < 1e-4).
PROBE_CASES = [
    ("object_store+gloo", 1, "fp32"),
    ("gloo+object_store", 2, "bf16"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("transport", "pp", "precision"), PROBE_CASES)
def test_rollout_matches_actor_after_sync(
    ray_local: None, tiny_model_dir: Path, transport: str, pp: int, precision: str
) -> None:
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    split = [f"cluster.gpus_per_node={pp + 2}", f"actor.gpus_per_node={pp}", f"actor.megatron.pp={pp}"]
    cfg = load_config(
        None,
        [
            f"model.student_path={tiny_model_dir}",
            "data.max_prompt_length=32",
            "actor.micro_batch_size=2",
            "actor.optim.lr=0.01",
            f"actor.precision={precision}",
            *split,
        ],
    )
    port = _free_port()
    actor_cls = ray.remote(num_cpus=0)(ray_actor_worker_class()).options(num_gpus=1)
    actors = [actor_cls.remote(cfg, rank, pp, "127.0.0.1", port, actor_kinds(cfg)) for rank in range(pp)]
    rollouts = [
        ray.remote(num_cpus=0)(EngineOnlyRollout).options(num_gpus=1).remote(cfg, i, 2, build_target(cfg))
        for i in range(2)
    ]
    try:
        ray.get([a.setup.remote() for a in actors] + [r.setup.remote() for r in rollouts], timeout=180)
        transports = transport.split("+")
        rng = np.random.default_rng(0)
        probe = rng.integers(6, 102, (3, 12))
        before = ray.get(rollouts[0].token_logprobs.remote(probe), timeout=60)
        if precision == "fp32":
            np.testing.assert_allclose(actor_logprobs(actors, probe), before, atol=1e-5)
        for step in range(2):
            shard = ray.put(_shard(rng, 102, 4))
            stats = ray.get([a.train_refs.remote([shard]) for a in actors], timeout=120)[0]
            assert stats["loss"] > 0
            # Each step over the next transport, built as a run builds it and handed to the workers once.
            over = replace(cfg.weight_sync, transport=WeightTransport(transports[step]), bucket_mb=1, timeout_s=60)
            built = ray_transport(replace(cfg, weight_sync=over), "127.0.0.1", _free_port(), len(rollouts))
            open_weight_sync(actors, rollouts, built, timeout_s=60).push(step + 1)
            _assert_rollouts_hold_the_actors_weights(actors, rollouts, probe, precision, step + 1)
        assert np.abs(actor_logprobs(actors, probe) - before).max() > 1e-3, "training changed the weights"
    finally:
        ray.get([a.shutdown.remote() for a in actors], timeout=60)
        for handle in [*actors, *rollouts]:
            ray.kill(handle)


def _assert_rollouts_hold_the_actors_weights(
    actors: list[Any], rollouts: list[Any], probe: np.ndarray, precision: str, version: int
) -> None:
    """fp32: every rollout's logprobs on the probe are the actor's (<= 1e-5); bf16: the engine (fp32) holds exactly the
    actor's bf16 weights, widened (equal checksums)."""
    import ray

    if precision == "bf16":
        from recipe_gkd.weight_sync import weight_mismatches

        sums = ray.get([a.weight_checksums.remote("bfloat16") for a in actors], timeout=60)[0]
        for rollout in rollouts:
            assert weight_mismatches(sums, ray.get(rollout.weight_checksums.remote("bfloat16"), timeout=60)) == []
        return
    after_actor = actor_logprobs(actors, probe)
    for rollout in rollouts:
        after_rollout = ray.get(rollout.token_logprobs.remote(probe), timeout=60)
        assert np.abs(after_rollout - after_actor).max() <= 1e-5
        assert ray.get(rollout.get_weight_version.remote(), timeout=60) == version


def actor_logprobs(actors: list[Any], probe: np.ndarray) -> np.ndarray:
    """Every actor rank takes part (pipeline stages pass activations); all return the same logprobs."""
    import ray

    results = ray.get([a.token_logprobs.remote(probe) for a in actors], timeout=60)
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])
    return results[0]
