"""MegatronActor on CPU over gloo, checked against HF transformers and against itself.

The actor runs in subprocesses (tests/support/megatron_scenarios.py): one 1-rank process
and one 2-rank group run concurrently, once per module; each test reads their results. The
references are independent: HF `LlamaForCausalLM`/`Qwen2ForCausalLM` in fp32 for logits, the
exported weights and the loss (HF logits + recipe_gkd.losses, sequence by sequence).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# pytest's default (prepend) import mode puts tests/support on sys.path.
import megatron_scenarios as scenarios
import numpy as np
import pytest
import torch
from adam_bounds import assert_same_weights
from megatron_launch import (
    LAUNCH_TIMEOUT_S,
    build_models,
    free_ports,
    hf_with_weights,
    launch,
    load_hf,
    prefixed,
    result,
    wait_all,
)
from repo_paths import REPO_ROOT

from recipe_gkd.actor.collate import split_by_token_budget
from recipe_gkd.actor.megatron_actor import MegatronActor
from recipe_gkd.config import Device, GKDConfig
from recipe_gkd.losses import gkd_loss_sum
from recipe_gkd.targets import actor_kinds

LOGITS_ATOL = 1e-5
LOSS_RTOL = 1e-5
ONE_RANK_JOBS = (
    "logits,mb8,mb1,tp1_steps,tp1_tied_steps,noclip,clip,bf16,tokens50,recompute_full,recompute_selective,unfused,"
    "tp1_sampled,tp1_xtok,tp1_xtok_sampled,hidden_mb2,tp1_masked"
)
TWO_RANK_JOBS = (
    "logits,tp2_steps,tp2_tied_steps,dp2,dp2_distopt,bf16_dp2,bf16_dp2_distopt,save_tp2,logits_pp,pp2_steps,"
    "pp2_tied_steps,tp2_sampled,pp2_sampled,tp2_xtok,tp2_xtok_sampled"
)
# TP=2 x PP=2 and DP=2 x PP=2: every parallelism together (gathers on a later stage, DP + tied-embedding all-reduces).
FOUR_RANK_JOBS = "tp2pp2_steps,dp2pp2"
MODELS = ("llama_tied", "llama_untied", "qwen2_bias", "qwen3_qknorm", "llama3_rope", "mistral")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_models(tmp_path_factory.mktemp("megatron_models"))


@pytest.fixture(scope="module")
def runs(models: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Run the 1-rank and the 2-rank scenario launches concurrently, then the 4-rank one; their result directories."""
    root = tmp_path_factory.mktemp("megatron_runs")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    # 3 processes share 2 cores: one thread each avoids oversubscription stalls in gloo.
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    one = launch(1, ONE_RANK_JOBS, models, root / "w1", env)
    two = launch(2, TWO_RANK_JOBS, models, root / "w2", env)
    logs = [root / "w1" / "rank0.log", root / "w2" / "rank0.log", root / "w2" / "rank1.log"]
    wait_all(one + two, logs, LAUNCH_TIMEOUT_S)
    # After the others: 4 more processes at once would only slow all of them down on 2 cores.
    four = launch(4, FOUR_RANK_JOBS, models, root / "w4", env)
    wait_all(four, [root / "w4" / f"rank{r}.log" for r in range(4)], LAUNCH_TIMEOUT_S)
    return {"w1": root / "w1", "w2": root / "w2", "w4": root / "w4"}


# ----------------------------------------------------------------------------- HF equivalence


# (launch, job) of the logits/export jobs: TP=1, TP=2, PP=2.
LOGITS_RUNS = [("w1", "logits"), ("w2", "logits"), ("w2", "logits_pp")]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "job"), LOGITS_RUNS)
@pytest.mark.parametrize("model", MODELS)
def test_megatron_logits_equal_hf_logits(runs: dict[str, Path], models: Path, world: str, job: str, model: str) -> None:
    data = result(runs, world, job)
    hf = load_hf(models / model)
    ids = scenarios.probe_ids(hf.config.vocab_size)
    with torch.no_grad():
        expected = hf(torch.from_numpy(ids)).logits.numpy()
    got = data[f"{model}/logits"]
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= LOGITS_ATOL


@pytest.mark.slow
@pytest.mark.parametrize(("world", "job"), LOGITS_RUNS)
@pytest.mark.parametrize("model", MODELS)
def test_hf_to_megatron_to_hf_round_trip_is_bitwise(
    runs: dict[str, Path], models: Path, world: str, job: str, model: str
) -> None:
    exported = prefixed(result(runs, world, job), f"{model}/export")
    reference = {k: v.detach().numpy() for k, v in load_hf(models / model).named_parameters()}
    assert exported.keys() == reference.keys()
    for name, array in reference.items():
        assert exported[name].dtype == np.float32
        np.testing.assert_array_equal(exported[name], array, err_msg=name)
    info = json.loads(str(result(runs, world, job)["info"]))
    assert info["tp_size" if job == "logits" else "pp_size"] == int(world[1])


@pytest.mark.slow
def test_round_trip_with_padded_vocabulary_over_tp2(runs: dict[str, Path], models: Path) -> None:
    exported = prefixed(result(runs, "w2", "tp2_steps"), "before")
    reference = {k: v.detach().numpy() for k, v in load_hf(models / "llama_untied_odd").named_parameters()}
    assert exported["lm_head.weight"].shape == (101, 64)
    for name, array in reference.items():
        np.testing.assert_array_equal(exported[name], array, err_msg=name)


def reference_loss(model: torch.nn.Module, seed: int) -> float:
    """Global token-mean forward KL of the batch `seed`, one sequence at a time through HF."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for seq in scenarios.make_sequences(seed, scenarios.GLOBAL_BATCH, model.config.vocab_size):
        ids = torch.from_numpy(seq.input_ids.astype(np.int64))[None]
        with torch.no_grad():
            logits_1LV = model(ids).logits
        predicted = slice(seq.response_start - 1, len(seq.input_ids) - 1)  # position t predicts token t+1
        loss_sum, n = gkd_loss_sum(
            logits_1LV[:, predicted],
            torch.from_numpy(seq.teacher_topk_logprobs)[None],
            torch.from_numpy(seq.teacher_topk_ids.astype(np.int64))[None],
            torch.ones(1, seq.num_response_tokens, dtype=torch.bool),
            divergence="forward_kl",
        )
        total += loss_sum.double()
        count += int(n)
    return float(total) / count


@pytest.mark.slow
def test_train_loss_equals_hf_reference_loss(runs: dict[str, Path], models: Path) -> None:
    """First-step loss and post-training eval loss vs HF logits + recipe_gkd.losses on the exported weights."""
    path = models / "llama_untied_odd"
    for world, job in (("w1", "tp1_steps"), ("w2", "tp2_steps"), ("w2", "pp2_steps"), ("w4", "tp2pp2_steps")):
        data = result(runs, world, job)
        assert data["loss"][0] == pytest.approx(reference_loss(load_hf(path), seed=1), rel=LOSS_RTOL)
        trained = hf_with_weights(path, prefixed(data, "after"))
        evaluated = json.loads(str(data["eval"]))
        assert evaluated["loss"] == pytest.approx(reference_loss(trained, seed=99), rel=LOSS_RTOL)
        assert evaluated["forward_kl"] == pytest.approx(evaluated["loss"])


# ----------------------------------------------------------------------------- parallelism


@pytest.mark.slow
@pytest.mark.parametrize(
    ("one", "world", "other"),
    [
        ("tp1_steps", "w2", "tp2_steps"),
        ("tp1_tied_steps", "w2", "tp2_tied_steps"),
        ("tp1_steps", "w2", "pp2_steps"),
        ("tp1_tied_steps", "w2", "pp2_tied_steps"),
        ("tp1_steps", "w4", "tp2pp2_steps"),
    ],
)
def test_model_parallel_gives_the_same_losses_and_weights_as_one_rank(
    runs: dict[str, Path], one: str, world: str, other: str
) -> None:
    """TP=2, PP=2 and TP=2 x PP=2 train exactly like one rank (three Adam steps, clipping, warmup)."""
    tp1, tp2 = result(runs, "w1", one), result(runs, world, other)
    assert len(tp1["loss"]) == 3
    np.testing.assert_allclose(tp2["loss"], tp1["loss"], rtol=LOSS_RTOL)
    # The grad norm counts each TP shard once and replicated norms once, as at TP=1.
    np.testing.assert_allclose(tp2["grad_norm"], tp1["grad_norm"], rtol=LOSS_RTOL)
    np.testing.assert_array_equal(tp2["lr"], tp1["lr"])
    before = prefixed(tp1, "before")
    for name, weight in prefixed(tp1, "after").items():
        assert not np.array_equal(weight, before[name]), f"{name} did not train"
    assert_same_weights(prefixed(tp1, "after"), prefixed(tp2, "after"), tp1["lr"])


@pytest.mark.slow
@pytest.mark.parametrize("other", ["tp2_sampled", "pp2_sampled"])
def test_sampled_reverse_kl_trains_alike_over_model_parallel(runs: dict[str, Path], other: str) -> None:
    """The sampled-token objective (stale s_old, ratio clip 0.2) at TP=2 / PP=2: losses, statistics, weights as TP=1."""
    one, two = result(runs, "w1", "tp1_sampled"), result(runs, "w2", other)
    for key in ("loss", "grad_norm", *scenarios.POLICY_KEYS):
        assert len(one[key]) == 3, key
        np.testing.assert_allclose(two[key], one[key], rtol=LOSS_RTOL, err_msg=key)
    assert np.all(one["ratio_clipped_frac"] > 0) and np.all(one["ratio_clipped_frac"] < 1)
    assert np.all(one["ratio_min"] < one["ratio_mean"]) and np.all(one["ratio_mean"] < one["ratio_max"])
    before = prefixed(one, "before")
    for name, weight in prefixed(one, "after").items():
        assert not np.array_equal(weight, before[name]), f"{name} did not train"
    assert_same_weights(prefixed(one, "after"), prefixed(two, "after"), one["lr"])


def reference_sampled_loss(model: torch.nn.Module, sequences: list, ratio_clip: float) -> tuple[float, float, int]:
    """Global token means of the sampled-token surrogate max(-r A, -clip(r) A) and of A = log t - log s_old over the
    tokens the student sampled, from HF logits in float64 (r = s_theta / s_old); and their count."""
    loss, advantage, count = 0.0, 0.0, 0
    for seq in sequences:
        ids = torch.from_numpy(seq.input_ids.astype(np.int64))[None]
        with torch.no_grad():
            logp_LV = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
        rows = np.flatnonzero(seq.sampled_rows())
        for j in rows:  # response token j is predicted at position response_start + j - 1
            t = seq.response_start + int(j)
            old = float(seq.rollout_logprobs[j])
            a = float(np.float32(seq.teacher_sampled_logprob[j]) - np.float32(old))
            r = float(torch.exp(logp_LV[t - 1, seq.input_ids[t]] - old))
            loss += max(-r * a, -min(max(r, 1 - ratio_clip), 1 + ratio_clip) * a)
            advantage += a
        count += len(rows)
    return loss / count, advantage / count, count


@pytest.mark.slow
def test_tokens_the_student_did_not_sample_train_nothing(runs: dict[str, Path], models: Path) -> None:
    """Multi-turn batches on the actor: the first step's loss and advantage are the float64 reference over the
    sampled tokens only (placeholder rollout logprobs 0.0 elsewhere), and other values at the unsampled rows give
    the same loss, statistics, evaluation and trained weights, bit for bit."""
    data = result(runs, "w1", "tp1_masked")
    path = models / "llama_untied_odd"
    sequences = scenarios.make_masked_sequences(1, scenarios.GLOBAL_BATCH, load_hf(path).config.vocab_size)
    loss, advantage, count = reference_sampled_loss(load_hf(path), sequences, scenarios.SAMPLED["ratio_clip"])
    assert count < sum(s.num_response_tokens for s in sequences)
    assert float(data["placeholder_num_tokens"]) == count
    assert float(data["placeholder_loss"]) == pytest.approx(loss, rel=LOSS_RTOL)
    assert float(data["placeholder_advantage_mean"]) == pytest.approx(advantage, rel=LOSS_RTOL)
    for key in ("loss", "grad_norm", "num_tokens", *scenarios.POLICY_KEYS):
        np.testing.assert_array_equal(data[f"other_{key}"], data[f"placeholder_{key}"], err_msg=key)
    evals = [json.loads(str(data[f"{prefix}_eval"])) for prefix in ("placeholder", "other")]
    for key in ("loss", "forward_kl", "num_tokens"):
        assert evals[0][key] == evals[1][key], key
    assert evals[0]["num_tokens"] == count
    other = prefixed(data, "other_after")
    for name, weight in prefixed(data, "placeholder_after").items():
        np.testing.assert_array_equal(other[name], weight, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize(("one", "other"), [("tp1_xtok", "tp2_xtok"), ("tp1_xtok_sampled", "tp2_xtok_sampled")])
def test_cross_tokenizer_loss_trains_alike_over_tensor_parallel(runs: dict[str, Path], one: str, other: str) -> None:
    """algorithm.cross_tokenizer=span (multi-token spans, folded pieces, unaligned tokens) at TP=2: the loss over the
    vocabulary shards gathered and cut to 101 columns (objective.full_vocabulary) gives TP=1's losses, grad norms,
    eval loss and weights; the sampled-token objective with span advantages likewise over the TP group."""
    tp1, tp2 = result(runs, "w1", one), result(runs, "w2", other)
    keys = ("loss", "grad_norm", *(scenarios.POLICY_KEYS if "sampled" in one else ()))
    for key in keys:
        assert len(tp1[key]) == 3, key
        np.testing.assert_allclose(tp2[key], tp1[key], rtol=LOSS_RTOL, err_msg=key)
    evaluated = [json.loads(str(run["eval"])) for run in (tp1, tp2)]
    assert evaluated[1]["loss"] == pytest.approx(evaluated[0]["loss"], rel=LOSS_RTOL)
    # The spans change the loss: not the same-tokenizer objective on the same sequences.
    plain = result(runs, "w1", "tp1_sampled" if "sampled" in one else "tp1_steps")
    assert abs(tp1["loss"][0] - plain["loss"][0]) > 1e-3 * abs(plain["loss"][0])
    before = prefixed(tp1, "before")
    for name, weight in prefixed(tp1, "after").items():
        assert not np.array_equal(weight, before[name]), f"{name} did not train"
    assert_same_weights(prefixed(tp1, "after"), prefixed(tp2, "after"), tp1["lr"])


@pytest.mark.slow
def test_hidden_states_train_one_micro_batch_at_a_time(runs: dict[str, Path], models: Path) -> None:
    """teacher.output=hidden: whenever the loss runs, only its own micro-batch's teacher states exist, 2 bytes a value
    (the memory plan's one micro-batch; collating the step up front held all four, in float32: 34816 bytes against
    5632 here), and the loss is the full-vocabulary forward KL of HF's logits against h @ W_teacher^T."""
    data = result(runs, "w1", "hidden_mb2")
    shapes = [tuple(s) for s in data["micro_batch_shapes"]]
    assert len(shapes) == scenarios.GLOBAL_BATCH // 2
    assert data["live_bytes_at_loss"].tolist() == [int(np.prod(s)) * 2 for s in shapes]
    student, teacher = load_hf(models / "llama_tied"), load_hf(models / "llama_untied")
    head_VH = teacher.get_output_embeddings().weight.detach().double()
    total, count = torch.zeros((), dtype=torch.float64), 0
    vocab = student.config.vocab_size
    for seq in scenarios.make_hidden_sequences(7, scenarios.GLOBAL_BATCH, vocab, head_VH.shape[1]):
        assert seq.payload is not None
        with torch.no_grad():
            logits_LV = student(torch.from_numpy(seq.input_ids.astype(np.int64))[None]).logits[0].double()
        predicted = slice(seq.response_start - 1, len(seq.input_ids) - 1)
        log_p = torch.log_softmax(logits_LV[predicted], -1)
        log_q = torch.log_softmax(torch.from_numpy(seq.payload.to_float32()).double() @ head_VH.T, -1)
        total += (log_q.exp() * (log_q - log_p)).sum()
        count += seq.num_response_tokens
    assert data["loss"][0] == pytest.approx(float(total) / count, rel=LOSS_RTOL)


@pytest.mark.slow
def test_lr_warms_up_linearly(runs: dict[str, Path]) -> None:
    # actor.optim.warmup_steps=2, lr=1e-3: steps 1, 2, 3 use 5e-4, 1e-3, 1e-3.
    np.testing.assert_allclose(result(runs, "w1", "tp1_steps")["lr"], [5e-4, 1e-3, 1e-3])


@pytest.mark.slow
@pytest.mark.parametrize(("world", "job"), [("w1", "mb8"), ("w2", "tp2_steps"), ("w4", "tp2pp2_steps")])
def test_megatron_groups_time_out_with_the_setup_bound(runs: dict[str, Path], world: str, job: str) -> None:
    """debug.setup_timeout_s bounds TP, DP, PP and MP groups as it bounds the world group (megatron's default: 30 min)."""
    timeouts = json.loads(str(result(runs, world, job)["group_timeouts_s"]))
    assert timeouts["world"] == scenarios.SETUP_TIMEOUT_S
    # Whole minutes at least the world's bound: 3630 s -> 61 min.
    assert {name: t for name, t in timeouts.items() if name != "world"} == dict.fromkeys(
        ("tp", "dp", "pp", "mp"), 3660.0
    )


def assert_same_update(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=LOSS_RTOL)
    np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=LOSS_RTOL)
    np.testing.assert_array_equal(a["num_tokens"], b["num_tokens"])
    assert_same_weights(prefixed(a, "after"), prefixed(b, "after"), a["lr"])


@pytest.mark.slow
def test_micro_batch_size_does_not_change_loss_or_update(runs: dict[str, Path]) -> None:
    """Micro-batches of unequal token counts: only a global token mean makes these equal."""
    assert_same_update(result(runs, "w1", "mb8"), result(runs, "w1", "mb1"))


@pytest.mark.slow
@pytest.mark.parametrize(("world", "job"), [("w2", "dp2"), ("w4", "dp2pp2")])
def test_dp2_equals_dp1_on_the_same_global_batch(runs: dict[str, Path], world: str, job: str) -> None:
    dp2 = result(runs, world, job)
    assert json.loads(str(dp2["info"]))["dp_size"] == 2
    assert_same_update(result(runs, "w1", "mb8"), dp2)


@pytest.mark.slow
def test_token_budget_micro_batches_give_the_same_update(runs: dict[str, Path]) -> None:
    """Micro-batches by tokens (rows x longest <= 50, longest first) train exactly like 8 sequences at once."""
    sequences = scenarios.make_sequences(1, scenarios.GLOBAL_BATCH, vocab=101)
    groups = split_by_token_budget(sequences, 50)
    # The split is a real one: several micro-batches of different row counts, each within the budget.
    assert len(groups) > 2 and len({len(g) for g in groups}) > 1
    assert all(len(g) * (max(len(s.input_ids) for s in g) - 1) <= 50 for g in groups)
    assert_same_update(result(runs, "w1", "mb8"), result(runs, "w1", "tokens50"))


@pytest.mark.slow
@pytest.mark.parametrize("job", ["recompute_full", "recompute_selective", "unfused"])
def test_recompute_and_attention_settings_do_not_change_the_update(runs: dict[str, Path], job: str) -> None:
    """Full and selective recompute, and megatron's unfused attention, against the default (sdpa, no recompute)."""
    assert_same_update(result(runs, "w1", "mb8"), result(runs, "w1", job))


@pytest.mark.slow
def test_distributed_optimizer_shards_the_state_and_gives_the_same_update(runs: dict[str, Path]) -> None:
    """megatron's DistributedOptimizer over DP=2 (gloo): the DP=1 update, with half the Adam state per rank."""
    sharded, replicated = result(runs, "w2", "dp2_distopt"), result(runs, "w2", "dp2")
    assert_same_update(result(runs, "w1", "mb8"), sharded)
    ratio = int(sharded["optimizer_state_numel"]) / int(replicated["optimizer_state_numel"])
    assert 0.45 <= ratio <= 0.55, ratio


@pytest.mark.slow
def test_bf16_with_sharded_fp32_master_weights_trains_like_replicated(runs: dict[str, Path]) -> None:
    """The GPU presets' setting (bf16 params, fp32 master weights + Adam sharded over DP=2): three clipped steps."""
    sharded, replicated = result(runs, "w2", "bf16_dp2_distopt"), result(runs, "w2", "bf16_dp2")
    np.testing.assert_allclose(sharded["loss"], replicated["loss"], rtol=LOSS_RTOL)
    np.testing.assert_allclose(sharded["grad_norm"], replicated["grad_norm"], rtol=LOSS_RTOL)
    assert_same_weights(prefixed(replicated, "after"), prefixed(sharded, "after"), replicated["lr"])
    before = prefixed(replicated, "before")
    assert any(not np.array_equal(w, before[n]) for n, w in prefixed(sharded, "after").items())
    ratio = int(sharded["optimizer_state_numel"]) / int(replicated["optimizer_state_numel"])
    assert 0.45 <= ratio <= 0.55, ratio


@pytest.mark.slow
def test_grad_clipping_scales_the_update(runs: dict[str, Path]) -> None:
    """With eps >> |g| Adam's first step is lr * g / eps, so clipping must shrink it by clip / norm."""
    free, clipped = result(runs, "w1", "noclip"), result(runs, "w1", "clip")
    norm = float(free["grad_norm"][0])
    clip = 1.0e-3
    assert norm > 10 * clip
    assert float(clipped["grad_norm"][0]) == pytest.approx(norm, rel=LOSS_RTOL)  # reported before clipping
    before = prefixed(free, "before")
    for name, weight in prefixed(free, "after").items():
        free_step = weight.astype(np.float64) - before[name]
        clipped_step = prefixed(clipped, "after")[name].astype(np.float64) - before[name]
        np.testing.assert_allclose(clipped_step, free_step * clip / norm, rtol=1e-3, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_bf16_step_runs_on_cpu(runs: dict[str, Path]) -> None:
    bf16, fp32 = result(runs, "w1", "bf16"), result(runs, "w1", "mb8")
    assert np.isfinite(bf16["loss"]).all() and np.isfinite(bf16["grad_norm"]).all()
    np.testing.assert_allclose(bf16["loss"], fp32["loss"], rtol=2e-2)


# ----------------------------------------------------------------------------- probes and export


def hf_masked_logprobs(model: torch.nn.Module, ids_BL: np.ndarray, mask_BL: np.ndarray) -> np.ndarray:
    """The documented token_logprobs semantics, row by row through HF."""
    out = np.zeros((ids_BL.shape[0], ids_BL.shape[1] - 1), dtype=np.float32)
    for row in range(ids_BL.shape[0]):
        cols = np.flatnonzero(mask_BL[row])
        ids = torch.from_numpy(ids_BL[row, cols])[None]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0, :-1], dim=-1)
        out[row, cols[:-1]] = logprobs.gather(-1, ids[0, 1:, None])[:, 0].numpy()
    return out


@pytest.mark.slow
def test_token_logprobs_match_hf_with_exported_weights(runs: dict[str, Path], models: Path) -> None:
    for world, job in (("w1", "tp1_steps"), ("w2", "tp2_steps"), ("w2", "pp2_steps"), ("w4", "tp2pp2_steps")):
        data = result(runs, world, job)
        model = hf_with_weights(models / "llama_untied_odd", prefixed(data, "after"))
        expected = hf_masked_logprobs(model, data["probe_ids"], data["probe_mask"])
        assert data["probe_logprobs"].dtype == np.float32
        assert np.abs(data["probe_logprobs"] - expected).max() <= LOGITS_ATOL


@pytest.mark.slow
def test_save_hf_writes_a_directory_transformers_loads(runs: dict[str, Path]) -> None:
    data = result(runs, "w2", "save_tp2")
    model = load_hf(runs["w2"] / "save_tp2_hf")
    ids = scenarios.probe_ids(model.config.vocab_size)
    expected = hf_masked_logprobs(model, ids, np.ones_like(ids, dtype=bool))
    assert np.abs(data["probe_logprobs"] - expected).max() <= LOGITS_ATOL


# ----------------------------------------------------------------------------- compat layer

CPU_COMPAT_CHECK = """
import threading, torch
from recipe_gkd.actor.cpu_compat import cpu_compat_enabled, enable_cpu_compat
from recipe_gkd.targets import actor_kinds
enable_cpu_compat(); enable_cpu_compat()  # idempotent
assert torch.zeros(2, device="cuda").device.type == "cpu"
assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
assert torch.ones(2).to(0).device.type == "cpu" and torch.ones(2).cuda().device.type == "cpu"
assert torch.ones(2).to("cuda:0", torch.float64).dtype == torch.float64
torch.cuda.synchronize(); torch.cuda.empty_cache()
assert not torch.cuda.is_available()
from megatron.core.tensor_parallel import random as mcore_random
mcore_random.model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
tracker = mcore_random.get_cuda_rng_tracker()
torch.manual_seed(0); expected = torch.rand(1)
torch.manual_seed(0)
with tracker.fork():
    first = torch.rand(3)
with tracker.fork():
    second = torch.rand(3)
assert torch.equal(torch.rand(1), expected), "fork must restore the default generator"
assert not torch.equal(first, second), "fork must advance the tracked state"
seen = {}
def other_thread():
    seen["before"] = cpu_compat_enabled()
    enable_cpu_compat()
    seen["device"] = torch.zeros(1, device="cuda").device.type
thread = threading.Thread(target=other_thread); thread.start(); thread.join()
assert seen == {"before": False, "device": "cpu"}, seen
"""


@pytest.mark.slow
def test_cpu_compat_maps_cuda_to_cpu_per_thread_and_forks_cpu_rng() -> None:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    subprocess.run([sys.executable, "-c", CPU_COMPAT_CHECK], check=True, env=env, timeout=180)


# ----------------------------------------------------------------------------- in-process checks


@pytest.mark.parametrize(
    ("pp", "cp", "key"), [(4, 1, r"actor\.megatron\.pp=4"), (1, 3, r"actor\.megatron\.cp=3: choose one of")]
)
def test_unsupported_split_is_refused_naming_the_key(
    tiny_model_dir: Path, pp: int, cp: int, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 pipeline stages for the student's 2 layers, or a context-parallel size the zigzag split does not take:
    refused before any rendezvous."""

    def entered(_self: MegatronActor) -> None:
        raise AssertionError("the compat layer touched torch before the split was refused")

    monkeypatch.setattr(MegatronActor, "_enter_device", entered)
    cfg = GKDConfig()
    cfg.cluster.device = Device.cpu
    cfg.model.student_path = str(tiny_model_dir)
    cfg.actor.gpus_per_node = 4
    cfg.actor.megatron.pp, cfg.actor.megatron.cp = pp, cp
    with pytest.raises(ValueError, match=key):
        MegatronActor(cfg, 0, 4, "127.0.0.1", 1, actor_kinds(cfg)).setup()


@pytest.mark.slow
def test_actor_runs_as_a_ray_actor(ray_local: None, tiny_model_dir: Path) -> None:
    """Ray runs methods in its own thread(s): the compat layer must follow every call."""
    import ray

    cfg = scenarios.make_cfg(str(tiny_model_dir), 1, "cpu", micro_batch_size=4)
    actor = ray.remote(num_cpus=0)(MegatronActor).remote(cfg, 0, 1, "127.0.0.1", free_ports(1)[0], actor_kinds(cfg))
    try:
        info = ray.get(actor.setup.remote(), timeout=180)
        assert info["device"] == "cpu"
        stats = ray.get(actor.train_step.remote(scenarios.rank_shards(1, 102, 0, 1)), timeout=60)
        assert np.isfinite(stats["loss"]) and stats["num_tokens"] > 0
        logprobs = ray.get(actor.token_logprobs.remote(scenarios.probe_ids(102)), timeout=60)
        assert logprobs.shape == (3, 11)
        ray.get(actor.shutdown.remote(), timeout=60)
    finally:
        ray.kill(actor)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_actor_on_cuda_matches_hf(models: Path, tmp_path: Path) -> None:
    """The same scenarios on CUDA (nccl): logits vs HF, TP=1 training, and TP=2 and PP=2 with 2 GPUs."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    runs_dir: dict[str, Path] = {}
    worlds = [1, 2] if torch.cuda.device_count() >= 2 else [1]
    for world in worlds:
        jobs = "logits,tp1_steps" if world == 1 else "logits,tp2_steps,pp2_steps"
        procs = launch(world, jobs, models, tmp_path / f"w{world}", env, device="cuda")
        wait_all(procs, [tmp_path / f"w{world}" / f"rank{r}.log" for r in range(world)], LAUNCH_TIMEOUT_S)
        runs_dir[f"w{world}"] = tmp_path / f"w{world}"
    for world in runs_dir:
        data = result(runs_dir, world, "logits")
        for model in MODELS:
            hf = load_hf(models / model)
            ids = scenarios.probe_ids(hf.config.vocab_size)
            with torch.no_grad():
                expected = hf(torch.from_numpy(ids)).logits.numpy()
            assert np.abs(data[f"{model}/logits"] - expected).max() <= 1e-4
    steps = result(runs_dir, "w1", "tp1_steps")
    assert steps["loss"][0] == pytest.approx(reference_loss(load_hf(models / "llama_untied_odd"), seed=1), rel=1e-4)
    if "w2" in runs_dir:
        for job in ("tp2_steps", "pp2_steps"):
            np.testing.assert_allclose(result(runs_dir, "w2", job)["loss"], steps["loss"], rtol=1e-4)
