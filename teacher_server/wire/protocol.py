"""The teacher wire protocol: typed msgpack headers plus raw array frames. No pickle anywhere.

Every ZeroMQ message is one msgspec-encoded header frame, then zero or more raw little-endian
array frames (built and parsed in score_frames.py). Clients talk to the frontend's ROUTER through a DEALER;
replicas talk to the frontend's second ROUTER through their own DEALER.

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
from typing import Any

import msgspec
import numpy as np

from teacher_server.wire.conversation import Conversation
from teacher_server.wire.identity import AUTH_CONTEXT, auth_token, read_secret, tokenizer_fingerprint  # noqa: F401
from teacher_server.wire.scores import (  # noqa: F401 - re-exported: the wire's result types
    TeacherScores,
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
