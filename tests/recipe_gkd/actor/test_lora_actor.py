"""LoRA students on the megatron actor, on CPU over gloo (a tiny Qwen3: GQA 4 query heads over 2 groups, q/k norms).

Against references outside the actor: HF transformers' base model (step 0 is the base: B = 0), PEFT itself loading
the exported `final_adapter` directory onto the base (the actor's logits after two steps), transformers loading the
merged export; TP = 2 and PP = 2 against TP = 1 (loss, grad norm, every adapter gradient, the logits after); a
checkpoint saved at TP = 2 (distributed optimizer) resumed at TP = 1.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron_launch import LAUNCH_TIMEOUT_S, build_models, launch, load_hf, prefixed, result, wait_all
from megatron_scenarios import probe_ids
from repo_paths import REPO_ROOT

from recipe_gkd.actor import hf_convert
from recipe_gkd.actor.checkpointing import check_same_lora
from recipe_gkd.actor.lora import LoRASettings
from recipe_gkd.config import ConfigError
from recipe_gkd.weight_sync.adapter import adapter_names

MODEL = "qwen3_qknorm"
RANK, ALPHA = 4, 8.0
RTOL = 1e-5
ATOL = 1e-5  # fp32 logits of a two-layer model: a few roundings


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    models = build_models(tmp_path_factory.mktemp("lora_models"))
    root = tmp_path_factory.mktemp("lora_runs")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    one = launch(1, "lora_tp1,lora_dropout", models, root / "w1", env)
    recompute = launch(1, "lora_dropout_full", models, root / "f1", env)
    two = launch(2, "lora_tp2,lora_pp2,lora_save", models, root / "w2", env)
    logs = [root / "w1" / "rank0.log", root / "f1" / "rank0.log", *(root / "w2" / f"rank{r}.log" for r in range(2))]
    wait_all(one + recompute + two, logs, LAUNCH_TIMEOUT_S)
    resume = launch(1, "lora_resume", models, root / "r1", env)
    wait_all(resume, [root / "r1" / "rank0.log"], LAUNCH_TIMEOUT_S)
    return {"w1": root / "w1", "f1": root / "f1", "w2": root / "w2", "r1": root / "r1", "models": models}


def hf_logits(model_dir: Path, vocab: int) -> np.ndarray:
    with torch.no_grad():
        return load_hf(model_dir)(torch.from_numpy(probe_ids(vocab))).logits.numpy()


def rank_files(runs: dict[str, Path], world: str, pattern: str) -> list[Path]:
    return sorted(runs[world].glob(pattern))


def unsharded_grads(runs: dict[str, Path], world: str, job: str, step: int) -> dict[str, np.ndarray]:
    """Each adapter gradient of step `step` over the whole model: TP shards joined as the converter joins weights
    (a replicated factor: the same on every TP rank, checked), pipeline stages' layers side by side."""
    per_rank = []
    for path in rank_files(runs, world, f"{job}_grads{'' if step == 1 else step}_rank*.npz"):
        with np.load(path) as data:
            per_rank.append({k: torch.from_numpy(data[k]) for k in data.files})
    if job != "lora_tp2" and job != "lora_save":  # one rank per name (TP = 1, or a stage's layers)
        return {k: v.numpy() for rank in per_rank for k, v in rank.items()}
    out = {}
    for name in per_rank[0]:
        shards = [rank[name] for rank in per_rank]
        if hf_convert.partition_dim(name) is None:
            torch.testing.assert_close(shards[1], shards[0], rtol=0, atol=0, msg=f"{name}: replicated over TP")
        out[name] = hf_convert.unshard_from_tp(name, shards).numpy()
    return out


@pytest.mark.slow
def test_step_zero_is_the_base_model(runs: dict[str, Path]) -> None:
    """PEFT's initialisation (B = 0): before any step the student computes exactly the HF base model."""
    reference = hf_logits(runs["models"] / MODEL, 98)
    for world, job in (("w1", "lora_tp1"), ("w2", "lora_tp2"), ("w2", "lora_pp2")):
        np.testing.assert_allclose(result(runs, world, job)["logits_before"], reference, rtol=0, atol=ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("job", ["lora_tp2", "lora_pp2"])
def test_tensor_and_pipeline_parallel_lora_train_as_one_rank(runs: dict[str, Path], job: str) -> None:
    one, many = result(runs, "w1", "lora_tp1"), result(runs, "w2", job)
    for key in ("first_loss", "first_grad_norm", "second_loss", "second_grad_norm"):
        np.testing.assert_allclose(many[key], one[key], rtol=RTOL, err_msg=key)
    for step in (1, 2):
        reference, grads = unsharded_grads(runs, "w1", "lora_tp1", step), unsharded_grads(runs, "w2", job, step)
        assert grads.keys() == reference.keys() and len(reference) == 2 * 4 * 2  # 2 layers x 4 targets x (A, B)
        for name, grad in reference.items():
            scale = float(np.abs(grad).max())
            if step == 1 and name.endswith("lora_A"):  # B = 0 at step 1: A's gradient B^T dy x^T is 0, as PEFT's
                assert scale == 0 and not np.abs(grads[name]).max(), name
                continue
            assert scale > 0, f"{name}: no gradient at step {step}"
            np.testing.assert_allclose(grads[name], grad, rtol=0, atol=RTOL * scale, err_msg=f"{name} step {step}")
    np.testing.assert_allclose(many["logits_after"], one["logits_after"], rtol=0, atol=ATOL)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "job"), [("w1", "lora_tp1"), ("w2", "lora_tp2"), ("w2", "lora_save")])
def test_only_the_adapters_train(runs: dict[str, Path], world: str, job: str) -> None:
    """No frozen parameter requires, holds or gets a gradient; Adam's state is the adapters' two moments only (the
    distributed optimizer shards them over data parallel, 1 here); the merged export's unadapted tensors are the
    base's, bit for bit."""
    for path in rank_files(runs, world, f"{job}_frozen_rank*.json"):
        report = json.loads(path.read_text())
        assert report["base_with_grad"] == []
        assert 0 < report["adapter_numel"] < report["base_numel"] / 5
        assert report["optimizer_state_numel"] == 2 * report["adapter_numel"]
    base = load_hf(runs["models"] / MODEL).state_dict()
    merged = load_hf(runs[world] / f"{job}_hf").state_dict()
    adapted = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name, tensor in base.items():
        if any(f".{proj}." in name for proj in adapted):
            assert not torch.equal(merged[name], tensor), f"{name}: the adapter did not move it"
        else:
            assert torch.equal(merged[name], tensor), f"{name}: a frozen tensor changed"


@pytest.mark.slow
@pytest.mark.parametrize(("world", "job"), [("w1", "lora_tp1"), ("w2", "lora_tp2"), ("w2", "lora_pp2")])
def test_peft_and_transformers_load_the_exports_with_the_actors_logits(
    runs: dict[str, Path], world: str, job: str
) -> None:
    """final_adapter/ (PEFT's own loader onto the base) and final_student/ (the merged model) after two steps."""
    from peft import PeftModel

    out = result(runs, world, job)
    adapter_dir = runs[world] / f"{job}_adapter"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (RANK, ALPHA, "LORA")
    base = load_hf(runs["models"] / MODEL)
    assert np.abs(out["logits_after"] - hf_logits(runs["models"] / MODEL, 98)).max() > 1e-2, "the adapter trained"
    peft_model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        peft_logits = peft_model(torch.from_numpy(probe_ids(98))).logits.numpy()
    np.testing.assert_allclose(peft_logits, out["logits_after"], rtol=0, atol=ATOL)
    np.testing.assert_allclose(hf_logits(runs[world] / f"{job}_hf", 98), out["logits_after"], rtol=0, atol=ATOL)


@pytest.mark.slow
def test_the_sync_form_is_the_peft_adapter_with_b_scaled(runs: dict[str, Path]) -> None:
    """What the engines get every step: every adapter tensor of the student, B multiplied by alpha / rank."""
    from safetensors.torch import load_file

    sync = prefixed(result(runs, "w2", "lora_tp2"), "sync")
    peft = load_file(str(runs["w2"] / "lora_tp2_adapter" / "adapter_model.safetensors"))
    assert list(sync) == adapter_names(2, ("qkv", "proj", "fc1", "fc2"))
    assert set(peft) == set(sync)
    for name, tensor in peft.items():
        factor = ALPHA / RANK if name.endswith("lora_B.weight") else 1.0
        np.testing.assert_allclose(sync[name], tensor.numpy() * factor, rtol=1e-7, atol=0, err_msg=name)


@pytest.mark.slow
def test_a_lora_checkpoint_saved_at_tp2_resumes_exactly_at_tp1(runs: dict[str, Path]) -> None:
    """The adapters and their Adam state (distributed optimizer) saved by two TP ranks, loaded by one over the base
    read again from the HF student: the same probe, the same second step."""
    saved, resumed = result(runs, "w2", "lora_save"), result(runs, "r1", "lora_resume")
    np.testing.assert_allclose(resumed["resumed_logprobs"], saved["saved_logprobs"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(resumed["second_loss"], saved["second_loss"], rtol=RTOL)
    np.testing.assert_allclose(resumed["logits_after"], saved["logits_after"], rtol=0, atol=ATOL)
    # The frozen base stays out of it: every tensor saved is an adapter's or its optimizer state's.
    from torch.distributed.checkpoint import FileSystemReader

    saved_keys = list(FileSystemReader(str(runs["w2"] / "lora_save_ckpt")).read_metadata().state_dict_metadata)
    assert len(saved_keys) == 4 * 2 * 4  # 4 targets x (A, B) x (the model's, Adam's param, exp_avg, exp_avg_sq)
    assert all(key.endswith((".lora_A", ".lora_B")) for key in saved_keys), saved_keys


@pytest.mark.slow
def test_dropout_trains_and_full_recompute_replays_its_masks(runs: dict[str, Path]) -> None:
    """actor.lora.dropout=0.3: step 1 is the base's loss (B = 0), but B's gradient sees the dropped inputs, so step
    2 differs from training without dropout; full recompute replays the same masks (megatron's checkpoint keeps the
    RNG state), so its losses and gradients are the ones without recompute; the probe and the exports run without
    dropout (PEFT's own eval forward gives the actor's logits)."""
    from peft import PeftModel

    plain, dropped, recomputed = (result(runs, w, j) for w, j in (("w1", "lora_tp1"), ("w1", "lora_dropout"),
                                                                   ("f1", "lora_dropout_full")))  # fmt: skip
    np.testing.assert_allclose(dropped["first_loss"], plain["first_loss"], rtol=RTOL)
    assert abs(float(dropped["second_loss"]) - float(plain["second_loss"])) > 1e-4, "dropout changed nothing"
    for key in ("first_loss", "first_grad_norm", "second_loss", "second_grad_norm"):
        np.testing.assert_allclose(recomputed[key], dropped[key], rtol=RTOL, err_msg=key)
    for step in (1, 2):
        reference = unsharded_grads(runs, "w1", "lora_dropout", step)
        grads = unsharded_grads(runs, "f1", "lora_dropout_full", step)
        for name, grad in reference.items():
            scale = float(np.abs(grad).max()) or 1.0
            np.testing.assert_allclose(grads[name], grad, rtol=0, atol=RTOL * scale, err_msg=f"{name} step {step}")
    config = json.loads((runs["w1"] / "lora_dropout_adapter" / "adapter_config.json").read_text())
    assert config["lora_dropout"] == 0.3
    peft_model = PeftModel.from_pretrained(load_hf(runs["models"] / MODEL), str(runs["w1"] / "lora_dropout_adapter"))
    with torch.no_grad():
        peft_logits = peft_model.eval()(torch.from_numpy(probe_ids(98))).logits.numpy()
    np.testing.assert_allclose(peft_logits, dropped["logits_after"], rtol=0, atol=ATOL)


def test_a_checkpoint_resumes_only_into_the_same_adapters() -> None:
    lora = LoRASettings(rank=8, alpha=16.0, targets=("qkv", "proj"), dropout=0.0)
    check_same_lora({"rank": 8, "targets": ["qkv", "proj"]}, lora, "ckpt")
    check_same_lora(None, None, "ckpt")
    for saved, now in (
        (None, lora),  # a full student's checkpoint into a LoRA run
        ({"rank": 8, "targets": ["qkv", "proj"]}, None),
        ({"rank": 4, "targets": ["qkv", "proj"]}, lora),
        ({"rank": 8, "targets": ["qkv"]}, lora),
    ):
        with pytest.raises(ConfigError, match=r"actor\.lora\.rank"):
            check_same_lora(saved, now, "ckpt")
