"""The MoE demo's student (recipe_gkd.demo.moe_student): the upcycle against the dense student in float64, the
committed student against its manifest and recipe, its router's top-k gaps, and (slow) two builds giving the same
bytes."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from repo_paths import REPO_ROOT as REPO
from safetensors import safe_open

from recipe_gkd.config import ConfigError
from recipe_gkd.config.rules import require_built_asset
from recipe_gkd.demo import moe_student, task
from recipe_gkd.demo.build_assets import MANIFEST, file_table, load_model
from recipe_gkd.demo.sft import collate, encode_example
from recipe_gkd.models import read_hf_arch

REPO_ASSETS = REPO / "assets" / "moe"
# float64 logits of the dense student and of its upcycle with identical experts and a router of zeros (routing
# weights exactly 1/2 and 1/2): each reduction (length <= 192) is off by at most 192 x 2^-53 of its sum of |terms|
# (< 1e3 here: < 3e-11); 1e-9 leaves a factor of 30 for the two layers and the head it goes through.
FLOAT64_LOGITS_ATOL = 1e-9
FLIPS_ALLOWED = 10


@pytest.fixture
def in_repo() -> Iterator[None]:
    """The recipe names the dense student by its repository path."""
    cwd = Path.cwd()
    os.chdir(REPO)
    try:
        yield
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def dense() -> tuple[torch.nn.Module, object]:
    return load_model(REPO / moe_student.INIT_FROM)


def _batch(tokenizer: object, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids_BL, attention_BL, _ = collate(
        [encode_example(tokenizer, e) for e in task.read_jsonl(REPO / moe_student.EVAL_FILE, limit=n)],
        tokenizer.pad_token_id,
    )
    return input_ids_BL, attention_BL


def test_upcycle_with_identical_experts_is_the_dense_student(dense: tuple[torch.nn.Module, object]) -> None:
    """Every copied tensor lands where it belongs: Qwen3's q/k norms taken out, the experts unperturbed and the
    router at zero, the MoE computes the dense student's logits."""
    model, tokenizer = dense
    moe = moe_student.upcycle(model, how=replace(moe_student.UPCYCLE, expert_noise=0.0))
    with torch.no_grad():
        for layer in moe.model.layers:
            layer.mlp.gate.weight.zero_()
            layer.self_attn.q_norm = torch.nn.Identity()  # Llama has none; the upcycle leaves them at weight 1
            layer.self_attn.k_norm = torch.nn.Identity()
    moe.set_experts_implementation("eager")  # grouped_mm takes no float64
    input_ids_BL, attention_BL = _batch(tokenizer, 64)
    with torch.no_grad():
        dense_BLV = model.double()(input_ids=input_ids_BL, attention_mask=attention_BL).logits
        moe_BLV = moe.double()(input_ids=input_ids_BL, attention_mask=attention_BL).logits
    model.float()
    real_BL = attention_BL.bool()
    assert (moe_BLV - dense_BLV)[real_BL].abs().max() <= FLOAT64_LOGITS_ATOL


def test_upcycled_experts_differ_by_their_perturbation(dense: tuple[torch.nn.Module, object]) -> None:
    model, _ = dense
    moe = moe_student.upcycle(model)
    noise = moe_student.UPCYCLE.expert_noise
    source = model.state_dict()
    for i, layer in enumerate(moe.model.layers):
        gate_up_FH = torch.cat(
            [source[f"model.layers.{i}.mlp.gate_proj.weight"], source[f"model.layers.{i}.mlp.up_proj.weight"]]
        )
        experts_EFH = layer.mlp.experts.gate_up_proj.detach()
        # Each expert: the dense tensor plus noise of std noise x its std (tens of thousands of draws: within 5%).
        for e in range(moe.config.num_experts):
            relative = (experts_EFH[e] - gate_up_FH).std() / gate_up_FH.std()
            assert relative == pytest.approx(noise, rel=0.05)
        assert not torch.equal(experts_EFH[0], experts_EFH[1])
        assert layer.mlp.gate.weight.std() > 0


def test_committed_student_matches_its_manifest_and_recipe(in_repo: None) -> None:
    """The student in the checkout: its files as the manifest says, built from today's recipe and dense student."""
    assert moe_student.manifest_problem(REPO_ASSETS) is None
    manifest = json.loads((REPO_ASSETS / MANIFEST).read_text())
    assert manifest["total_bytes"] < 2 * 2**20
    config = json.loads((REPO_ASSETS / "student/config.json").read_text())
    dense = json.loads((REPO / moe_student.INIT_FROM / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim"):
        assert config[key] == dense[key], key
    from transformers import AutoConfig

    arch = read_hf_arch(AutoConfig.from_pretrained(REPO_ASSETS / "student"))
    assert (arch.num_experts, arch.experts_per_token, arch.moe_intermediate_size) == (4, 2, dense["intermediate_size"])
    # Per-expert names, as Qwen3-MoE checkpoints ship them.
    with safe_open(REPO_ASSETS / "student/model.safetensors", "pt") as f:
        names = set(f.keys())
    for i in range(config["num_hidden_layers"]):
        assert f"model.layers.{i}.mlp.gate.weight" in names
        for e in range(arch.num_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{i}.mlp.experts.{e}.{proj}.weight" in names
    for name in moe_student.TOKENIZER_FILES:
        assert (REPO_ASSETS / "student" / name).read_bytes() == (REPO / moe_student.INIT_FROM / name).read_bytes()


def test_manifest_check_names_what_is_wrong(tmp_path: Path, in_repo: None) -> None:
    assert "no " in moe_student.manifest_problem(tmp_path)
    (tmp_path / "student").mkdir()
    for name in moe_student.REQUIRED_FILES:
        (tmp_path / name).write_text("placeholder\n")
    manifest = {"recipe": moe_student.recipe(), "files": file_table(tmp_path, ("student",))}
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    assert moe_student.manifest_problem(tmp_path) is None
    (tmp_path / "student/model.safetensors").write_text("changed\n")
    assert "differs" in moe_student.manifest_problem(tmp_path)
    manifest["recipe"]["upcycle"]["seed"] += 1
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    assert "recipe" in moe_student.manifest_problem(tmp_path)


def test_committed_router_has_no_tie_on_the_held_out_records(in_repo: None, tmp_path: Path) -> None:
    """The manifest's router figures are the committed student's; a router with equal rows ties everywhere and the
    build's check refuses it."""
    manifest = json.loads((REPO_ASSETS / MANIFEST).read_text())
    held_out = task.read_jsonl(moe_student.EVAL_FILE)
    stats = moe_student.check_router(REPO_ASSETS / "student", held_out)
    assert stats.min_gap > 0 and stats.tokens == manifest["student"]["router"]["tokens"]
    # A choice moves to another expert only where its gap is within rounding: none within the router's own (the
    # manifest's near_ties: 0); FLIPS_ALLOWED more leave room for the hidden states' rounding on another x86 CPU.
    slots = stats.tokens * moe_student.MOE.experts_per_token
    allowed = (manifest["student"]["router"]["near_ties"] + FLIPS_ALLOWED) / slots
    for row, committed in zip(stats.expert_load, manifest["student"]["router"]["expert_load"], strict=True):
        assert row == pytest.approx(committed, abs=allowed)
    model, tokenizer = load_model(REPO_ASSETS / "student")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.copy_(layer.mlp.gate.weight[:1].expand_as(layer.mlp.gate.weight))
    assert moe_student.router_stats(model, tokenizer, held_out[:8]).min_gap == 0
    model.save_pretrained(tmp_path / "tied")
    tokenizer.save_pretrained(tmp_path / "tied")
    with pytest.raises(RuntimeError, match="exact tie"):
        moe_student.check_router(tmp_path / "tied", held_out[:8])


def test_a_missing_moe_student_names_the_command_that_builds_it(tmp_path: Path) -> None:
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(ConfigError, match=r"build it with `python -m recipe_gkd\.demo\.moe_student`"):
            require_built_asset("assets/moe/student", "model.student_path")
    finally:
        os.chdir(cwd)


@pytest.mark.slow
def test_two_builds_give_the_same_bytes_and_a_student_below_the_teacher(tmp_path: Path, in_repo: None) -> None:
    """Deterministic on any machine (the committed bytes are one machine's: another CPU may round differently)."""
    first = moe_student.build(tmp_path / "a")
    second = moe_student.build(tmp_path / "b")
    assert first["files"] == second["files"]
    assert first["student"] == second["student"]
    accuracy = first["student"]["eval_accuracy"]
    reference = first["reference"]
    # In the dense student's range (30% held-out), far from the teacher's (99.8%).
    assert abs(accuracy - reference["dense_student_eval_accuracy"]) <= 0.1
    assert accuracy <= reference["teacher_eval_accuracy"] - 0.5
