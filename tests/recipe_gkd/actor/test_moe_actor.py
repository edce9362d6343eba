"""A mixture-of-experts student (Qwen3-MoE) on the megatron actor, on CPU over gloo, against HF and against itself.

Independent references: HF transformers' Qwen3MoeForCausalLM in fp32 (logits, the checkpoint's own tensors, the
router's softmax and top-k at the loss positions, the exported student loaded back); EP = 1 on one rank against
EP = 2 on two (loss, every gradient, weights after two Adam steps), and a checkpoint saved at EP = 2 resumed at
EP = 1. The model's router is decisive by construction (its weights ~ N(0, 1) on RMS-normalised inputs): the test
asserts a margin between the k-th and the (k+1)-th router logit at every token, so no top-k tie can make two
correct routings differ.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from adam_bounds import assert_same_weights
from megatron_launch import LAUNCH_TIMEOUT_S, launch, load_hf, prefixed, result, wait_all
from megatron_scenarios import GLOBAL_BATCH, make_sequences, probe_ids
from repo_paths import REPO_ROOT

MODEL = "qwen3_moe"
EXPERTS, TOP_K = 4, 2
LR = 1e-3  # NO_CLIP's, two steps
# fp32 logits through 2 layers of a 64-wide model: the same bound as the dense families' (test_megatron_actor.py).
LOGITS_ATOL = 1e-5
# A gradient is a sum over 8 sequences' tokens in another order (EP's all-to-all, DP's all-reduce): float32
# rounding of sums of ~1e2 terms of size <= 1: a few 1e-7 absolute.
GRAD_ATOL = 2e-6
# The smallest gap between the k-th and (k+1)-th router logit that top-k can be trusted to break the same way in
# two float32 computations of the same logits (rounding ~1e-6 of logits ~10).
ROUTER_MARGIN = 1e-3


def build_moe(out: Path) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(11)
    config = Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=48, intermediate_size=96,
        norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # HF starts norms at 1: random ones make the q/k norms and the layer norms real
                param.normal_(1.0, 0.2)
            elif name.endswith("mlp.gate.weight"):  # a decisive router (module docstring)
                param.normal_(0.0, 1.0)
            elif ".experts." in name:  # experts that differ clearly from one another
                param.normal_(0.0, 0.1)
    model.save_pretrained(out / MODEL)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_moe(tmp_path_factory.mktemp("moe_models"))


@pytest.fixture(scope="module")
def runs(models: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """EP = 1 on one rank and EP = 2 (and DP = 2 at EP = 1) on two, concurrently; then the resume at EP = 1 of the
    checkpoint the two ranks saved at EP = 2."""
    root = tmp_path_factory.mktemp("moe_runs")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    one = launch(1, "moe,moe_aux", models, root / "w1", env)
    two = launch(2, "moe,moe_ep1,moe_distopt,moe_aux,moe_save,moe_shims", models, root / "w2", env)
    wait_all(
        one + two, [root / "w1" / "rank0.log", root / "w2" / "rank0.log", root / "w2" / "rank1.log"], LAUNCH_TIMEOUT_S
    )
    resume = launch(1, "moe_resume", models, root / "r1", env)
    wait_all(resume, [root / "r1" / "rank0.log"], LAUNCH_TIMEOUT_S)
    return {"w1": root / "w1", "w2": root / "w2", "r1": root / "r1"}


def grads(runs: dict[str, Path], world: str, job: str) -> dict[str, np.ndarray]:
    """Every rank's gradients under global names; a tensor on several ranks (the dense ones) must agree."""
    merged: dict[str, np.ndarray] = {}
    for path in sorted(runs[world].glob(f"{job}_grads_rank*.npz")):
        with np.load(path) as data:
            for name in data.files:
                if name in merged:
                    np.testing.assert_array_equal(merged[name], data[name], err_msg=f"{name} differs between ranks")
                merged[name] = data[name]
    return merged


def hf_router_logits(models: Path) -> list[np.ndarray]:
    """HF's router logits per layer [tokens, E] over the training batch's loss positions (the tokens that predict a
    response token) and the probe's tokens."""
    model = load_hf(models / MODEL)
    per_layer: list[list[np.ndarray]] = [[] for _ in range(model.config.num_hidden_layers)]
    rows = [
        (seq.input_ids, slice(seq.response_start - 1, len(seq.input_ids) - 1))
        for seq in make_sequences(1, GLOBAL_BATCH, 96)
    ]
    rows += [(ids, slice(0, len(ids))) for ids in probe_ids(96)]
    with torch.no_grad():
        for ids, positions in rows:
            out = model(torch.as_tensor(np.asarray(ids, dtype=np.int64))[None], output_router_logits=True)
            for layer, logits in enumerate(out.router_logits):
                per_layer[layer].append(logits.reshape(-1, EXPERTS)[positions].float().numpy())
    return [np.concatenate(chunks) for chunks in per_layer]


def test_the_router_never_ties_at_its_top_k(models: Path) -> None:
    for logits in hf_router_logits(models):
        ranked = np.sort(logits, axis=-1)[:, ::-1]
        assert (ranked[:, TOP_K - 1] - ranked[:, TOP_K]).min() > ROUTER_MARGIN


@pytest.mark.slow
@pytest.mark.parametrize("world", ["w1", "w2"])
def test_megatron_moe_logits_equal_hf_logits(runs: dict[str, Path], models: Path, world: str) -> None:
    """EP = 1 and EP = 2 (each rank holding 2 of the 4 experts, tokens exchanged all-to-all)."""
    with torch.no_grad():
        reference = load_hf(models / MODEL)(torch.as_tensor(probe_ids(96))).logits.numpy()
    np.testing.assert_allclose(result(runs, world, "moe")["logits"], reference, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("world", ["w1", "w2"])
def test_the_export_round_trip_is_bitwise_with_per_expert_names(
    runs: dict[str, Path], models: Path, world: str
) -> None:
    """HF -> megatron (EP-sharded) -> HF gives the checkpoint's own tensors under its own per-expert names."""
    from safetensors.numpy import load_file

    exported = prefixed(result(runs, world, "moe"), "before")
    saved = load_file(str(models / MODEL / "model.safetensors"))
    assert exported.keys() == saved.keys()
    assert any(".mlp.experts.3.down_proj.weight" in name for name in exported)
    for name, tensor in saved.items():
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("other", ["moe", "moe_ep1", "moe_distopt"])
def test_ep2_trains_as_ep1(runs: dict[str, Path], other: str) -> None:
    """EP = 2 (and DP = 2 at EP = 1, and EP = 2 with the distributed optimizer) against one rank: the loss, every
    gradient (the experts' on the rank holding them), the grad norm, the weights after two Adam steps. (With the
    distributed optimizer each rank's gradient buffer holds only its reduce-scattered shard: the grad norm and the
    weights compare.)"""
    one, two = result(runs, "w1", "moe"), result(runs, "w2", other)
    np.testing.assert_allclose(two["first_loss"], one["first_loss"], rtol=1e-6)
    np.testing.assert_allclose(two["second_loss"], one["second_loss"], rtol=1e-6)
    np.testing.assert_allclose(two["first_grad_norm"], one["first_grad_norm"], rtol=1e-5)
    assert_same_weights(prefixed(one, "after"), prefixed(two, "after"), [LR, LR])
    if other == "moe_distopt":
        return
    reference, got = grads(runs, "w1", "moe"), grads(runs, "w2", other)
    assert got.keys() == reference.keys() and any("local_experts.3." in name for name in got)
    for name, grad in reference.items():
        assert np.abs(grad).max() > 0, name  # every tensor, each expert included, trains in this batch
        np.testing.assert_allclose(got[name], grad, atol=GRAD_ATOL, rtol=0, err_msg=name)


@pytest.mark.slow
def test_the_load_balancing_loss_is_the_same_at_ep2_and_changes_the_router(runs: dict[str, Path]) -> None:
    """actor.moe.aux_loss_coeff: a gradient of its own on the routers (none on what it does not reach: the output
    layer), the same at EP = 1 and EP = 2; the reported loss stays the distillation loss."""
    plain, aux_one, aux_two = grads(runs, "w1", "moe"), grads(runs, "w1", "moe_aux"), grads(runs, "w2", "moe_aux")
    np.testing.assert_allclose(result(runs, "w1", "moe_aux")["first_loss"], result(runs, "w1", "moe")["first_loss"])
    router = "decoder.layers.0.mlp.router.weight"
    assert np.abs(aux_one[router] - plain[router]).max() > 1e-4
    np.testing.assert_array_equal(aux_one["output_layer.weight"], plain["output_layer.weight"])
    for name, grad in aux_one.items():
        np.testing.assert_allclose(aux_two[name], grad, atol=GRAD_ATOL, rtol=0, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("world", ["w1", "w2"])
def test_router_statistics_equal_hfs_routing(runs: dict[str, Path], models: Path, world: str) -> None:
    """Per-expert load and router entropy of the first step at the loss positions, recomputed from HF's router
    logits (softmax, top-k) over the same sequences."""
    stats = json.loads(str(result(runs, world, "moe")["router_stats"]))
    layers = [
        logits[: sum(len(s.input_ids) - s.response_start for s in make_sequences(1, GLOBAL_BATCH, 96))]
        for logits in hf_router_logits(models)
    ]
    counts = np.zeros(EXPERTS)
    entropy, tokens = 0.0, 0
    for logits in layers:
        top = np.argsort(-logits, axis=-1)[:, :TOP_K]
        counts += np.bincount(top.ravel(), minlength=EXPERTS)
        logp = (
            logits
            - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - logits.max(-1, keepdims=True)
        )
        entropy += float(-(np.exp(logp) * logp).sum())
        tokens += len(logits)
    share = counts / counts.sum()
    assert [stats[f"moe_expert_load_{e}"] for e in range(EXPERTS)] == pytest.approx(share.tolist(), abs=1e-9)
    assert stats["moe_router_entropy"] == pytest.approx(entropy / tokens, rel=1e-4)


@pytest.mark.slow
def test_a_checkpoint_saved_at_ep2_resumes_at_ep1(runs: dict[str, Path]) -> None:
    """The model and the Adam state saved by two expert-parallel ranks, loaded by one: the same probe logprobs, the
    same next step's loss and weights as the run that went on at EP = 2."""
    saved, resumed = result(runs, "w2", "moe_save"), result(runs, "r1", "moe_resume")
    np.testing.assert_allclose(resumed["resumed_logprobs"], saved["saved_logprobs"], atol=1e-6, rtol=0)
    np.testing.assert_allclose(resumed["second_loss"], saved["second_loss"], rtol=1e-6)
    assert_same_weights(prefixed(saved, "after"), prefixed(resumed, "after"), [LR], first_step=2)


@pytest.mark.slow
def test_the_exported_student_loads_as_qwen3_moe_with_the_actors_logits(runs: dict[str, Path]) -> None:
    """final_student/'s form (save_hf) at EP = 2: transformers loads a Qwen3MoeForCausalLM with the actor's logprobs."""
    model = load_hf(runs["w2"] / "moe_save_hf")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.as_tensor(probe_ids(96))
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    np.testing.assert_allclose(logprobs.numpy(), result(runs, "w2", "moe_save")["saved_logprobs"], atol=LOGITS_ATOL)


@pytest.mark.slow
def test_each_cpu_shim_of_megatrons_moe_is_needed(runs: dict[str, Path], models: Path) -> None:
    """recipe_gkd/actor/cpu_compat.py: with any one of its MoE shims undone an EP = 2 forward fails with that shim's
    error; with all three it equals HF."""
    data = result(runs, "w2", "moe_shims")
    errors = json.loads(str(data["errors"]))
    assert "CUDA" in errors["side_stream"] or "cuda" in errors["side_stream"], errors["side_stream"]
    assert "split" in errors["split_sizes"].lower(), errors["split_sizes"]
    assert errors["router_gemm"].startswith("NameError") and "te_general_gemm" in errors["router_gemm"]
    with torch.no_grad():
        reference = load_hf(models / MODEL)(torch.as_tensor(probe_ids(96))).logits.numpy()
    np.testing.assert_allclose(data["logits"], reference, atol=LOGITS_ATOL, rtol=0)
