"""The teacher wire protocol: typed msgpack headers plus raw array frames. No pickle anywhere.

Every ZeroMQ message is one msgspec-encoded header frame, then zero or more raw little-endian
array frames. Clients talk to the frontend's ROUTER through a DEALER; replicas talk to the
frontend's second ROUTER through their own DEALER.

    client -> frontend   Hello | ScoreRequest [+ ids int32 (+ named ids)] | StatsRequest | Ping
    frontend -> client   HelloReply | ScoreReply [+ 4 (or 6) array frames] | StatsReply | Pong | ErrorReply
    replica -> frontend  Register (also the heartbeat) | ScoreReply [+ frames] | ErrorReply
    frontend -> replica  RegisterAck | ScoreRequest [+ ids] (request_id rewritten) | ErrorReply

A score request carries ragged token ids (lengths), the first scored position of each
sequence (`score_from`, >= 1: position p is predicted from the logits at p-1), top_k and
temperature. Its reply carries, per scored position: top-k logprobs (float32 or float16 on
the wire, float32 after decoding), top-k ids (int32 or Elias-Fano coded, int32 after
decoding), the logprob of the token actually at that position, and the tail log-mass
log(sum of p outside the top-k). With top_k = 0 (the sampled-token objective) only the sampled
token's logprob travels: the top-k frames are empty and so is the tail frame (the tail is the
whole distribution, log 1 = 0), 4 bytes per scored token. An ErrorReply answers exactly one
request; the server never dies on a bad one.

Named ids (`named_k` > 0, protocol version 1, optional fields an older peer ignores or reads as 0):
the request adds an int32 frame of named_k ids per scored position (the student's own top-k),
the reply two float32 frames: the teacher's logprobs at those ids and the log of its mass outside
the top-k and the named ids together, from the same forward. The handshake's `max_named_ids`
says how many a server takes (0 for a server without the feature: the client refuses before sending).

Hidden states (`hidden_dtype` "bfloat16" or "float16", teacher.output=hidden, optional fields too):
the reply adds one frame, each scored position's final hidden state [N, hidden_size] in that dtype
(see hidden_codec). The handshake's `hidden_size` is 0 for a server that cannot send them.

Text (`conversations`, algorithm.cross_tokenizer, optional too): no id frame; the replica renders each
conversation in its own tokens (conversation.py) and the reply ends with two int32 frames, the token
at each scored position [N] and its byte range in the response text [N, 2] (`rendered`).
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from teacher_server.wire import hidden_codec, idcodec
from teacher_server.wire.conversation import Conversation, estimated_tokens
from teacher_server.wire.identity import AUTH_CONTEXT, auth_token, read_secret, tokenizer_fingerprint  # noqa: F401
from teacher_server.wire.scores import (  # noqa: F401 - re-exported: the wire's result types
    TeacherTopK,
    TopKBatch,
    canonical_order,
    other_from_union,
    scores_from_logprobs,
    tail_from_topk,
)

# 2: replicas name their GPUs as strings (indices or GPU-/MIG- UUIDs) in Register and ReplicaStats.
PROTOCOL_VERSION = 2
# Wire dtypes of the top-k logprobs; decoded values are always float32.
LOGPROB_DTYPES: dict[str, np.dtype] = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}
# "int32": raw little-endian ids; "elias_fano": see idcodec (about 1.1 bytes per id at K=256).
ID_ENCODINGS = ("int32", "elias_fano")
TOKEN_DTYPE = np.dtype("<i4")
FLOAT_DTYPE = np.dtype("<f4")
# A header larger than this is refused before decoding (lengths lists of ~100k sequences fit).
MAX_HEADER_BYTES = 1 << 20
# Request id of an error reply to a message whose request id could not be read.
UNKNOWN_REQUEST_ID = -1


class ErrorCode:
    """Codes of ErrorReply. Retryable ones (busy, no_replicas, replica_lost) are retried by the client."""

    MALFORMED = "malformed"
    VERSION = "version_mismatch"
    UNAUTHORIZED = "unauthorized"
    TOO_LARGE = "too_large"
    BAD_REQUEST = "bad_request"
    UNSUPPORTED = "unsupported"
    BUSY = "busy"
    NO_REPLICAS = "no_replicas"
    REPLICA_LOST = "replica_lost"
    BACKEND_ERROR = "backend_error"
    # The teacher cannot render a text request's conversation: the client refuses the run (exit 2).
    RENDER = "render_failed"
    UNEXPECTED = "unexpected_message"
    INTERNAL = "internal_error"


RETRYABLE_CODES = frozenset({ErrorCode.BUSY, ErrorCode.NO_REPLICAS, ErrorCode.REPLICA_LOST})


class ProtocolError(ValueError):
    """A message that breaks the protocol; becomes an ErrorReply with `code`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# ----------------------------------------------------------------------------- messages


class Hello(msgspec.Struct, tag="hello"):
    version: int
    request_id: int = 0
    auth: bytes = b""


class HelloReply(msgspec.Struct, tag="hello_reply"):
    request_id: int
    version: int
    # Random per frontend start: a client seeing it change knows its in-flight requests are gone.
    server_id: str
    model_id: str
    vocab_size: int
    tokenizer_hash: str
    max_top_k: int
    logprob_dtypes: list[str]
    id_encodings: list[str]
    max_request_bytes: int
    replicas: int
    backend: str
    # False for the vllm backend: its prompt logprobs ignore temperature (see backends/vllm.py).
    supports_temperature: bool
    # Most ids a request may name per scored position (0: the server scores no named ids; an
    # older server does not send the field and reads as 0).
    max_named_ids: int = 0
    # The width of the hidden states a reply can carry (0: this server sends none).
    hidden_size: int = 0
    # It scores conversations sent as text (algorithm.cross_tokenizer); an older server reads as False.
    text_requests: bool = False


class ScoreRequest(msgspec.Struct, tag="score"):
    version: int
    request_id: int
    lengths: list[int]
    score_from: list[int]
    top_k: int
    temperature: float
    logprob_dtype: str = "float32"
    id_encoding: str = "int32"
    # Pin to a named replica (readiness probes); empty = the least-loaded one.
    replica: str = ""
    auth: bytes = b""
    # Ids named per scored position (a second int32 frame [sum(length - score_from), named_k]).
    named_k: int = 0
    # "bfloat16" or "float16": the reply also carries the final hidden states ("": none).
    hidden_dtype: str = ""
    # Text to render and score instead of token ids (no id frame; lengths and score_from empty).
    conversations: list[Conversation] | None = None


class ScoreReply(msgspec.Struct, tag="score_reply"):
    request_id: int
    n_scored: list[int]
    top_k: int
    vocab_size: int
    logprob_dtype: str
    id_encoding: str
    replica: str = ""
    compute_s: float = 0.0
    # > 0: two more frames, the logprobs at the named ids and the mass outside top-k + named ids.
    named_k: int = 0
    # > 0: one more (last) frame, the hidden states [N, hidden_size] in hidden_dtype.
    hidden_size: int = 0
    hidden_dtype: str = ""
    # A text request's reply: two more (last) frames, the scored tokens [N] and their byte ranges [N, 2].
    rendered: bool = False


class ErrorReply(msgspec.Struct, tag="error"):
    request_id: int
    code: str
    message: str
    retryable: bool = False


class StatsRequest(msgspec.Struct, tag="stats"):
    version: int
    request_id: int
    auth: bytes = b""


class ReplicaStats(msgspec.Struct):
    name: str
    pid: int
    host: str
    gpu_ids: list[str]  # indices or UUIDs (GPU-..., MIG-...), as the replica's CUDA_VISIBLE_DEVICES has them
    # Requests sent to the replica and not answered yet (its queue depth).
    queue_depth: int
    requests: int
    tokens: int
    requests_per_s: float
    tokens_per_s: float
    errors: int


class StatsReply(msgspec.Struct, tag="stats_reply"):
    request_id: int
    server_id: str
    uptime_s: float
    replicas: list[ReplicaStats]
    requests: int
    busy_replies: int
    error_replies: int


class Ping(msgspec.Struct, tag="ping"):
    version: int
    request_id: int
    auth: bytes = b""


class Pong(msgspec.Struct, tag="pong"):
    request_id: int
    server_id: str


class Register(msgspec.Struct, tag="register"):
    """Sent by a replica when it is ready and then every heartbeat interval."""

    version: int
    name: str
    pid: int
    host: str
    gpu_ids: list[str]  # indices or UUIDs (GPU-..., MIG-...), as the replica's CUDA_VISIBLE_DEVICES has them
    model_id: str
    vocab_size: int
    tokenizer_hash: str
    max_top_k: int
    backend: str
    supports_temperature: bool
    auth: bytes = b""
    max_named_ids: int = 0
    hidden_size: int = 0


class RegisterAck(msgspec.Struct, tag="register_ack"):
    server_id: str


ClientMessage = Hello | ScoreRequest | StatsRequest | Ping
ServerReply = HelloReply | ScoreReply | StatsReply | Pong | ErrorReply
ReplicaMessage = Register | ScoreReply | ErrorReply
FrontendToReplica = RegisterAck | ScoreRequest | ErrorReply

_ENCODER = msgspec.msgpack.Encoder()
_CLIENT_DECODER = msgspec.msgpack.Decoder(ClientMessage)
_REPLY_DECODER = msgspec.msgpack.Decoder(ServerReply)
_REPLICA_DECODER = msgspec.msgpack.Decoder(ReplicaMessage)
_TO_REPLICA_DECODER = msgspec.msgpack.Decoder(FrontendToReplica)


def encode(message: msgspec.Struct) -> bytes:
    return _ENCODER.encode(message)


def _decode(decoder: msgspec.msgpack.Decoder, frame: bytes | memoryview, who: str) -> Any:
    if len(frame) > MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        return decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise ProtocolError(ErrorCode.MALFORMED, f"undecodable {who} header: {err}") from None


def decode_client_message(frame: bytes | memoryview) -> ClientMessage:
    return _decode(_CLIENT_DECODER, frame, "client")


def decode_server_reply(frame: bytes | memoryview) -> ServerReply:
    return _decode(_REPLY_DECODER, frame, "server")


def decode_replica_message(frame: bytes | memoryview) -> ReplicaMessage:
    return _decode(_REPLICA_DECODER, frame, "replica")


def decode_frontend_message(frame: bytes | memoryview) -> FrontendToReplica:
    return _decode(_TO_REPLICA_DECODER, frame, "frontend")


def error_reply(request_id: int, code: str, message: str) -> bytes:
    return encode(ErrorReply(request_id, code, message, retryable=code in RETRYABLE_CODES))


# ----------------------------------------------------------------------------- authentication


def check_auth(presented: bytes, expected: bytes) -> None:
    if expected and not hmac.compare_digest(presented, expected):
        raise ProtocolError(ErrorCode.UNAUTHORIZED, "missing or wrong shared secret (teacher.secret_file)")


# ----------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class RequestLimits:
    """What a server accepts; checked by the frontend before any replica sees a request."""

    vocab_size: int
    max_top_k: int
    max_request_bytes: int
    supports_temperature: bool = True
    max_named_ids: int = 0
    # The hidden states' width a reply can carry; 0: the backend sends none.
    hidden_size: int = 0


@dataclass(frozen=True)
class ParsedRequest:
    """A validated score request: flat ids plus per-sequence lengths and first scored positions."""

    ids: np.ndarray
    lengths: np.ndarray
    score_from: np.ndarray
    top_k: int
    temperature: float
    # [sum(lengths - score_from), named_k] int32: ids whose logprobs each scored position asks for.
    named_ids: np.ndarray | None = None
    # "bfloat16" / "float16": also return each scored position's final hidden state ("": none).
    hidden_dtype: str = ""
    # A text request: the replica renders these into ids, lengths and score_from (empty until then).
    conversations: list[Conversation] | None = None

    @property
    def n_tokens(self) -> int:
        if self.conversations:  # not rendered yet: estimated, for the frontend's least-loaded dispatch
            return estimated_tokens(self.conversations)
        return int(self.ids.size)

    def sequences(self) -> list[np.ndarray]:
        return np.split(self.ids, np.cumsum(self.lengths)[:-1])

    def named_per_sequence(self) -> list[np.ndarray | None]:
        """Each sequence's named ids [length - score_from, named_k] (None without named ids)."""
        if self.named_ids is None:
            return [None] * len(self.lengths)
        return np.split(self.named_ids, np.cumsum(self.lengths - self.score_from)[:-1])


def request_frames(
    request_id: int,
    sequences: Sequence[np.ndarray | Sequence[int]],
    score_from: Sequence[int],
    *,
    top_k: int,
    temperature: float,
    logprob_dtype: str = "float32",
    id_encoding: str = "int32",
    replica: str = "",
    auth: bytes = b"",
    named_ids: Sequence[np.ndarray] | None = None,
    hidden_dtype: str = "",
    conversations: list[Conversation] | None = None,
) -> list[bytes]:
    """The frames of a ScoreRequest: header, all token ids as one int32 frame, then the named ids.

    named_ids: per sequence [len - score_from, named_k] ids to score at each scored position.
    hidden_dtype: "bfloat16" / "float16" to get the final hidden states back too.
    conversations: text to score instead (`sequences` and `score_from` empty): header only.
    """
    arrays = [np.asarray(s, dtype=TOKEN_DTYPE).reshape(-1) for s in sequences]
    named_k = 0 if named_ids is None or not len(named_ids) else int(np.asarray(named_ids[0]).shape[-1])
    header = ScoreRequest(
        version=PROTOCOL_VERSION,
        request_id=request_id,
        lengths=[int(a.size) for a in arrays],
        score_from=[int(s) for s in score_from],
        top_k=int(top_k),
        temperature=float(temperature),
        logprob_dtype=logprob_dtype,
        id_encoding=id_encoding,
        replica=replica,
        auth=auth,
        named_k=named_k,
        hidden_dtype=hidden_dtype,
        conversations=conversations,
    )
    if conversations:
        return [encode(header)]
    ids = np.concatenate(arrays) if arrays else np.zeros(0, TOKEN_DTYPE)
    if not named_k:
        return [encode(header), ids.tobytes()]
    named = np.concatenate([np.asarray(n, dtype=TOKEN_DTYPE).reshape(-1, named_k) for n in named_ids or []])
    return [encode(header), ids.tobytes(), named.tobytes()]


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


def parse_score_request(
    req: ScoreRequest, frames: Sequence[bytes | memoryview], limits: RequestLimits
) -> ParsedRequest:
    """Validate a ScoreRequest and its array frame against `limits`. Raises ProtocolError."""
    if req.version != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.VERSION, f"protocol version {req.version}, server speaks {PROTOCOL_VERSION}")
    if req.conversations:  # text: nothing to check against the vocabulary before the replica renders it
        _check_scalars(req, limits)
        if frames or req.lengths or req.named_k or req.hidden_dtype:
            raise _bad("a text request carries conversations only (no ids, named ids or hidden states)")
        empty = np.zeros(0, np.int64)
        return ParsedRequest(
            empty.astype(TOKEN_DTYPE), empty, empty, req.top_k, req.temperature, None, "", req.conversations
        )
    expected_frames = 2 if req.named_k else 1
    if len(frames) != expected_frames:
        raise _bad(
            f"a score request with named_k={req.named_k} has {expected_frames} array frame(s) (token ids"
            f"{', named ids' if req.named_k else ''}), got {len(frames)}"
        )
    _check_scalars(req, limits)
    n_seq = len(req.lengths)
    if n_seq == 0:
        raise _bad("no sequences")
    if len(req.score_from) != n_seq:
        raise _bad(f"{len(req.score_from)} score_from values for {n_seq} sequences")
    lengths = np.asarray(req.lengths, dtype=np.int64)
    score_from = np.asarray(req.score_from, dtype=np.int64)
    if lengths.min() < 1:
        raise _bad("empty sequence (every length must be >= 1)")
    if score_from.min() < 1 or np.any(score_from > lengths):
        raise _bad("score_from must satisfy 1 <= score_from <= length (position p is predicted from p-1)")
    ids_frame = frames[0]
    if len(ids_frame) != TOKEN_DTYPE.itemsize * int(lengths.sum()):
        raise _bad(f"token frame has {len(ids_frame)} bytes, lengths say {int(lengths.sum())} int32 ids")
    ids = np.frombuffer(ids_frame, dtype=TOKEN_DTYPE)
    if ids.min() < 0 or ids.max() >= limits.vocab_size:
        raise _bad(f"token ids must lie in [0, {limits.vocab_size}); got [{ids.min()}, {ids.max()}]")
    named = _parse_named_ids(req.named_k, frames[1], int((lengths - score_from).sum()), limits) if req.named_k else None
    return ParsedRequest(ids, lengths, score_from, req.top_k, req.temperature, named, req.hidden_dtype)


def _parse_named_ids(named_k: int, frame: bytes | memoryview, n_scored: int, limits: RequestLimits) -> np.ndarray:
    """The named-id frame as [n_scored, named_k] int32, each id in [0, vocab_size)."""
    if len(frame) != TOKEN_DTYPE.itemsize * n_scored * named_k:
        raise _bad(
            f"named-id frame has {len(frame)} bytes, the request scores {n_scored} positions x named_k={named_k} "
            "int32 ids"
        )
    named = np.frombuffer(frame, dtype=TOKEN_DTYPE).reshape(n_scored, named_k)
    if named.size and (named.min() < 0 or named.max() >= limits.vocab_size):
        raise _bad(f"named ids must lie in [0, {limits.vocab_size}); got [{named.min()}, {named.max()}]")
    return named


def _check_scalars(req: ScoreRequest, limits: RequestLimits) -> None:
    if not 0 <= req.top_k <= min(limits.max_top_k, limits.vocab_size):
        raise _bad(
            f"top_k={req.top_k} outside [0, {min(limits.max_top_k, limits.vocab_size)}] (the server's max_top_k; "
            "0: the sampled token's logprob only)"
        )
    if not (math.isfinite(req.temperature) and req.temperature > 0):
        raise _bad(f"temperature must be finite and > 0, got {req.temperature}")
    if req.temperature != 1.0 and not limits.supports_temperature:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED,
            f"this backend scores at temperature 1 only (got {req.temperature}); set teacher.temperature=1 or teacher.backend=hf",
        )
    if not 0 <= req.named_k <= limits.max_named_ids:
        raise _bad(
            f"named_k={req.named_k} outside [0, {limits.max_named_ids}] (the ids this server scores per position; "
            "rollout.student_top_k)"
        )
    if req.hidden_dtype and req.hidden_dtype not in hidden_codec.HIDDEN_DTYPES:
        raise _bad(f"hidden_dtype {req.hidden_dtype!r} not in {list(hidden_codec.HIDDEN_DTYPES)}")
    if req.hidden_dtype and not limits.hidden_size:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED,
            "this teacher server returns no hidden states (teacher.output=hidden: the hf backend, or the vllm backend "
            "started with teacher.output=hidden)",
        )
    if req.logprob_dtype not in LOGPROB_DTYPES:
        raise _bad(f"logprob_dtype {req.logprob_dtype!r} not in {sorted(LOGPROB_DTYPES)}")
    if req.id_encoding not in ID_ENCODINGS:
        raise _bad(f"id_encoding {req.id_encoding!r} not in {list(ID_ENCODINGS)}")


# ----------------------------------------------------------------------------- replies


def reply_frames(
    request_id: int,
    batch: TopKBatch,
    *,
    vocab_size: int,
    logprob_dtype: str,
    id_encoding: str,
    replica: str = "",
    compute_s: float = 0.0,
    hidden_dtype: str = "",
) -> list[bytes]:
    """The frames of a ScoreReply: header, top-k logprobs, top-k ids, sampled logprob, tail log-mass.

    With top_k = 0 the tail frame is empty: outside an empty top-k is all the mass (log 1 = 0).
    With named ids, two float32 frames follow: their logprobs [N, named_k] and the log-mass outside
    the top-k and the named ids [N]. With hidden states, a last frame [N, H] in `hidden_dtype`.
    """
    top_k = int(batch.topk_ids.shape[1])
    logprobs = batch.topk_logprobs
    ids = batch.topk_ids
    if id_encoding == "elias_fano":
        # Elias-Fano stores each row's ids ascending, so send the logprobs in that order too.
        order_NK = np.argsort(ids, axis=1)
        logprobs = np.take_along_axis(logprobs, order_NK, axis=1)
        ids_bytes = idcodec.encode(ids, vocab_size)
    else:
        ids_bytes = np.ascontiguousarray(ids, dtype=TOKEN_DTYPE).tobytes()
    header = ScoreReply(
        request_id=request_id,
        n_scored=[int(n) for n in batch.n_scored],
        top_k=top_k,
        vocab_size=vocab_size,
        logprob_dtype=logprob_dtype,
        id_encoding=id_encoding,
        replica=replica,
        compute_s=compute_s,
        named_k=0 if batch.named_logprobs is None else int(batch.named_logprobs.shape[1]),
        hidden_size=0 if batch.hidden_states is None else int(batch.hidden_states.shape[1]),
        hidden_dtype=hidden_dtype if batch.hidden_states is not None else "",
        rendered=batch.token_ids is not None,
    )
    frames = [
        encode(header),
        np.ascontiguousarray(logprobs, dtype=LOGPROB_DTYPES[logprob_dtype]).tobytes(),
        ids_bytes,
        np.ascontiguousarray(batch.sampled_logprob, dtype=FLOAT_DTYPE).tobytes(),
        np.ascontiguousarray(batch.tail_logmass, dtype=FLOAT_DTYPE).tobytes() if top_k else b"",
    ]
    if batch.named_logprobs is not None and batch.other_logmass is not None:
        frames.append(np.ascontiguousarray(batch.named_logprobs, dtype=FLOAT_DTYPE).tobytes())
        frames.append(np.ascontiguousarray(batch.other_logmass, dtype=FLOAT_DTYPE).tobytes())
    if batch.hidden_states is not None:
        frames.append(hidden_codec.encode(batch.hidden_states, hidden_dtype))
    if batch.token_ids is not None and batch.byte_offsets is not None:
        frames += [np.ascontiguousarray(a, dtype=TOKEN_DTYPE).tobytes() for a in (batch.token_ids, batch.byte_offsets)]
    return frames


def parse_score_reply(header: ScoreReply, frames: Sequence[bytes | memoryview]) -> TopKBatch:
    """Decode a ScoreReply's frames into float32/int32 arrays in canonical order. Raises ProtocolError."""
    expected_frames = 4 + (2 if header.named_k else 0) + (1 if header.hidden_size else 0) + 2 * header.rendered
    if len(frames) != expected_frames:
        raise ProtocolError(
            ErrorCode.MALFORMED,
            f"a score reply with named_k={header.named_k}, hidden_size={header.hidden_size} has {expected_frames} "
            f"array frames, got {len(frames)}",
        )
    if header.logprob_dtype not in LOGPROB_DTYPES or header.id_encoding not in ID_ENCODINGS:
        raise ProtocolError(ErrorCode.MALFORMED, f"unknown reply encoding {header.logprob_dtype}/{header.id_encoding}")
    n_scored = np.asarray(header.n_scored, dtype=np.int64)
    n_rows, top_k = int(n_scored.sum()), header.top_k
    try:
        logprobs = np.frombuffer(frames[0], dtype=LOGPROB_DTYPES[header.logprob_dtype]).reshape(n_rows, top_k)
        if header.id_encoding == "elias_fano":
            ids = idcodec.decode(frames[1], n_rows, top_k, header.vocab_size)
        else:
            ids = np.frombuffer(frames[1], dtype=TOKEN_DTYPE).reshape(n_rows, top_k)
        sampled = np.frombuffer(frames[2], dtype=FLOAT_DTYPE).reshape(n_rows)
        # top_k = 0: no tail on the wire, it is log 1 = 0 on every row.
        tail = np.frombuffer(frames[3], dtype=FLOAT_DTYPE).reshape(n_rows) if top_k else np.zeros(n_rows, FLOAT_DTYPE)
        named = other = None
        if header.named_k:
            named = np.frombuffer(frames[4], dtype=FLOAT_DTYPE).reshape(n_rows, header.named_k).copy()
            other = np.frombuffer(frames[5], dtype=FLOAT_DTYPE).reshape(n_rows).copy()
        hidden = token_ids = offsets = None
        if header.hidden_size:
            hidden = hidden_codec.decode(frames[4 + 2 * bool(header.named_k)], header.hidden_dtype, header.hidden_size)
            hidden = hidden.reshape(n_rows, header.hidden_size)
        if header.rendered:
            token_ids = np.frombuffer(frames[-2], dtype=TOKEN_DTYPE).reshape(n_rows).astype(np.int32)
            offsets = np.frombuffer(frames[-1], dtype=TOKEN_DTYPE).reshape(n_rows, 2).astype(np.int32)
    except ValueError as err:
        raise ProtocolError(ErrorCode.MALFORMED, f"score reply arrays do not match its header: {err}") from None
    logprobs = logprobs.astype(np.float32)
    ids = ids.astype(np.int32)
    if header.id_encoding == "elias_fano" or header.logprob_dtype != "float32":
        # Elias-Fano sends rows by id; float16 rounding can create ties: restore the one order.
        logprobs, ids = canonical_order(logprobs, ids)
    return TopKBatch(
        n_scored,
        logprobs,
        ids,
        sampled.astype(np.float32),
        tail.astype(np.float32),
        named,
        other,
        hidden,
        token_ids,
        offsets,
    )
