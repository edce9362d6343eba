"""Scoring backends behind one interface: `score(ParsedRequest) -> TopKBatch`.

`hf` (transformers) and `vllm` are each imported only by their own module, and only when
`load_backend` asks for them, so `import teacher_server` stays free of both engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from teacher_server.wire.protocol import TOKEN_DTYPE, TopKBatch
from teacher_server.wire.score_frames import ParsedRequest

BACKENDS = ("hf", "vllm")


@dataclass(frozen=True)
class ModelInfo:
    """What a replica tells the frontend (and the handshake tells clients) about its model."""

    model_id: str
    vocab_size: int
    tokenizer_hash: str
    max_top_k: int
    backend: str
    supports_temperature: bool
    # Most ids a request may name per scored position (the student's top-k); 0: none.
    max_named_ids: int = 0
    # The width of the final hidden states a reply can carry (teacher.output=hidden); 0: none.
    hidden_size: int = 0


@dataclass(frozen=True)
class BackendOptions:
    """Everything a backend needs to load its model (from the teacher config section)."""

    model_path: str
    max_top_k: int
    max_batch_tokens: int = 8192
    # auto: bfloat16 on CUDA, float32 on CPU.
    dtype: str = "auto"
    # Intra-op threads of the CPU path; 0 keeps torch's default.
    torch_threads: int = 0
    gpus: int = 1
    # vllm: share of each GPU's memory for weights + KV cache; longest scored sequence (0: the model's).
    gpu_memory_utilization: float = 0.9
    max_model_len: int = 0
    # teacher.output: "topk" or "hidden". The vllm backend runs one engine per mode (a pooling-mode engine for
    # "hidden", see backends/vllm.py); the hf backend answers both from one model and ignores it.
    output: str = "topk"
    # A Jinja chat template file that text requests are rendered with instead of the tokenizer's own (teacher.chat_template).
    chat_template: str = ""


class Backend(Protocol):
    info: ModelInfo

    def score(self, request: ParsedRequest) -> TopKBatch: ...


def load_backend(kind: str, options: BackendOptions) -> Backend:
    """Import and build backend `kind` ("hf" or "vllm")."""
    if not Path(options.model_path).is_dir():
        raise FileNotFoundError(f"teacher.model_path {options.model_path!r} is not a model directory")
    if kind == "hf":
        from teacher_server.server.backends.hf import HFBackend

        return HFBackend(options)
    if kind == "vllm":
        from teacher_server.server.backends.vllm import VLLMBackend

        return VLLMBackend(options)
    if kind == "openai":
        raise ValueError(
            "teacher.backend=openai is served by vLLM itself (vllm serve MODEL --max-logprobs K), not by this server: "
            f"the trainer talks to it directly; this server serves {BACKENDS}"
        )
    raise ValueError(f"unknown teacher.backend {kind!r}; choose from {BACKENDS}")


def parsed_request(
    sequences: Sequence[np.ndarray | Sequence[int]],
    score_from: Sequence[int],
    *,
    top_k: int,
    temperature: float = 1.0,
    named_ids: Sequence[np.ndarray] | None = None,
    hidden_dtype: str = "",
) -> ParsedRequest:
    """Build a ParsedRequest in-process (tests, benchmarks): the same input the server hands a backend.

    named_ids: per sequence [length - score_from, named_k] ids to score at each scored position.
    """
    arrays = [np.asarray(s, dtype=TOKEN_DTYPE).reshape(-1) for s in sequences]
    named = None
    if named_ids is not None:
        named = np.concatenate([np.asarray(n, dtype=TOKEN_DTYPE) for n in named_ids])
    return ParsedRequest(
        ids=np.concatenate(arrays),
        lengths=np.asarray([a.size for a in arrays], dtype=np.int64),
        score_from=np.asarray(score_from, dtype=np.int64),
        top_k=top_k,
        temperature=temperature,
        named_ids=named,
        hidden_dtype=hidden_dtype,
    )


def token_budget_groups(lengths: np.ndarray, max_batch_tokens: int) -> list[np.ndarray]:
    """Sequence indices grouped so that each padded batch (rows x longest) stays within the budget.

    Longest first, so each group pads little; a sequence longer than the budget goes alone.
    """
    order = np.argsort(-lengths, kind="stable")
    groups: list[np.ndarray] = []
    start = 0
    while start < order.size:
        longest = int(lengths[order[start]])
        rows = max(1, max_batch_tokens // max(longest, 1))
        groups.append(order[start : start + rows])
        start += rows
    return groups
