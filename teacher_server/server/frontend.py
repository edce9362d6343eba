"""The frontend: a ROUTER for clients, a ROUTER for replicas, and least-loaded dispatch between them.

One thread owns both sockets and never computes: it validates each request (so replicas
only see good ones), sends it to the replica with the fewest outstanding tokens, and
forwards the replica's reply frames to the client unchanged (zero-copy) under the client's
own request id. Per-replica queues are bounded by teacher.queue_depth: when every replica's
is full the client gets a retryable `busy` instead of the server growing memory. Replicas
register and heartbeat with `Register`. A replica is dropped when its process exits (the
supervisor calls `replica_exited`), when its restart registers under the same name, or when it
stays silent for teacher.replica_timeout_s; its requests in flight are then sent again at once
to a live replica, or held until one registers (the restarted one) for at most
teacher.replica_timeout_s, after which they are answered `replica_lost` and the client retries.
Each request is answered once: a re-sent request gets a new internal id, so a late answer
from the dropped replica is discarded. A replica from any node may join at any time by
connecting to the replica address.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from teacher_server.wire import protocol as P
from teacher_server.wire.score_frames import RequestLimits, parse_score_request

log = logging.getLogger("teacher_server.frontend")

POLL_MS = 50
# Messages handled per socket per loop turn, so one busy side cannot starve the other.
MAX_DRAIN = 256
# Frames in one client message: header + ids; anything longer is malformed.
MAX_CLIENT_FRAMES = 8
# libzmq drops (without a reply) client frames above this multiple of teacher.max_request_mb;
# frames between 1x and this get a `too_large` reply.
HARD_FRAME_LIMIT_FACTOR = 4
# Window of the per-replica rates in stats replies.
STATS_WINDOW_S = 10.0


@dataclass(frozen=True)
class FrontendOptions:
    address: str
    replica_address: str
    secret: bytes = b""
    max_request_bytes: int = 64 << 20
    queue_depth: int = 8
    replica_timeout_s: float = 30.0


@dataclass
class _Replica:
    identity: bytes
    info: P.Register
    last_seen: float
    outstanding: int = 0
    outstanding_tokens: int = 0
    requests: int = 0
    tokens: int = 0
    errors: int = 0
    history: deque[tuple[float, int]] = field(default_factory=deque)

    def rates(self, now: float) -> tuple[float, float]:
        while self.history and now - self.history[0][0] > STATS_WINDOW_S:
            self.history.popleft()
        return len(self.history) / STATS_WINDOW_S, sum(n for _, n in self.history) / STATS_WINDOW_S


@dataclass(frozen=True)
class _Inflight:
    client: bytes
    client_request_id: int
    replica: bytes
    tokens: int
    # What the replica was sent (header without the internal id, array frames): re-sent if it is lost.
    request: P.ScoreRequest
    arrays: tuple[zmq.Frame, ...]


@dataclass(frozen=True)
class _Held:
    """A request whose replica was lost while no other could take it; re-sent when one registers."""

    inflight: _Inflight
    deadline: float


class Frontend:
    """Binds both endpoints at construction; `serve(stop)` runs the loop in the calling thread."""

    def __init__(self, options: FrontendOptions, context: zmq.Context | None = None) -> None:
        self.options = options
        self.server_id = uuid.uuid4().hex[:12]
        self._ctx = context or zmq.Context.instance()
        self._clients = self._bind(options.address, options.max_request_bytes * HARD_FRAME_LIMIT_FACTOR)
        self._replicas_sock = self._bind(options.replica_address, -1)
        self.address = self._clients.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replica_address = self._replicas_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._token = P.auth_token(options.secret)
        self._replicas: dict[bytes, _Replica] = {}
        self._inflight: dict[int, _Inflight] = {}
        self._held: deque[_Held] = deque()
        self._exited: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._model: P.Register | None = None
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._counts = {"requests": 0, "busy": 0, "errors": 0}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _bind(self, address: str, max_msg_size: int) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Replies to a vanished peer raise instead of disappearing silently (we count them).
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
        sock.bind(address.replace(":0", ":*") if address.endswith(":0") else address)
        return sock

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> threading.Thread:
        """Run `serve` in a daemon thread; the supervisor watches `alive()`."""
        self._thread = threading.Thread(target=self.serve, name="teacher-frontend", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._clients.close(linger=0)
        self._replicas_sock.close(linger=0)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def replica_names(self) -> list[str]:
        """Names of the live replicas (thread-safe)."""
        with self._lock:
            return [r.info.name for r in self._replicas.values()]

    def replica_exited(self, name: str) -> None:
        """Thread-safe: replica `name`'s process is gone; its requests in flight are re-sent at once."""
        self._exited.put(name)

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._clients, zmq.POLLIN)
        poller.register(self._replicas_sock, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(POLL_MS))
            if self._replicas_sock in events:
                self._drain(self._replicas_sock, self._on_replica_message)
            if self._clients in events:
                self._drain(self._clients, self._on_client_message)
            now = time.monotonic()
            self._drop_exited()
            self._expire_replicas(now)
            self._resend_held(now)

    def _drain(self, sock: zmq.Socket, handler: Callable[[list[zmq.Frame]], None]) -> None:
        for _ in range(MAX_DRAIN):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                handler(frames)
            except Exception:  # a bug hit by one message must not stop the server: logged and answered
                log.exception("internal error while handling a message from %s", frames[0].bytes.hex())
                if sock is self._clients:
                    self._reply_error(
                        frames[0].bytes, P.UNKNOWN_REQUEST_ID, P.ErrorCode.INTERNAL, "internal server error"
                    )

    def _send(self, sock: zmq.Socket, identity: bytes, frames: list) -> None:
        try:
            sock.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as err:
            # The peer is gone or not reading (HWM): its reply is dropped, the server goes on.
            log.warning("dropped a reply to %s: %s", identity.hex(), err)

    # ------------------------------------------------------------------ clients

    def _on_client_message(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        request_id = P.UNKNOWN_REQUEST_ID
        try:
            if len(frames) < 2 or len(frames) > 1 + MAX_CLIENT_FRAMES:
                raise P.ProtocolError(
                    P.ErrorCode.MALFORMED, f"expected a header and at most {MAX_CLIENT_FRAMES - 1} array frames"
                )
            size = sum(len(f.buffer) for f in frames[1:])
            if size > self.options.max_request_bytes:
                raise P.ProtocolError(
                    P.ErrorCode.TOO_LARGE,
                    f"request of {size} bytes exceeds teacher.max_request_mb ({self.options.max_request_bytes} bytes)",
                )
            message = P.decode_client_message(frames[1].buffer)
            request_id = getattr(message, "request_id", P.UNKNOWN_REQUEST_ID)
            if message.version != P.PROTOCOL_VERSION:
                raise P.ProtocolError(
                    P.ErrorCode.VERSION, f"protocol version {message.version}, server speaks {P.PROTOCOL_VERSION}"
                )
            P.check_auth(message.auth, self._token)
            self._handle_client(identity, message, frames[2:])
        except P.ProtocolError as err:
            self._reply_error(identity, request_id, err.code, err.message)

    def _handle_client(self, identity: bytes, message: P.ClientMessage, arrays: list[zmq.Frame]) -> None:
        if arrays and not isinstance(message, P.ScoreRequest):
            raise P.ProtocolError(P.ErrorCode.MALFORMED, f"a {type(message).__name__} carries no array frames")
        if isinstance(message, P.Ping):
            self._send(self._clients, identity, [P.encode(P.Pong(message.request_id, self.server_id))])
        elif isinstance(message, P.StatsRequest):
            self._send(self._clients, identity, [P.encode(self._stats(message.request_id))])
        elif isinstance(message, P.Hello):
            self._send(self._clients, identity, [P.encode(self._hello(message.request_id))])
        else:
            self._dispatch(identity, message, arrays)

    def _reply_error(self, identity: bytes, request_id: int, code: str, message: str) -> None:
        self._counts["busy" if code == P.ErrorCode.BUSY else "errors"] += 1
        self._send(self._clients, identity, [P.error_reply(request_id, code, message)])

    def _limits(self) -> RequestLimits:
        model = self._require_model()
        return RequestLimits(
            model.vocab_size,
            model.max_top_k,
            self.options.max_request_bytes,
            model.supports_temperature,
            model.max_named_ids,
            model.hidden_size,
        )

    def _require_model(self) -> P.Register:
        if self._model is None or not self._replicas:
            raise P.ProtocolError(P.ErrorCode.NO_REPLICAS, "no teacher replica has registered yet")
        return self._model

    def _hello(self, request_id: int) -> P.HelloReply:
        model = self._require_model()
        return P.HelloReply(
            request_id=request_id,
            version=P.PROTOCOL_VERSION,
            server_id=self.server_id,
            model_id=model.model_id,
            vocab_size=model.vocab_size,
            tokenizer_hash=model.tokenizer_hash,
            max_top_k=model.max_top_k,
            logprob_dtypes=sorted(P.LOGPROB_DTYPES),
            id_encodings=list(P.ID_ENCODINGS),
            max_request_bytes=self.options.max_request_bytes,
            replicas=len(self._replicas),
            backend=model.backend,
            supports_temperature=model.supports_temperature,
            max_named_ids=model.max_named_ids,
            hidden_size=model.hidden_size,
            text_requests=True,
        )

    def _dispatch(self, identity: bytes, request: P.ScoreRequest, arrays: list[zmq.Frame]) -> None:
        parsed = parse_score_request(request, [f.buffer for f in arrays], self._limits())
        replica = self._pick(request.replica)
        self._counts["requests"] += 1
        stripped = msgspec.structs.replace(request, auth=b"")
        inflight = _Inflight(identity, request.request_id, replica.identity, parsed.n_tokens, stripped, tuple(arrays))
        self._send_to(replica, inflight)

    def _send_to(self, replica: _Replica, inflight: _Inflight) -> None:
        """Forward a request to `replica` under a fresh internal id."""
        internal_id = next(self._ids)
        self._inflight[internal_id] = dataclasses.replace(inflight, replica=replica.identity)
        replica.outstanding += 1
        replica.outstanding_tokens += inflight.tokens
        forwarded = P.encode(msgspec.structs.replace(inflight.request, request_id=internal_id))
        self._send(self._replicas_sock, replica.identity, [forwarded, *inflight.arrays])

    def _pick(self, name: str) -> _Replica:
        candidates = [r for r in self._replicas.values() if not name or r.info.name == name]
        if not candidates:
            raise P.ProtocolError(P.ErrorCode.BAD_REQUEST, f"no replica named {name!r}")
        free = [r for r in candidates if r.outstanding < self.options.queue_depth]
        if not free:
            raise P.ProtocolError(
                P.ErrorCode.BUSY,
                f"all {len(candidates)} replicas have teacher.queue_depth={self.options.queue_depth} requests queued",
            )
        return min(free, key=lambda r: (r.outstanding_tokens, r.outstanding))

    def _stats(self, request_id: int) -> P.StatsReply:
        now = time.monotonic()
        replicas = []
        for r in self._replicas.values():
            rps, tps = r.rates(now)
            replicas.append(
                P.ReplicaStats(
                    r.info.name,
                    r.info.pid,
                    r.info.host,
                    r.info.gpu_ids,
                    r.outstanding,
                    r.requests,
                    r.tokens,
                    rps,
                    tps,
                    r.errors,
                )
            )
        return P.StatsReply(
            request_id,
            self.server_id,
            now - self._started,
            replicas,
            self._counts["requests"],
            self._counts["busy"],
            self._counts["errors"],
        )

    # ------------------------------------------------------------------ replicas

    def _on_replica_message(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        try:
            message = P.decode_replica_message(frames[1].buffer) if len(frames) >= 2 else None
        except P.ProtocolError as err:
            log.warning("undecodable message from replica %s: %s", identity.hex(), err.message)
            return
        if isinstance(message, P.Register):
            self._on_register(identity, message)
            return
        replica = self._replicas.get(identity)
        if replica is None or message is None:
            log.warning("message from an unregistered replica %s dropped", identity.hex())
            return
        replica.last_seen = time.monotonic()
        self._on_result(replica, message, frames[2:])

    def _on_register(self, identity: bytes, info: P.Register) -> None:
        known = self._replicas.get(identity)
        if known is not None:
            known.last_seen = time.monotonic()
            return
        problem = self._registration_problem(info)
        if problem:
            log.error("refused replica %s (pid %d on %s): %s", info.name, info.pid, info.host, problem)
            self._send(
                self._replicas_sock, identity, [P.error_reply(P.UNKNOWN_REQUEST_ID, P.ErrorCode.UNEXPECTED, problem)]
            )
            return
        if self._model is None:
            self._model = info
        for old in [r for r in self._replicas.values() if r.info.name == info.name]:
            self._drop(old, f"replaced by its restart (pid {info.pid})")
        with self._lock:
            self._replicas[identity] = _Replica(identity, info, time.monotonic())
        log.info("replica %s joined (pid %d on %s, GPUs %s)", info.name, info.pid, info.host, info.gpu_ids)
        self._send(self._replicas_sock, identity, [P.encode(P.RegisterAck(self.server_id))])
        self._resend_held(time.monotonic())

    def _registration_problem(self, info: P.Register) -> str:
        if info.version != P.PROTOCOL_VERSION:
            return f"protocol version {info.version}, frontend speaks {P.PROTOCOL_VERSION}"
        try:
            P.check_auth(info.auth, self._token)
        except P.ProtocolError as err:
            return err.message
        model = self._model
        if model is not None:
            mine = (model.model_id, model.vocab_size, model.tokenizer_hash, model.max_top_k, model.backend)
            theirs = (info.model_id, info.vocab_size, info.tokenizer_hash, info.max_top_k, info.backend)
            if mine != theirs:
                return f"serves (model, vocab, tokenizer, max_top_k, backend) {theirs}, this server {mine}"
        return ""

    def _on_result(self, replica: _Replica, message: P.ReplicaMessage, arrays: list[zmq.Frame]) -> None:
        inflight = self._inflight.pop(message.request_id, None)  # type: ignore[union-attr]
        if inflight is None:
            return  # a dropped replica's late answer: the request was re-sent or answered replica_lost
        replica.outstanding -= 1
        replica.outstanding_tokens -= inflight.tokens
        if isinstance(message, P.ScoreReply):
            replica.requests += 1
            replica.tokens += inflight.tokens
            replica.history.append((time.monotonic(), inflight.tokens))
        else:
            replica.errors += 1
            self._counts["errors"] += 1
        header = P.encode(msgspec.structs.replace(message, request_id=inflight.client_request_id))  # type: ignore[type-var]
        self._send(self._clients, inflight.client, [header, *arrays])

    def _expire_replicas(self, now: float) -> None:
        lost = [r for r in self._replicas.values() if now - r.last_seen > self.options.replica_timeout_s]
        for replica in lost:
            self._drop(replica, f"silent for {now - replica.last_seen:.1f} s (teacher.replica_timeout_s)")

    def _drop_exited(self) -> None:
        while True:
            try:
                name = self._exited.get_nowait()
            except queue.Empty:
                return
            for replica in [r for r in self._replicas.values() if r.info.name == name]:
                self._drop(replica, "its process exited")

    def _drop(self, replica: _Replica, why: str) -> None:
        """Forget `replica`; each of its requests in flight goes to a live replica now, or is held for one."""
        with self._lock:
            del self._replicas[replica.identity]
        lost = [i for i, f in self._inflight.items() if f.replica == replica.identity]
        log.warning(
            "replica %s (pid %d) dropped: %s; re-sending its %d requests",
            replica.info.name,
            replica.info.pid,
            why,
            len(lost),
        )
        deadline = time.monotonic() + self.options.replica_timeout_s
        for internal_id in lost:
            self._held.append(_Held(self._inflight.pop(internal_id), deadline))
        self._resend_held(time.monotonic())

    def _resend_held(self, now: float) -> None:
        """Held requests to live replicas with room; past their deadline, `replica_lost` (the client retries)."""
        for _ in range(len(self._held)):
            held = self._held.popleft()
            target = held.inflight.request.replica
            try:
                replica = self._pick(target)
            except P.ProtocolError:
                if now < held.deadline and not target:
                    self._held.append(held)  # no replica with room yet: wait for one
                    continue
                message = "the replica serving this request was lost and no other took it in time; retry"
                if target:
                    message = f"replica {target} was lost while serving this request; retry"
                self._reply_error(
                    held.inflight.client, held.inflight.client_request_id, P.ErrorCode.REPLICA_LOST, message
                )
                continue
            self._send_to(replica, held.inflight)
