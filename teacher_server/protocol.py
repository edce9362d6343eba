"""The teacher wire protocol: typed msgpack headers plus raw array frames. No pickle anywhere.

Every ZeroMQ message is one msgspec-encoded header frame, then zero or more raw little-endian
array frames. Clients talk to the frontend's ROUTER through a DEALER; replicas talk to the
frontend's second ROUTER through their own DEALER.

    client -> frontend   Hello | ScoreRequest [+ ids int32] | StatsRequest | Ping
    frontend -> client   HelloReply | ScoreReply [+ 4 array frames] | StatsReply | Pong | ErrorReply
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
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from teacher_server import idcodec

PROTOCOL_VERSION = 1
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
# The static message every authenticated header carries an HMAC of (see auth_token).
AUTH_CONTEXT = b"recipe_gkd teacher_server v1"


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


class ScoreReply(msgspec.Struct, tag="score_reply"):
    request_id: int
    n_scored: list[int]
    top_k: int
    vocab_size: int
    logprob_dtype: str
    id_encoding: str
    replica: str = ""
    compute_s: float = 0.0


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
    gpu_ids: list[int]
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
    gpu_ids: list[int]
    model_id: str
    vocab_size: int
    tokenizer_hash: str
    max_top_k: int
    backend: str
    supports_temperature: bool
    auth: bytes = b""


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


def auth_token(secret: bytes) -> bytes:
    """What a client presents in every header: HMAC-SHA256(secret, AUTH_CONTEXT); b"" without a secret.

    It keeps out anyone without the secret file; it does not encrypt (use a private network).
    """
    return hmac.new(secret, AUTH_CONTEXT, hashlib.sha256).digest() if secret else b""


def check_auth(presented: bytes, expected: bytes) -> None:
    if expected and not hmac.compare_digest(presented, expected):
        raise ProtocolError(ErrorCode.UNAUTHORIZED, "missing or wrong shared secret (teacher.secret_file)")


def read_secret(path: str) -> bytes:
    """The shared secret from teacher.secret_file (surrounding whitespace stripped); b"" when unset."""
    if not path:
        return b""
    with open(path, "rb") as f:
        secret = f.read().strip()
    if not secret:
        raise ValueError(f"teacher.secret_file {path} is empty")
    return secret


# ----------------------------------------------------------------------------- tokenizer hash


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's sorted vocabulary and special tokens (works on any HF tokenizer).

    Duck-typed (get_vocab, all_special_tokens) so that neither side needs transformers to
    import this; the trainer computes it for the student, each replica for the teacher.
    """
    vocab = sorted((str(tok), int(idx)) for tok, idx in tokenizer.get_vocab().items())
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    blob = json.dumps({"vocab": vocab, "special": special}, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True)
class TeacherTopK:
    """The teacher's scores for one sequence, from its first response position to its end.

    Row j is position p = score_from + j of the sequence and holds the teacher's distribution
    of the token at p given the tokens before it (the logits at p-1), at the request's
    temperature. Rows are sorted by logprob, descending; equal logprobs by ascending id.

    topk_logprobs    [n_scored, K] float32  log p of the K most likely tokens
    topk_ids         [n_scored, K] int32    their token ids
    sampled_logprob  [n_scored]    float32  log p of the token actually at p
    tail_logmass     [n_scored]    float32  log of the mass outside the top-k (-inf when K = V)
    """

    topk_logprobs: np.ndarray
    topk_ids: np.ndarray
    sampled_logprob: np.ndarray
    tail_logmass: np.ndarray

    @property
    def n_scored(self) -> int:
        return int(self.topk_ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.topk_ids.shape[1])


@dataclass(frozen=True)
class TopKBatch:
    """Scores of several sequences, concatenated along positions (the wire and backend layout).

    n_scored [B] int64; the other arrays are TeacherTopK's with N = n_scored.sum() rows.
    """

    n_scored: np.ndarray
    topk_logprobs: np.ndarray
    topk_ids: np.ndarray
    sampled_logprob: np.ndarray
    tail_logmass: np.ndarray

    def split(self) -> list[TeacherTopK]:
        """One TeacherTopK per sequence (views, no copies)."""
        bounds = np.cumsum(self.n_scored)[:-1]
        parts = zip(
            np.split(self.topk_logprobs, bounds),
            np.split(self.topk_ids, bounds),
            np.split(self.sampled_logprob, bounds),
            np.split(self.tail_logmass, bounds),
            strict=True,
        )
        return [TeacherTopK(*p) for p in parts]

    @staticmethod
    def from_sequences(parts: Sequence[TeacherTopK]) -> TopKBatch:
        """Pack per-sequence scores (the inverse of split)."""
        return TopKBatch(
            np.asarray([p.n_scored for p in parts], dtype=np.int64),
            np.concatenate([p.topk_logprobs for p in parts]),
            np.concatenate([p.topk_ids for p in parts]),
            np.concatenate([p.sampled_logprob for p in parts]),
            np.concatenate([p.tail_logmass for p in parts]),
        )

    @staticmethod
    def concat(batches: Sequence[TopKBatch]) -> TopKBatch:
        return TopKBatch(
            np.concatenate([b.n_scored for b in batches]),
            np.concatenate([b.topk_logprobs for b in batches]),
            np.concatenate([b.topk_ids for b in batches]),
            np.concatenate([b.sampled_logprob for b in batches]),
            np.concatenate([b.tail_logmass for b in batches]),
        )


def canonical_order(logprobs_NK: np.ndarray, ids_NK: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows sorted by logprob descending, ties by ascending id: one order on both ends of the wire."""
    order_NK = np.lexsort((ids_NK, -logprobs_NK), axis=-1)
    return np.take_along_axis(logprobs_NK, order_NK, axis=1), np.take_along_axis(ids_NK, order_NK, axis=1)


def tail_from_topk(logprobs_NK: np.ndarray) -> np.ndarray:
    """log(1 - sum exp(top-k)) per row from the top-k alone, as log1mexp(logsumexp) in float64.

    For backends that do not expose the full distribution (vllm); -inf when the top-k holds
    all the mass. log1mexp(x) = log(-expm1(x)) for x > -ln 2, else log1p(-exp(x)) (Maechler 2012).
    """
    if logprobs_NK.shape[1] == 0:
        return np.zeros(logprobs_NK.shape[0], dtype=np.float32)
    lse_N = np.minimum(np.logaddexp.reduce(logprobs_NK.astype(np.float64), axis=1), 0.0)
    with np.errstate(divide="ignore"):
        near_one = np.log(-np.expm1(lse_N))
        far = np.log1p(-np.exp(lse_N))
    return np.where(lse_N > -math.log(2), near_one, far).astype(np.float32)


def scores_from_logprobs(logprobs_NV: np.ndarray, next_ids_N: np.ndarray, top_k: int) -> TeacherTopK:
    """Exact TeacherTopK of N positions from their full-vocabulary log-probs (a reference scorer).

    Row n is the distribution of token next_ids_N[n]; the tail is computed in float64 from
    the whole distribution, as a backend that sees every logit does.
    """
    logprobs_NV = np.asarray(logprobs_NV, dtype=np.float64)
    top_NK = np.argsort(-logprobs_NV, axis=-1, kind="stable")[:, :top_k]
    values_NK = np.take_along_axis(logprobs_NV, top_NK, axis=-1)
    rest_NV = logprobs_NV.copy()
    np.put_along_axis(rest_NV, top_NK, -np.inf, axis=-1)
    with np.errstate(divide="ignore"):
        tail_N = np.logaddexp.reduce(rest_NV, axis=-1)
    sampled_N = np.take_along_axis(logprobs_NV, np.asarray(next_ids_N, dtype=np.int64)[:, None], axis=-1)[:, 0]
    logprobs, ids = canonical_order(values_NK.astype(np.float32), top_NK.astype(np.int32))
    return TeacherTopK(logprobs, ids, sampled_N.astype(np.float32), tail_N.astype(np.float32))


# ----------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class RequestLimits:
    """What a server accepts; checked by the frontend before any replica sees a request."""

    vocab_size: int
    max_top_k: int
    max_request_bytes: int
    supports_temperature: bool = True


@dataclass(frozen=True)
class ParsedRequest:
    """A validated score request: flat ids plus per-sequence lengths and first scored positions."""

    ids: np.ndarray
    lengths: np.ndarray
    score_from: np.ndarray
    top_k: int
    temperature: float

    @property
    def n_tokens(self) -> int:
        return int(self.ids.size)

    def sequences(self) -> list[np.ndarray]:
        return np.split(self.ids, np.cumsum(self.lengths)[:-1])


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
) -> list[bytes]:
    """The frames of a ScoreRequest: header, then all token ids as one int32 frame."""
    arrays = [np.asarray(s, dtype=TOKEN_DTYPE).reshape(-1) for s in sequences]
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
    )
    ids = np.concatenate(arrays) if arrays else np.zeros(0, TOKEN_DTYPE)
    return [encode(header), ids.tobytes()]


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


def parse_score_request(
    req: ScoreRequest, frames: Sequence[bytes | memoryview], limits: RequestLimits
) -> ParsedRequest:
    """Validate a ScoreRequest and its array frame against `limits`. Raises ProtocolError."""
    if req.version != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.VERSION, f"protocol version {req.version}, server speaks {PROTOCOL_VERSION}")
    if len(frames) != 1:
        raise _bad(f"a score request has exactly 1 array frame (token ids), got {len(frames)}")
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
    return ParsedRequest(ids, lengths, score_from, req.top_k, req.temperature)


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
) -> list[bytes]:
    """The frames of a ScoreReply: header, top-k logprobs, top-k ids, sampled logprob, tail log-mass.

    With top_k = 0 the tail frame is empty: outside an empty top-k is all the mass (log 1 = 0).
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
    )
    return [
        encode(header),
        np.ascontiguousarray(logprobs, dtype=LOGPROB_DTYPES[logprob_dtype]).tobytes(),
        ids_bytes,
        np.ascontiguousarray(batch.sampled_logprob, dtype=FLOAT_DTYPE).tobytes(),
        np.ascontiguousarray(batch.tail_logmass, dtype=FLOAT_DTYPE).tobytes() if top_k else b"",
    ]


def parse_score_reply(header: ScoreReply, frames: Sequence[bytes | memoryview]) -> TopKBatch:
    """Decode a ScoreReply's frames into float32/int32 arrays in canonical order. Raises ProtocolError."""
    if len(frames) != 4:
        raise ProtocolError(ErrorCode.MALFORMED, f"a score reply has 4 array frames, got {len(frames)}")
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
    except ValueError as err:
        raise ProtocolError(ErrorCode.MALFORMED, f"score reply arrays do not match its header: {err}") from None
    logprobs = logprobs.astype(np.float32)
    ids = ids.astype(np.int32)
    if header.id_encoding == "elias_fano" or header.logprob_dtype != "float32":
        # Elias-Fano sends rows by id; float16 rounding can create ties: restore the one order.
        logprobs, ids = canonical_order(logprobs, ids)
    return TopKBatch(n_scored, logprobs, ids, sampled.astype(np.float32), tail.astype(np.float32))
