"""The trainer's side of the wire: a DEALER client with request ids, bounded retries and typed errors.

    client = TeacherClient.from_config(cfg.teacher, vocab_size=V, tokenizer_hash=tokenizer_fingerprint(tok))
    scores = client.score(sequences, score_from)   # list[TeacherScores], one per sequence, in order

`score` splits a batch into contiguous chunks of about equal tokens (at least
teacher.client.max_inflight of them when there are enough sequences, more if a chunk would
exceed the server's request size limit), keeps up to max_inflight requests in flight, matches
replies by request id and reassembles them in order. While waiting it pings the server:
- nothing at all heard for teacher.timeout_s            -> TeacherDeadError (names teacher.address)
- a request unanswered for teacher.timeout_s, or its replica lost: resent on a fresh socket
  up to teacher.client.retries times, then TeacherTimeoutError (names teacher.timeout_s)
- `busy` / `no_replicas`: resent after a short backoff within the same time budget
- any other error reply: TeacherRequestError, at once (a bad request is never retried).
No batch is ever dropped silently: `score` returns every sequence or raises.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import zmq

from teacher_server.wire import protocol as P
from teacher_server.wire.conversation import Conversation
from teacher_server.wire.score_frames import parse_score_reply, request_frames

if TYPE_CHECKING:
    from teacher_server.config.teacher import TeacherConfig

PING_INTERVAL_S = 1.0
BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0)
# Bytes kept free in each request for its header.
HEADER_ALLOWANCE = 64 << 10
# Text per text request (it travels in the header, which the server caps at P.MAX_HEADER_BYTES; UTF-8 <= 4 x chars).
TEXT_CHUNK_BYTES = P.MAX_HEADER_BYTES // 2


class TeacherError(RuntimeError):
    """Base of every error the teacher client raises."""


class TeacherDeadError(TeacherError):
    """No teacher server answers at the configured address."""


class TeacherTimeoutError(TeacherError):
    """The server answers but a request did not complete in time, retries included."""


class TeacherRequestError(TeacherError):
    """The server refused a request (bad input, backend failure); retrying would not help."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"teacher refused the request ({code}): {message}")
        self.code = code


class TeacherMismatchError(TeacherError):
    """The teacher does not fit the student (vocabulary, tokenizer, top_k, temperature)."""


@dataclass
class _Pending:
    chunk: int
    frames: list[bytes]
    first_sent: float
    sent: float
    attempts: int = 0
    resend_at: float = 0.0
    resend_new_attempt: bool = True
    last_error: str = ""


@dataclass
class _Round:
    """State of one `_run`: chunks waiting to be sent, requests in flight, results by chunk."""

    queue: list[int]
    results: dict[int, Any] = field(default_factory=dict)
    pending: dict[int, _Pending] = field(default_factory=dict)


class TeacherClient:
    """Talks to one teacher server. Not thread-safe: use one client per thread."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 300.0,
        max_inflight: int = 4,
        retries: int = 3,
        secret: bytes = b"",
        top_k: int = 64,
        temperature: float = 1.0,
        logprob_dtype: str = "float16",
        id_encoding: str = "elias_fano",
        expect_vocab_size: int | None = None,
        expect_tokenizer_hash: str | None = None,
        context: zmq.Context | None = None,
        hidden_dtype: str = "",
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight
        self.retries = retries
        self.top_k = top_k
        self.temperature = temperature
        self.logprob_dtype = logprob_dtype
        self.id_encoding = id_encoding
        # "bfloat16" / "float16": every request also asks for the final hidden states (teacher.output=hidden).
        self.hidden_dtype = hidden_dtype
        self.expect_vocab_size = expect_vocab_size
        self.expect_tokenizer_hash = expect_tokenizer_hash
        self._auth = P.auth_token(secret)
        self._ctx = context or zmq.Context.instance()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self.server: P.HelloReply | None = None

    @classmethod
    def from_config(
        cls,
        teacher: TeacherConfig,
        *,
        vocab_size: int | None = None,
        tokenizer_hash: str | None = None,
        address: str | None = None,
    ) -> TeacherClient:
        """A client for the `teacher` config section; `address` overrides teacher.address (autostart).

        teacher.output=hidden: requests ask for the hidden states and no top-k (top_k 0: the hidden
        states give the whole distribution, the sampled token's logprob still comes along).
        """
        from teacher_server.config.teacher import TeacherOutput

        hidden = teacher.output == TeacherOutput.hidden
        return cls(
            address or teacher.address,
            timeout_s=teacher.timeout_s,
            max_inflight=teacher.client.max_inflight,
            retries=teacher.client.retries,
            secret=P.read_secret(teacher.secret_file),
            top_k=0 if hidden else teacher.top_k,
            temperature=teacher.temperature,
            logprob_dtype=teacher.client.logprob_dtype,
            id_encoding=teacher.client.id_encoding,
            expect_vocab_size=vocab_size,
            expect_tokenizer_hash=tokenizer_hash,
            hidden_dtype=teacher.client.hidden_dtype if hidden else "",
        )

    # ------------------------------------------------------------------ public API

    def connect(self) -> P.HelloReply:
        """Handshake; checks protocol version, vocabulary, tokenizer, top_k and temperature support."""
        reply = self._run([[P.encode(P.Hello(P.PROTOCOL_VERSION, 0, self._auth))]], P.HelloReply)[0]
        self._check_handshake(reply)
        self.server = reply
        return reply

    def score(
        self,
        sequences: Sequence[np.ndarray | Sequence[int]],
        score_from: Sequence[int],
        *,
        top_k: int | None = None,
        temperature: float | None = None,
        replica: str = "",
        named_ids: Sequence[np.ndarray] | None = None,
    ) -> list[P.TeacherScores]:
        """The teacher's top-k for positions score_from[i] .. len(sequences[i]) - 1 of every sequence.

        score_from[i] >= 1 (the first response token). `replica` pins the request to one
        replica by name (readiness probes). `named_ids` (per sequence [len - score_from, k_s]):
        ids whose logprobs the teacher also returns at each scored position (the student's top-k).
        Raises a TeacherError subclass; never drops a sequence.
        """
        if len(sequences) != len(score_from):
            raise ValueError(f"{len(sequences)} sequences but {len(score_from)} score_from values")
        if not sequences:
            return []
        server = self.server or self.connect()
        named_k = self._check_named(server, named_ids, len(sequences))
        arrays = [np.asarray(s, dtype=P.TOKEN_DTYPE).reshape(-1) for s in sequences]
        # A scored token's named ids travel with it: budget a token at (1 + named_k) int32s.
        token_bytes = P.TOKEN_DTYPE.itemsize * (1 + named_k)
        max_tokens = max(1, (server.max_request_bytes - HEADER_ALLOWANCE) // token_bytes)
        chunks = split_balanced([a.size for a in arrays], self.max_inflight, max_tokens)
        k = self.top_k if top_k is None else top_k
        temp = self.temperature if temperature is None else temperature
        requests = [self._chunk_frames(arrays, score_from, lo, hi, k, temp, replica, named_ids) for lo, hi in chunks]
        batches = self._run(requests, P.TopKBatch)
        return [part for batch in batches for part in batch.split()]

    def score_conversations(self, conversations: Sequence[Conversation]) -> list[P.TeacherScores]:
        """The teacher's scores of each conversation's response in the teacher's own tokens (algorithm.cross_tokenizer):
        the server renders them (teacher_server/wire/conversation.py); each result also carries its token ids and their
        byte ranges in the response text. A conversation the teacher cannot render raises TeacherMismatchError.
        """
        if not conversations:
            return []
        self.server or self.connect()
        # Text travels in the header: chunks of at most TEXT_CHUNK_BYTES of text (the header limit is 1 MiB).
        sizes = [
            len(c.prompt) + len(c.response) + sum(len(m.get("content", "")) for m in c.messages) for c in conversations
        ]
        chunks = split_balanced([max(1, 4 * n) for n in sizes], self.max_inflight, TEXT_CHUNK_BYTES)
        requests = [
            request_frames(
                0,
                [],
                [],
                top_k=self.top_k,
                temperature=self.temperature,
                logprob_dtype=self.logprob_dtype,
                id_encoding=self.id_encoding,
                auth=self._auth,
                conversations=list(conversations[lo:hi]),
            )
            for lo, hi in chunks
        ]
        try:
            batches = self._run(requests, P.TopKBatch)
        except TeacherRequestError as err:
            if err.code == P.ErrorCode.RENDER:
                raise TeacherMismatchError(str(err)) from None
            raise
        return [part for batch in batches for part in batch.split()]

    def stats(self) -> P.StatsReply:
        """Queue depth, requests and tokens per second of every replica."""
        request = [P.encode(P.StatsRequest(P.PROTOCOL_VERSION, 0, self._auth))]
        return self._run([request], P.StatsReply)[0]

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def __enter__(self) -> TeacherClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ handshake

    def _check_handshake(self, reply: P.HelloReply) -> None:
        if reply.version != P.PROTOCOL_VERSION:
            raise TeacherMismatchError(
                f"server speaks protocol {reply.version}, this client {P.PROTOCOL_VERSION}: update both"
            )
        if self.expect_vocab_size is not None and reply.vocab_size != self.expect_vocab_size:
            raise TeacherMismatchError(
                f"the teacher's vocabulary has {reply.vocab_size} entries, the student's {self.expect_vocab_size}: "
                "teacher.model_path and model.student_path must share one vocabulary"
            )
        if self.expect_tokenizer_hash is not None and reply.tokenizer_hash != self.expect_tokenizer_hash:
            raise TeacherMismatchError(
                f"the teacher's tokenizer (hash {reply.tokenizer_hash[:12] or 'none'}) differs from the student's "
                f"({self.expect_tokenizer_hash[:12]}): set algorithm.cross_tokenizer=span (or uld) to distill across "
                "tokenizers, or use one tokenizer for teacher.model_path and model.tokenizer_path (or model.student_path)"
            )
        if self.top_k > reply.max_top_k:
            # max_top_k 0 with hidden states: a vllm server started with teacher.output=hidden (a pooling engine).
            hidden_only = (
                " (it serves teacher.output=hidden only)" if reply.max_top_k == 0 and reply.hidden_size else ""
            )
            raise TeacherMismatchError(
                f"teacher.top_k={self.top_k} exceeds the server's max_top_k={reply.max_top_k}{hidden_only}"
            )
        if self.temperature != 1.0 and not reply.supports_temperature:
            raise TeacherMismatchError(
                f"the {reply.backend} backend scores at temperature 1 only: set teacher.temperature=1 "
                f"(got {self.temperature}) or teacher.backend=hf"
            )
        if self.hidden_dtype and not reply.hidden_size:
            raise TeacherMismatchError(
                f"teacher.output=hidden, but the {reply.backend} teacher server returns no hidden states (the hf "
                "backend does, and the vllm backend when the server is started with teacher.output=hidden, for a model "
                "whose output head is a plain matmul): set teacher.output=topk"
            )
        for name, value, offered in (
            ("teacher.client.logprob_dtype", self.logprob_dtype, reply.logprob_dtypes),
            ("teacher.client.id_encoding", self.id_encoding, reply.id_encodings),
        ):
            if value not in offered:
                raise TeacherMismatchError(f"{name}={value!r} is not offered by the server ({offered})")

    @staticmethod
    def _check_named(server: P.HelloReply, named_ids: Sequence[np.ndarray] | None, n_seq: int) -> int:
        """named_k of this call (0 without named ids), checked against the server's handshake."""
        if named_ids is None:
            return 0
        if len(named_ids) != n_seq:
            raise ValueError(f"{len(named_ids)} named-id arrays for {n_seq} sequences")
        named_k = int(np.asarray(named_ids[0]).shape[-1])
        if named_k > server.max_named_ids:
            raise TeacherMismatchError(
                f"rollout.student_top_k={named_k} ids per position, but the {server.backend} teacher server scores "
                f"at most {server.max_named_ids} named ids (0: a server without the feature, or a backend that "
                "cannot; a vllm backend needs vLLM's V2 model runner, see teacher_server/server/backends/vllm.py): lower "
                "rollout.student_top_k, or set algorithm.support=teacher_topk"
            )
        return named_k

    # ------------------------------------------------------------------ requests

    def _chunk_frames(
        self,
        arrays: list[np.ndarray],
        score_from: Sequence[int],
        lo: int,
        hi: int,
        top_k: int,
        temperature: float,
        replica: str,
        named_ids: Sequence[np.ndarray] | None,
    ) -> list[bytes]:
        return request_frames(
            0,  # the real request id is set at each send
            arrays[lo:hi],
            score_from[lo:hi],
            top_k=top_k,
            temperature=temperature,
            logprob_dtype=self.logprob_dtype,
            id_encoding=self.id_encoding,
            replica=replica,
            auth=self._auth,
            named_ids=None if named_ids is None else named_ids[lo:hi],
            hidden_dtype=self.hidden_dtype,
        )

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def _fresh_socket(self) -> zmq.Socket:
        self.close()
        return self._socket()

    def _run(self, requests: list[list[bytes]], expect: type) -> list[Any]:
        """Send every request (at most max_inflight at once) and return the replies in order."""
        state = _Round(queue=list(range(len(requests))))
        now = time.monotonic()
        last_heard = now
        # Ping often enough that a live server is heard well within timeout_s.
        ping_interval = min(PING_INTERVAL_S, self.timeout_s / 4)
        next_ping = now + ping_interval
        while state.queue or state.pending:
            self._send_queued(state, requests)
            self._resend_due(state)
            sock = self._socket()
            if sock.poll(self._poll_ms(state), zmq.POLLIN):
                while sock.poll(0, zmq.POLLIN):
                    self._on_reply(state, sock.recv_multipart(copy=False), expect)
                    last_heard = time.monotonic()
            now = time.monotonic()
            if now - last_heard > self.timeout_s:
                raise TeacherDeadError(
                    f"no teacher server answered at teacher.address={self.address} for {now - last_heard:.1f} s "
                    f"(teacher.timeout_s={self.timeout_s}); start it with launch/start_teacher.sh or fix teacher.address"
                )
            if now >= next_ping and state.pending:
                self._send(sock, [P.encode(P.Ping(P.PROTOCOL_VERSION, 0, self._auth))])
                next_ping = now + ping_interval
            self._expire(state, now)
        return [state.results[i] for i in range(len(requests))]

    def _poll_ms(self, state: _Round) -> int:
        """Wait for replies until the next scheduled resend, at most a quarter ping interval."""
        wait_s = min(PING_INTERVAL_S, self.timeout_s) / 4
        resends = [p.resend_at for p in state.pending.values() if p.resend_at]
        if resends:
            wait_s = min(wait_s, max(0.0, min(resends) - time.monotonic()))
        return int(wait_s * 1000)

    def _send(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        # A DEALER queues while disconnected; NOBLOCK only fails when its HWM is full.
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise TeacherDeadError(
                f"the send queue to teacher.address={self.address} is full: the server is not reading"
            ) from None

    def _send_queued(self, state: _Round, requests: list[list[bytes]]) -> None:
        now = time.monotonic()
        while state.queue and len(state.pending) < self.max_inflight:
            chunk = state.queue.pop(0)
            pending = _Pending(chunk, requests[chunk], first_sent=now, sent=now)
            self._transmit(state, pending)

    def _transmit(self, state: _Round, pending: _Pending, *, new_attempt: bool = True) -> None:
        """Send `pending` under a new request id (a late reply to an old id is ignored).

        A resend after `busy` / `no_replicas` continues the current attempt's timeout_s clock.
        """
        request_id = next(self._ids)
        header = P.decode_client_message(pending.frames[0])
        frames = [P.encode(msgspec.structs.replace(header, request_id=request_id)), *pending.frames[1:]]
        if new_attempt:
            pending.sent = time.monotonic()
        pending.resend_at = 0.0
        state.pending[request_id] = pending
        self._send(self._socket(), frames)

    def _resend_due(self, state: _Round) -> None:
        now = time.monotonic()
        for request_id, pending in list(state.pending.items()):
            if pending.resend_at and now >= pending.resend_at:
                del state.pending[request_id]
                self._transmit(state, pending, new_attempt=pending.resend_new_attempt)

    def _on_reply(self, state: _Round, frames: list[zmq.Frame], expect: type) -> None:
        try:
            reply = P.decode_server_reply(frames[0].buffer)
        except P.ProtocolError as err:
            raise TeacherRequestError(err.code, f"undecodable reply from the server: {err.message}") from None
        if isinstance(reply, P.Pong):
            self._on_pong(state, reply)
            return
        pending = state.pending.get(reply.request_id)
        if pending is None:
            return  # a late reply to a request already resent under another id
        if isinstance(reply, P.ErrorReply):
            self._on_error(state, reply, pending)
            return
        del state.pending[reply.request_id]
        if isinstance(reply, P.ScoreReply):
            try:
                state.results[pending.chunk] = parse_score_reply(reply, [f.buffer for f in frames[1:]])
            except P.ProtocolError as err:
                raise TeacherRequestError(err.code, err.message) from None
        elif isinstance(reply, expect):
            state.results[pending.chunk] = reply
        else:
            raise TeacherRequestError(P.ErrorCode.UNEXPECTED, f"expected {expect.__name__}, got {type(reply).__name__}")

    def _on_pong(self, state: _Round, pong: P.Pong) -> None:
        """A restarted server forgot our requests: resend them all at once."""
        if self.server is not None and pong.server_id != self.server.server_id:
            self.server = msgspec.structs.replace(self.server, server_id=pong.server_id)
            for request_id, pending in list(state.pending.items()):
                del state.pending[request_id]
                self._transmit(state, pending)

    def _on_error(self, state: _Round, reply: P.ErrorReply, pending: _Pending) -> None:
        pending.last_error = f"{reply.code}: {reply.message}"
        if not reply.retryable:
            raise TeacherRequestError(reply.code, reply.message)
        if reply.code == P.ErrorCode.REPLICA_LOST:
            pending.attempts += 1
            self._check_attempts(pending)
            pending.resend_at, pending.resend_new_attempt = time.monotonic(), True
        else:
            # busy / no_replicas: back off; the attempt's clock (timeout_s) keeps running.
            step = min(len(BACKOFF_S) - 1, int(time.monotonic() - pending.sent))
            pending.resend_at, pending.resend_new_attempt = time.monotonic() + BACKOFF_S[step], False

    def _expire(self, state: _Round, now: float) -> None:
        expired = [p for p in state.pending.values() if now - p.sent > self.timeout_s]
        if not expired:
            return
        for pending in expired:
            pending.attempts += 1
            self._check_attempts(pending)
        # Start over on a fresh socket: whatever the old one had queued is discarded.
        self._fresh_socket()
        for request_id, pending in list(state.pending.items()):
            del state.pending[request_id]
            self._transmit(state, pending)

    def _check_attempts(self, pending: _Pending) -> None:
        if pending.attempts > self.retries:
            waited = time.monotonic() - pending.first_sent
            raise TeacherTimeoutError(
                f"a teacher request got no result after {pending.attempts} attempts in {waited:.1f} s "
                f"(teacher.timeout_s={self.timeout_s} per attempt, teacher.client.retries={self.retries}); "
                f"last error: {pending.last_error or 'no reply'}. The server at teacher.address={self.address} "
                "answers: raise teacher.timeout_s, add replicas, or send smaller batches"
            )


def split_balanced(lengths: Sequence[int], n_chunks: int, max_tokens: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) ranges of about equal token counts.

    At least n_chunks ranges when there are that many sequences, and none above max_tokens
    unless a single sequence is longer.
    """
    total = int(sum(lengths))
    n = max(1, min(len(lengths), max(n_chunks, -(-total // max_tokens))))
    target = total / n
    bounds: list[tuple[int, int]] = []
    lo, acc, before = 0, 0, 0
    for i, length in enumerate(lengths):
        # Cut before sequence i when its middle lies past the next chunk boundary.
        share_done = before + length / 2 > target * (len(bounds) + 1) and len(bounds) < n - 1
        if i > lo and (acc + length > max_tokens or share_done):
            bounds.append((lo, i))
            lo, acc = i, 0
        acc += length
        before += length
    bounds.append((lo, len(lengths)))
    return bounds
