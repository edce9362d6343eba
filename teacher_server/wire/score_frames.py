"""The array frames of a score request and its reply: built, then parsed and checked against the server's limits.

A request is its ScoreRequest header (protocol.py) and one int32 frame of all token ids (plus one of the named
ids); a reply is its ScoreReply header and the top-k logprobs, ids, sampled-token logprobs and tail (plus the named
ids' logprobs and the outside mass, the hidden states, a text request's tokens and byte ranges). protocol.py's
docstring describes each frame.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from teacher_server.wire import hidden_codec, idcodec
from teacher_server.wire.conversation import Conversation, estimated_tokens
from teacher_server.wire.protocol import (
    FLOAT_DTYPE,
    ID_ENCODINGS,
    LOGPROB_DTYPES,
    PROTOCOL_VERSION,
    TOKEN_DTYPE,
    ErrorCode,
    ProtocolError,
    ScoreReply,
    ScoreRequest,
    encode,
)
from teacher_server.wire.scores import TopKBatch, canonical_order

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
