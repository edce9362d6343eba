"""Launching MegatronActor scenario ranks (tests/support/megatron_scenarios.py) from a test, and reading their results.

Shared by the actor's tests (tests/recipe_gkd/actor/): the tiny HF models they build offline, one subprocess per
rank with its log, a bounded wait that stops exactly the processes it started, each job's npz.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import megatron_scenarios as scenarios
import numpy as np
import torch

from recipe_gkd.offline_models import LLAMA3_ROPE_SHORT_CONTEXT, TinyModelSpec, build_tiny_causal_lm
from recipe_gkd.plan.ports import reserve_ports

SCENARIO_SCRIPT = Path(scenarios.__file__)
# Both launches together, on 2 busy cores (imports alone take ~10 s per process).
LAUNCH_TIMEOUT_S = 420.0
PORTS_PER_LAUNCH = 32  # one per actor a launch builds (every model twice in the logits jobs)

# ----------------------------------------------------------------------------- models


def build_models(root: Path) -> Path:
    """Tiny HF models: Llama tied/untied (char tokenizer), Qwen2 with qkv biases, Llama vocab 101."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    build_tiny_causal_lm(root / "llama_tied", seed=0)
    build_tiny_causal_lm(root / "llama_untied", seed=1, spec=TinyModelSpec(tie_word_embeddings=False))
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(2)
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=96, num_key_value_heads=1, rope_theta=1e6, **shape))
    with torch.no_grad():  # HF initialises biases to 0: random ones make the bias test real
        for name, param in qwen.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    qwen.save_pretrained(root / "qwen2_bias")
    torch.manual_seed(4)
    # Qwen3: per-head q/k RMSNorm (random weights, HF starts them at 1) and a head_dim of its own (32 != 64 / 4).
    qwen3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=98, num_key_value_heads=2, head_dim=32, **shape))
    with torch.no_grad():
        for name, param in qwen3.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    qwen3.save_pretrained(root / "qwen3_qknorm")
    torch.manual_seed(5)
    # Llama 3.x RoPE scaling, with an original context of 16 so that it changes the probe's logits.
    rope = LLAMA3_ROPE_SHORT_CONTEXT
    llama3 = LlamaForCausalLM(LlamaConfig(vocab_size=99, num_key_value_heads=2, rope_parameters=rope, **shape))
    llama3.save_pretrained(root / "llama3_rope")
    torch.manual_seed(6)
    # Mistral-style Llama: the same blocks under model_type "mistral", no sliding window.
    mistral = MistralForCausalLM(MistralConfig(vocab_size=95, num_key_value_heads=2, sliding_window=None, **shape))
    mistral.save_pretrained(root / "mistral")
    torch.manual_seed(3)
    # Odd vocabulary: TP=2 pads it to 102; untied output layer; GQA 4 heads / 2 groups.
    odd = LlamaForCausalLM(
        LlamaConfig(vocab_size=101, num_key_value_heads=2, tie_word_embeddings=False, rms_norm_eps=1e-5, **shape)
    )
    odd.save_pretrained(root / "llama_untied_odd")
    return root


def load_hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_with_weights(path: Path, arrays: dict[str, np.ndarray]) -> torch.nn.Module:
    model = load_hf(path)
    result = model.load_state_dict({k: torch.from_numpy(v) for k, v in arrays.items()}, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"} and model.config.tie_word_embeddings == bool(
        result.missing_keys
    )
    return model


# ----------------------------------------------------------------------------- launches


def free_ports(count: int) -> list[int]:
    return reserve_ports(count)


def launch(
    world: int, jobs: str, models: Path, workdir: Path, env: dict[str, str], device: str = "cpu"
) -> list[subprocess.Popen]:
    """One scenario process per rank, output to workdir/rank<r>.log."""
    workdir.mkdir(parents=True)
    ports = ",".join(map(str, free_ports(PORTS_PER_LAUNCH)))
    procs = []
    for rank in range(world):
        log = open(workdir / f"rank{rank}.log", "w")  # the child keeps its own descriptor
        cmd = [sys.executable, str(SCENARIO_SCRIPT), f"--rank={rank}", f"--world={world}", f"--device={device}"]
        cmd += [f"--workdir={workdir}", f"--models={models}", f"--ports={ports}", f"--jobs={jobs}"]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        log.close()
    return procs


def wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        for proc, log in zip(procs, logs, strict=True):
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert rc == 0, f"{log} (rc {rc}):\n{log.read_text()[-4000:]}"
    finally:
        for proc in procs:  # only the processes this fixture started, by handle
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def result(runs: dict[str, Path], world: str, job: str) -> dict[str, np.ndarray]:
    with np.load(runs[world] / f"{job}.npz") as data:
        return {k: data[k] for k in data.files}


def prefixed(data: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix) + 1 :]: v for k, v in data.items() if k.startswith(prefix + "/")}
