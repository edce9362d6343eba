"""The transformers backend: the only module of teacher_server that imports transformers.

Temperature: logits / T, then log_softmax over the full vocabulary, so every returned value
(top-k, sampled-token logprob, tail, named ids' logprobs and the mass outside top-k + named ids)
is of the temperature-T distribution, all from the one forward. The decoder runs
on right-padded batches of at most `max_batch_tokens` (rows x longest), and the LM head and
log-softmax run only on the scored positions, in chunks of LOGITS_CHUNK_ELEMENTS.

Hidden states (a request's hidden_dtype, teacher.output=hidden): the decoder's last_hidden_state at
the scored positions, which in transformers' decoders is taken after the final norm (LlamaModel /
Qwen2Model `forward`: `hidden_states = self.norm(hidden_states)`), i.e. exactly the output head's
input, rounded to the wire's 16-bit dtype. A hidden-state request with top_k 0 and no named ids (what
the client sends under teacher.output=hidden) runs the decoder only: no output head, no log-softmax
(the actor computes the whole distribution from the states), so its sampled-token logprobs are NaN. A model whose head does more than a bias-free matmul
(logit_scale, soft-capping, a bias) offers no hidden states (hidden_size 0): the actor could not
rebuild its logits from them.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from teacher_server.server.backends import BackendOptions, ModelInfo, token_budget_groups
from teacher_server.wire import hidden_codec
from teacher_server.wire.protocol import TeacherScores, TopKBatch, canonical_order, tokenizer_fingerprint
from teacher_server.wire.score_frames import ParsedRequest

# Rows x vocabulary of fp32 logits materialised at once (2^26 floats = 256 MiB).
LOGITS_CHUNK_ELEMENTS = 1 << 26
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFBackend:
    """A transformers causal LM scoring token sequences with its top-k distribution."""

    def __init__(self, options: BackendOptions) -> None:
        if options.torch_threads > 0:
            torch.set_num_threads(options.torch_threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = _resolve_dtype(options.dtype, self.device)
        model = AutoModelForCausalLM.from_pretrained(options.model_path, dtype=dtype)
        self.model = model.to(self.device).eval()
        self.decoder = self.model.get_decoder()
        self.head = self.model.get_output_embeddings()
        config = self.model.config
        # Models whose causal-LM head rescales or soft-caps logits (Cohere, Gemma 2).
        self.logit_scale = float(getattr(config, "logit_scale", None) or 1.0)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.max_batch_tokens = options.max_batch_tokens
        vocab_size = int(self.head.weight.shape[0])
        plain_head = self.logit_scale == 1.0 and not self.softcap and getattr(self.head, "bias", None) is None
        self.info = ModelInfo(
            model_id=str(Path(options.model_path).resolve()),
            vocab_size=vocab_size,
            tokenizer_hash=_tokenizer_hash(options.model_path),
            max_top_k=min(options.max_top_k, vocab_size),
            backend="hf",
            supports_temperature=True,
            max_named_ids=min(options.max_top_k, vocab_size),
            hidden_size=int(self.head.weight.shape[1]) if plain_head else 0,
        )

    @torch.inference_mode()
    def score(self, request: ParsedRequest) -> TopKBatch:
        """Top-k scores of every position p >= score_from of every sequence, in request order."""
        sequences = request.sequences()
        named = request.named_per_sequence()
        per_sequence: list[TeacherScores] = [None] * len(sequences)  # type: ignore[list-item]
        for group in token_budget_groups(request.lengths, self.max_batch_tokens):
            seqs = [sequences[i] for i in group]
            group_named = None if request.named_ids is None else np.concatenate([named[i] for i in group])
            batch = self._score_group(seqs, request.score_from[group], request, group_named)
            for i, part in zip(group.tolist(), batch.split(), strict=True):
                per_sequence[i] = part
        return TopKBatch.from_sequences(per_sequence)

    def _score_group(
        self,
        seqs: list[np.ndarray],
        score_from: np.ndarray,
        request: ParsedRequest,
        named_NS: np.ndarray | None,
    ) -> TopKBatch:
        longest = max(s.size for s in seqs)
        input_ids_BT = torch.zeros((len(seqs), longest), dtype=torch.long)
        mask_BT = torch.zeros((len(seqs), longest), dtype=torch.long)
        rows_b, rows_t = [], []
        for b, (seq, start) in enumerate(zip(seqs, score_from.tolist(), strict=True)):
            input_ids_BT[b, : seq.size] = torch.from_numpy(seq.astype(np.int64))
            mask_BT[b, : seq.size] = 1
            # Position p is predicted by the hidden state at p-1.
            rows_b += [b] * (seq.size - start)
            rows_t += list(range(start - 1, seq.size - 1))
        input_ids_BT, mask_BT = input_ids_BT.to(self.device), mask_BT.to(self.device)
        hidden_BTH = self.decoder(input_ids=input_ids_BT, attention_mask=mask_BT).last_hidden_state
        idx_b = torch.tensor(rows_b, dtype=torch.long, device=self.device)
        idx_t = torch.tensor(rows_t, dtype=torch.long, device=self.device)
        hidden_NH = hidden_BTH[idx_b, idx_t]  # [N, H]: only the scored positions
        targets_N = input_ids_BT[idx_b, idx_t + 1]
        n_scored = np.asarray([s.size - int(f) for s, f in zip(seqs, score_from, strict=True)], dtype=np.int64)
        if request.hidden_dtype and not request.top_k and named_NS is None:
            batch = _no_logprobs(n_scored)
        else:
            named = None if named_NS is None else torch.from_numpy(named_NS.astype(np.int64)).to(self.device)
            batch = self._topk(hidden_NH, targets_N, n_scored, request.top_k, request.temperature, named)
        if not request.hidden_dtype:
            return batch
        # The wire's precision here already, so the in-process teacher and the wire give the same values.
        hidden = hidden_codec.round_to(hidden_NH.float().cpu().numpy(), request.hidden_dtype)
        return dataclasses.replace(batch, hidden_states=hidden)

    def _topk(
        self,
        hidden_NH: torch.Tensor,
        targets_N: torch.Tensor,
        n_scored: np.ndarray,
        top_k: int,
        temperature: float,
        named_NS: torch.Tensor | None,
    ) -> TopKBatch:
        vocab = self.info.vocab_size
        rows_per_chunk = max(1, LOGITS_CHUNK_ELEMENTS // vocab)
        out: list[tuple[torch.Tensor, ...]] = []
        for lo in range(0, hidden_NH.shape[0], rows_per_chunk):
            rows = slice(lo, lo + rows_per_chunk)
            logprobs_NV = self._logprobs(hidden_NH[rows], temperature)
            sampled_N = logprobs_NV.gather(-1, targets_N[rows, None])[:, 0]
            # top_k = 0: the sampled token's logprob only; outside the empty top-k is all the mass (log 1 = 0).
            values_NK, ids_NK = torch.topk(logprobs_NV, top_k, dim=-1)
            named_values_NS = None if named_NS is None else logprobs_NV.gather(-1, named_NS[rows])
            # Tail mass precisely: logsumexp over everything outside the top-k, not log(1 - sum p).
            # In place: logprobs_NV is not needed any more and a copy would cost a full pass.
            logprobs_NV.scatter_(-1, ids_NK, -math.inf)
            tail_N = torch.logsumexp(logprobs_NV, dim=-1) if top_k else torch.zeros_like(sampled_N)
            chunk = (values_NK, ids_NK, sampled_N, tail_N)
            if named_NS is not None and named_values_NS is not None:
                # The mass outside the top-k and the named ids together, from the same distribution.
                other_N = torch.logsumexp(logprobs_NV.scatter_(-1, named_NS[rows], -math.inf), dim=-1)
                chunk += (named_values_NS, other_N)
            out.append(chunk)
        if not out:
            empty = np.zeros((0, top_k), np.float32)
            no_rows = np.zeros(0, np.float32)
            named_k = 0 if named_NS is None else named_NS.shape[1]
            named = None if named_NS is None else np.zeros((0, named_k), np.float32)
            other = None if named_NS is None else no_rows
            return TopKBatch(n_scored, empty, empty.astype(np.int32), no_rows, no_rows, named, other)
        arrays = [torch.cat(x).cpu().numpy() for x in zip(*out, strict=True)]
        values, ids = canonical_order(arrays[0].astype(np.float32), arrays[1].astype(np.int32))
        extra = [a.astype(np.float32) for a in arrays[4:]]
        return TopKBatch(n_scored, values, ids, arrays[2].astype(np.float32), arrays[3].astype(np.float32), *extra)

    def _logprobs(self, hidden_NH: torch.Tensor, temperature: float) -> torch.Tensor:
        logits_NV = self.head(hidden_NH).float() * self.logit_scale
        if self.softcap:
            logits_NV = torch.tanh(logits_NV / self.softcap) * self.softcap
        return torch.log_softmax(logits_NV / temperature, dim=-1)


def _no_logprobs(n_scored: np.ndarray) -> TopKBatch:
    """A reply with no logprobs at all (a hidden-state request with top_k 0): no top-k, tail 0, sampled NaN."""
    rows = int(n_scored.sum())
    empty = np.zeros((rows, 0), np.float32)
    return TopKBatch(
        n_scored, empty, empty.astype(np.int32), np.full(rows, np.nan, np.float32), np.zeros(rows, np.float32)
    )


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def _tokenizer_hash(model_path: str) -> str:
    """The fingerprint of the tokenizer saved with the model; "" when the directory has none."""
    has_tokenizer = any(
        (Path(model_path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    if not has_tokenizer:
        return ""
    return tokenizer_fingerprint(AutoTokenizer.from_pretrained(model_path))
