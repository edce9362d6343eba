"""Rollout engines of a LoRA student (actor.lora.rank > 0): the adapter-only sync's load into the HF engine's hooks and
into vLLM's LoRA slot (in place, under one id), against a float64 HF model with the adapter merged by hand
(W + B A, scale 1: the sync form), and the weight check reading what vLLM's LoRA layers hold.

One tiny Qwen3 with GQA (head_dim 32: vLLM's CPU attention refuses 16); one vLLM engine for the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from recipe_gkd.config import GKDConfig, load_config
from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm
from recipe_gkd.weight_sync import tensor_checksum, weight_mismatches
from recipe_gkd.weight_sync.adapter import adapter_modules, lora_names

SPEC = TinyModelSpec(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32)
TARGETS = ["qkv", "proj", "fc1", "fc2"]
RANK = 4
PROBE = np.asarray([[1, 4, 72, 73, 74, 5, 80, 81, 2], [1, 4, 90, 91, 92, 93, 5, 70, 71]])
# Each factor's spread: B A moves the probe's logprobs by ~0.2 nats on average (a version is visible).
ADAPTER_STD = 0.1
# fp32 engines against the float64 reference: ~25 reductions of length <= 256 through 2 layers (the adapter adds two
# per projection, of length <= 256 and RANK), each typically sqrt(256) * 2^-24 ~ 1e-6 of its size on logits below 1:
# ~3e-5 if every one erred the same way, ~5e-6 at random (measured 2e-7); 1e-5, the dense engines' bound too
# (test_rollout_vllm.py). A stale or misplaced adapter tensor moves them by > 1e-2 (asserted below).
LOGPROB_TOLERANCE = 1e-5
VERSION_SHIFT = 1e-2


def _cfg(student: Path, run_dir: Path, *extra: str) -> GKDConfig:
    return load_config(
        None,
        [
            f"model.student_path={student}",
            f"trainer.run_dir={run_dir}",
            "rollout.sampling.max_new_tokens=6",
            "data.max_prompt_length=64",
            f"actor.lora.rank={RANK}",
            "actor.lora.alpha=16",  # the sync form has folded alpha / rank into B already: engines ignore it
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def student(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_causal_lm(tmp_path_factory.mktemp("lora_student"), seed=0, spec=SPEC, family="qwen3")


def _random_adapter(student: Path, seed: int) -> dict[str, torch.Tensor]:
    """A random adapter version in its sync form, shaped from the HF model's own linears: A [rank, in], B [out,
    rank], both random (never B = 0: every projection's update shows)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    named = {}
    for module in adapter_modules(SPEC.num_layers, TARGETS):
        linear = model.get_submodule(module)
        a, b = lora_names(module)
        named[a] = torch.randn(RANK, linear.in_features, generator=gen) * ADAPTER_STD
        named[b] = torch.randn(linear.out_features, RANK, generator=gen) * ADAPTER_STD
    return named


def _reference(student: Path, adapter: dict[str, torch.Tensor] | None, ids_BL: np.ndarray = PROBE) -> np.ndarray:
    """[B, L-1] token logprobs of the float64 HF model with `adapter` merged into its weights (W += B A), by hand."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float64).eval()
    ids = torch.as_tensor(ids_BL, dtype=torch.long)
    with torch.no_grad():
        for module in adapter_modules(SPEC.num_layers, TARGETS) if adapter else []:
            a, b = lora_names(module)
            model.get_submodule(module).weight += adapter[b].double() @ adapter[a].double()
        logprobs_BLV = torch.log_softmax(model(input_ids=ids).logits[:, :-1], -1)
    return logprobs_BLV.gather(-1, ids[:, 1:, None])[..., 0].numpy()


def _sent_checksums(adapter: dict[str, torch.Tensor], dtype: str) -> dict[str, int]:
    """What the actor's side of the check holds: each sent tensor's checksum in `dtype`."""
    return {name: tensor_checksum(t, getattr(torch, dtype)) for name, t in adapter.items()}


def _stream(adapter: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    return iter(adapter.items())


def _mean_diff(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).mean())


@pytest.fixture(scope="module")
def adapters(student: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Two versions; the second as the object store brings a bf16 actor's: B and A rounded to bf16."""
    second = {n: t.to(torch.bfloat16) for n, t in _random_adapter(student, seed=2).items()}
    return {"v1": _random_adapter(student, seed=1), "v2": second}


@pytest.fixture(scope="module")
def references(student: Path, adapters: dict[str, dict[str, torch.Tensor]]) -> dict[str, np.ndarray]:
    out = {"base": _reference(student, None)} | {v: _reference(student, a) for v, a in adapters.items()}
    assert min(_mean_diff(out[x], out[y]) for x, y in (("base", "v1"), ("base", "v2"), ("v1", "v2"))) > VERSION_SHIFT
    return out


# ----------------------------------------------------------------------------- the HF engine


def test_hf_engine_follows_each_adapter_version(student: Path, tmp_path: Path, adapters, references) -> None:
    from recipe_gkd.rollout.hf import HFEngine

    engine = HFEngine(_cfg(student, tmp_path))
    assert _mean_diff(engine.token_logprobs(PROBE), references["base"]) <= LOGPROB_TOLERANCE  # no adapter yet
    assert engine.weight_checksums("float32") == []
    for version, dtype in (("v1", "float32"), ("v2", "bfloat16")):
        sent = adapters[version]
        # v2 as numpy arrays (bf16 values upcast): the object store's form of an fp32 export.
        stream = _stream(sent) if version == "v1" else ((n, t.float().numpy()) for n, t in sent.items())
        assert engine.update_adapter(stream) == set(sent)
        assert _mean_diff(engine.token_logprobs(PROBE), references[version]) <= LOGPROB_TOLERANCE
        assert weight_mismatches(_sent_checksums(sent, dtype), engine.weight_checksums(dtype)) == []
    # The base is never synced: its parameters keep their HF names and values, only the adapter is checked.
    assert {t.name for t in engine.weight_checksums("float32")} == set(adapters["v2"])
    assert "model.layers.0.self_attn.q_proj.weight" in dict(engine.model.named_parameters())


def test_hf_engine_refuses_an_incomplete_or_misshapen_version(
    student: Path, tmp_path: Path, adapters, references
) -> None:
    from recipe_gkd.rollout.hf import HFEngine

    engine = HFEngine(_cfg(student, tmp_path))
    engine.update_adapter(_stream(adapters["v1"]))
    _assert_refusals(engine, adapters, references)
    assert weight_mismatches(_sent_checksums(adapters["v1"], "float32"), engine.weight_checksums("float32")) == []
    full = HFEngine(_cfg(student, tmp_path, "actor.lora.rank=0"))
    with pytest.raises(ValueError, match=r"actor\.lora\.rank=0"):
        full.update_adapter(_stream(adapters["v1"]))


def _assert_refusals(engine, adapters: dict[str, dict[str, torch.Tensor]], references: dict[str, np.ndarray]) -> None:
    """A version missing a tensor, and one of twice the rank, are refused before anything changes: the engine
    (holding v1) keeps v1."""
    incomplete = dict(adapters["v2"])
    dropped = sorted(incomplete)[5]
    incomplete.pop(dropped)
    with pytest.raises(KeyError, match=rf"adapter version incomplete: missing \['{dropped}'\]"):
        engine.update_adapter(_stream(incomplete))
    wider = {n: torch.cat([t, t], dim=1 if ".lora_B." in n else 0) for n, t in adapters["v2"].items()}
    with pytest.raises(ValueError, match=r"wrong shape.*actor\.lora\.rank"):
        engine.update_adapter(_stream(wider))
    assert _mean_diff(engine.token_logprobs(PROBE), references["v1"]) <= LOGPROB_TOLERANCE


# ----------------------------------------------------------------------------- the vLLM engine


@pytest.fixture(scope="module")
def vllm_engine(student: Path, tmp_path_factory: pytest.TempPathFactory, vllm_in_this_process: None):
    from recipe_gkd.rollout.vllm import VLLMEngine

    run_dir = tmp_path_factory.mktemp("lora_run")
    engine = VLLMEngine(_cfg(student, run_dir, "rollout.backend=vllm"))
    try:
        yield engine, run_dir
    finally:
        engine.llm.llm_engine.engine_core.shutdown()


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_follows_each_adapter_version(student: Path, vllm_engine, adapters, references) -> None:
    engine, run_dir = vllm_engine
    assert _mean_diff(engine.token_logprobs(PROBE), references["base"]) <= LOGPROB_TOLERANCE  # no adapter yet
    assert engine.weight_checksums("float32") == []
    for version, dtype in (("v1", "float32"), ("v2", "bfloat16")):
        sent = adapters[version]
        assert engine.update_adapter(_stream(sent)) == set(sent)
        assert _mean_diff(engine.token_logprobs(PROBE), references[version]) <= LOGPROB_TOLERANCE
        assert weight_mismatches(_sent_checksums(sent, dtype), engine.weight_checksums(dtype)) == []
        assert list((run_dir / "adapter_sync").iterdir()) == []  # each version's directory is gone once loaded
    # Sampling names the adapter too: the sampled tokens' logprobs are the merged model's.
    prompt = [1, 4, 72, 73, 74, 5]
    generation = engine.generate([prompt], greedy=True)[0]
    reference = _reference(student, adapters["v2"], np.asarray([prompt + generation.response_ids]))
    np.testing.assert_allclose(generation.logprobs, reference[0, len(prompt) - 1 :], atol=1e-4)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_reload_without_load_inplace_is_stale_and_the_check_says_so(
    vllm_engine, adapters, references, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM keeps the adapter of an id it already holds unless the request says load_inplace: the same id's second
    version would silently leave the first in the slot. The checksums, read from the slot, show it."""
    import recipe_gkd.rollout.vllm as vllm_module

    engine, _ = vllm_engine
    engine.update_adapter(_stream(adapters["v1"]))
    original = vllm_module.adapter_request
    monkeypatch.setattr(vllm_module, "adapter_request", lambda path, in_place: original(path, in_place=False))
    engine.update_adapter(_stream(adapters["v2"]))
    stale = weight_mismatches(_sent_checksums(adapters["v2"], "bfloat16"), engine.weight_checksums("bfloat16"))
    assert len(stale) == len(adapters["v2"]), stale[:3]
    assert _mean_diff(engine.token_logprobs(PROBE), references["v1"]) <= LOGPROB_TOLERANCE  # still v1
    monkeypatch.undo()
    engine.update_adapter(_stream(adapters["v2"]))
    assert weight_mismatches(_sent_checksums(adapters["v2"], "bfloat16"), engine.weight_checksums("bfloat16")) == []
    assert _mean_diff(engine.token_logprobs(PROBE), references["v2"]) <= LOGPROB_TOLERANCE


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_refuses_an_incomplete_or_misshapen_version(vllm_engine, adapters, references) -> None:
    engine, _ = vllm_engine
    engine.update_adapter(_stream(adapters["v1"]))
    _assert_refusals(engine, adapters, references)
    assert weight_mismatches(_sent_checksums(adapters["v1"], "float32"), engine.weight_checksums("float32")) == []


@pytest.mark.vllm
def test_the_lora_slot_is_the_smallest_rank_vllm_takes() -> None:
    from recipe_gkd.rollout.vllm import lora_engine_args

    # vLLM 0.32's max_lora_rank takes 1, 8, 16, 32, 64, 128, 256, 320, 512 (vllm/config/lora.py).
    assert [lora_engine_args(r, ["qkv"])["max_lora_rank"] for r in (1, 4, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    assert lora_engine_args(8, ["qkv", "fc2"])["lora_target_modules"] == ["q_proj", "k_proj", "v_proj", "down_proj"]
    with pytest.raises(ValueError, match=r"actor\.lora\.rank=513"):
        lora_engine_args(513, ["qkv"])


TP2_SCENARIO = """
import json, sys
import numpy as np, torch
from safetensors.torch import load_file
import recipe_gkd.rollout.vllm as vllm_module
from recipe_gkd.config import load_config
from recipe_gkd.weight_sync import tensor_checksum, weight_mismatches

student, run_dir, adapters_dir, probe_file, out_file, rank = sys.argv[1:7]
cfg = load_config(None, [f"model.student_path={student}", f"trainer.run_dir={run_dir}", "rollout.backend=vllm",
    "rollout.tp=2", "rollout.gpus_per_node=2", "cluster.gpus_per_node=4", f"actor.lora.rank={rank}",
    "data.max_prompt_length=64", "rollout.sampling.max_new_tokens=6"])
engine = vllm_module.VLLMEngine(cfg)
probe = np.load(probe_file)
out = {"base": engine.token_logprobs(probe).tolist()}
for version in ("v1", "v2", "stale"):
    sent = load_file(f"{adapters_dir}/{'v1' if version == 'stale' else version}.safetensors")
    if version == "stale":  # v1 again under the same id, without load_inplace: vLLM keeps v2 in the slot
        original = vllm_module.adapter_request
        vllm_module.adapter_request = lambda path, in_place: original(path, in_place=False)
    engine.update_adapter(iter(sent.items()))
    sums = {n: tensor_checksum(t, torch.float32) for n, t in sent.items()}
    out[version] = engine.token_logprobs(probe).tolist()
    out[version + "_mismatches"] = len(weight_mismatches(sums, engine.weight_checksums("float32")))
open(out_file, "w").write(json.dumps(out))
"""


@pytest.mark.vllm
@pytest.mark.slow
def test_a_tp2_vllm_engine_loads_the_adapter_in_both_workers(
    student: Path, tmp_path: Path, adapters, references
) -> None:
    """rollout.tp=2 (vLLM's multiprocessing executor; the adapter reaches both workers through the engine's own LoRA
    API): the merged model's logprobs; the checksums summed over the workers' shards of each slot (B of q/k/v and
    gate/up split by rows, A of o/down by columns) equal the sent adapter, and a reload without load_inplace fails
    them. In a process of its own: vLLM freezes its CPU thread binding at the first engine's start."""
    import json
    import subprocess
    import sys

    from safetensors.torch import save_file

    for version in ("v1", "v2"):
        save_file(
            {n: t.float().contiguous() for n, t in adapters[version].items()}, str(tmp_path / f"{version}.safetensors")
        )
    np.save(tmp_path / "probe.npy", PROBE)
    args = [str(student), str(tmp_path / "run"), str(tmp_path), str(tmp_path / "probe.npy"), str(tmp_path / "out.json")]
    proc = subprocess.run(
        [sys.executable, "-c", TP2_SCENARIO, *args, str(RANK)], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads((tmp_path / "out.json").read_text())
    for version in ("base", "v1", "v2"):
        assert _mean_diff(np.asarray(out[version]), references[version]) <= LOGPROB_TOLERANCE, version
    assert out["v1_mismatches"] == 0 and out["v2_mismatches"] == 0
    assert out["stale_mismatches"] == len(adapters["v1"]), "the slot kept v2: every tensor differs from v1's"
    assert _mean_diff(np.asarray(out["stale"]), references["v2"]) <= LOGPROB_TOLERANCE
