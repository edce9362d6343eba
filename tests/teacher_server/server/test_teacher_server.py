"""A real teacher server (one HF replica on the tiny model): exact results, bad requests, fuzzing."""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from teacher_servers import MAX_REQUEST_MB, MAX_TOP_K, READY_TIMEOUT_S, VOCAB, write_teacher_yaml

from teacher_server.client.launcher import TeacherLaunchError, TeacherProcess, launch_teacher, start_teacher
from teacher_server.client.zmq_client import TeacherClient, TeacherMismatchError, TeacherRequestError, split_balanced
from teacher_server.server.backends import Backend, BackendOptions, load_backend, parsed_request
from teacher_server.wire import protocol as P
from teacher_server.wire.score_frames import parse_score_reply, request_frames

MAX_REQUEST_BYTES = int(MAX_REQUEST_MB * (1 << 20))
REPLY_TIMEOUT_MS = 20_000
RETRY_PAUSE_S = 0.05  # before a refused valid request is sent again
FUZZ_FRAMES = 2000
# RSS growth of the frontend over a fuzz run that counts as bounded.
RSS_GROWTH_LIMIT = 64 << 20


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TeacherProcess]:
    yaml_path = write_teacher_yaml(tmp_path_factory.mktemp("teacher") / "teacher.yaml", tiny_model_dir)
    with launch_teacher(yaml_path, ready_timeout_s=READY_TIMEOUT_S, log_path=yaml_path.parent / "server.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> Backend:
    """The same backend, in this process."""
    return load_backend("hf", BackendOptions(str(tiny_model_dir), max_top_k=MAX_TOP_K))


def _batch(seed: int, n: int = 7) -> tuple[list[np.ndarray], list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 60, size=n)
    seqs = [rng.integers(0, VOCAB, size=int(length)).astype(np.int32) for length in lengths]
    starts = [int(rng.integers(1, length + 1)) for length in lengths]  # includes score_from = length
    return seqs, starts


def _client(address: str, **kwargs: object) -> TeacherClient:
    options: dict[str, object] = dict(timeout_s=60.0, top_k=8, logprob_dtype="float32", id_encoding="int32")
    options.update(kwargs)
    return TeacherClient(address, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("id_encoding", ["int32", "elias_fano"])
@pytest.mark.parametrize("max_inflight", [1, 3])
def test_server_equals_in_process_backend(
    server: TeacherProcess, backend: Backend, id_encoding: str, max_inflight: int
) -> None:
    seqs, starts = _batch(seed=max_inflight)
    with _client(server.address, max_inflight=max_inflight, id_encoding=id_encoding) as client:
        got = client.score(seqs, starts, top_k=12, temperature=0.8)
    # The reference runs the same chunks the client sent, so the padded batches are identical.
    chunks = split_balanced([s.size for s in seqs], max_inflight, MAX_REQUEST_BYTES // 4)
    want = [
        part
        for lo, hi in chunks
        for part in backend.score(parsed_request(seqs[lo:hi], starts[lo:hi], top_k=12, temperature=0.8)).split()
    ]
    assert len(got) == len(seqs)
    for seq, start, g, w in zip(seqs, starts, got, want, strict=True):
        assert g.n_scored == seq.size - start and g.top_k == 12  # only response positions are scored
        assert g.topk_ids.dtype == np.int32 and g.topk_logprobs.dtype == np.float32
        np.testing.assert_array_equal(g.topk_ids, w.topk_ids)
        np.testing.assert_allclose(g.topk_logprobs, w.topk_logprobs, atol=1e-5, rtol=0)
        np.testing.assert_allclose(g.sampled_logprob, w.sampled_logprob, atol=1e-5, rtol=0)
        np.testing.assert_allclose(g.tail_logmass, w.tail_logmass, atol=1e-5, rtol=0)


def test_float16_wire_is_close(server: TeacherProcess, backend: Backend) -> None:
    seqs, starts = _batch(seed=5)
    with _client(server.address, max_inflight=1, logprob_dtype="float16", id_encoding="elias_fano") as client:
        got = client.score(seqs, starts)
    want = backend.score(parsed_request(seqs, starts, top_k=8)).split()
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.sort(g.topk_ids, axis=1), np.sort(w.topk_ids, axis=1))
        np.testing.assert_allclose(g.topk_logprobs, w.topk_logprobs, rtol=2**-10, atol=1e-6)


def test_top_k_zero_sends_the_sampled_tokens_only(server: TeacherProcess, backend: Backend) -> None:
    seqs, starts = _batch(seed=6)
    with _client(server.address, max_inflight=2, top_k=0, logprob_dtype="float16", id_encoding="elias_fano") as client:
        got = client.score(seqs, starts)
    want = backend.score(parsed_request(seqs, starts, top_k=0)).split()
    for seq, start, g, w in zip(seqs, starts, got, want, strict=True):
        assert g.topk_ids.shape == (seq.size - start, 0) and g.topk_logprobs.shape == (seq.size - start, 0)
        np.testing.assert_allclose(g.sampled_logprob, w.sampled_logprob, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(g.tail_logmass, np.zeros(seq.size - start, np.float32))


def test_a_bad_request_fails_alone(server: TeacherProcess) -> None:
    with _client(server.address) as client:
        with pytest.raises(TeacherRequestError, match=r"\[0, 102\)") as err:
            client.score([[1, 2, VOCAB]], [1])
        assert err.value.code == P.ErrorCode.BAD_REQUEST
        assert client.score([[1, 2, 3]], [1])[0].n_scored == 2


def _full_logprobs(model_dir: Path, seq: np.ndarray, start: int) -> np.ndarray:
    """float64 log-softmax of the teacher's logits predicting positions start.. of `seq` (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(seq.astype(np.int64))[None]).logits[0]
    return torch.log_softmax(logits[start - 1 : -1], dim=-1).numpy()


def test_named_ids_equal_the_full_distribution(server: TeacherProcess, tiny_model_dir: Path) -> None:
    """The teacher's logprobs at the ids a request names, and its mass outside top-k + named, from one forward."""
    seqs, starts = _batch(seed=11, n=4)
    rng = np.random.default_rng(11)
    named = [rng.integers(0, VOCAB, size=(s.size - f, 5)).astype(np.int32) for s, f in zip(seqs, starts, strict=True)]
    with _client(server.address, max_inflight=2) as client:
        assert client.connect().max_named_ids == MAX_TOP_K
        got = client.score(seqs, starts, named_ids=named)
    for seq, start, ids, g in zip(seqs, starts, named, got, strict=True):
        assert g.named_logprobs is not None and g.other_logmass is not None
        assert g.named_logprobs.shape == (seq.size - start, 5)
        if g.n_scored == 0:
            continue
        ref_NV = _full_logprobs(tiny_model_dir, seq, start)
        np.testing.assert_allclose(g.named_logprobs, np.take_along_axis(ref_NV, ids.astype(int), 1), atol=1e-5)
        rest = ref_NV.copy()
        np.put_along_axis(rest, g.topk_ids.astype(int), -np.inf, axis=1)
        np.testing.assert_allclose(g.tail_logmass, np.logaddexp.reduce(rest, axis=1), atol=1e-5)
        np.put_along_axis(rest, ids.astype(int), -np.inf, axis=1)
        np.testing.assert_allclose(g.other_logmass, np.logaddexp.reduce(rest, axis=1), atol=1e-5)


def test_more_named_ids_than_the_server_scores_are_refused_before_sending(server: TeacherProcess) -> None:
    named = [np.zeros((2, MAX_TOP_K + 1), np.int32)]
    with _client(server.address) as client, pytest.raises(TeacherMismatchError, match=r"rollout\.student_top_k=65"):
        client.score([[1, 2, 3]], [1], named_ids=named)


def _named_request(request_id: int, named: np.ndarray, named_k: int) -> list[bytes]:
    """A score request of one 5-token sequence scored from 2 (3 positions) with a raw named-id frame."""
    header = _header(request_id=request_id, lengths=[5], score_from=[2], named_k=named_k)
    return [msgspec.msgpack.encode(header), np.arange(1, 6, dtype=np.int32).tobytes(), named.astype(np.int32).tobytes()]


BAD_NAMED = {
    "out of range": (np.full((3, 2), VOCAB), 2, r"named ids must lie in \[0, 102\)"),
    "negative": (np.full((3, 2), -1), 2, "named ids must lie"),
    "too many": (np.zeros((3, MAX_TOP_K + 1)), MAX_TOP_K + 1, "named_k=65 outside"),
    "ragged mismatch": (np.zeros((2, 2)), 2, "named-id frame has 16 bytes"),
}


def test_bad_named_ids_fail_alone(server: TeacherProcess) -> None:
    """Each bad named-id request gets its own error reply; the good request between them is answered."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    try:
        for request_id, (named, named_k, _) in enumerate(BAD_NAMED.values()):
            sock.send_multipart(_named_request(request_id, named, named_k))
        sock.send_multipart(_named_request(99, np.zeros((3, 2)), 2))
        # The named-id frame is missing: a request with named_k = 2 and the token frame only.
        sock.send_multipart(_named_request(100, np.zeros((3, 2)), 2)[:2])
        replies = {}
        for _ in range(len(BAD_NAMED) + 2):
            assert sock.poll(REPLY_TIMEOUT_MS), "the server stopped answering"
            frames = sock.recv_multipart()
            reply = P.decode_server_reply(frames[0])
            replies[reply.request_id] = (reply, frames[1:])
    finally:
        sock.close()
    for request_id, (name, (_, _, match)) in enumerate(BAD_NAMED.items()):
        reply, _ = replies[request_id]
        assert isinstance(reply, P.ErrorReply) and reply.code == P.ErrorCode.BAD_REQUEST, name
        assert re.search(match, reply.message), (name, reply.message)
    missing, _ = replies[100]
    assert isinstance(missing, P.ErrorReply) and "2 array frame(s)" in missing.message
    good, frames = replies[99]
    assert isinstance(good, P.ScoreReply) and good.named_k == 2
    batch = parse_score_reply(good, frames)
    assert batch.named_logprobs is not None and batch.named_logprobs.shape == (3, 2)


def test_stats_report_each_replica(server: TeacherProcess) -> None:
    with _client(server.address) as client:
        client.score(*_batch(seed=9))
        stats = client.stats()
    (replica,) = stats.replicas
    assert replica.name == "n0-r0" and replica.pid > 0 and replica.queue_depth == 0
    assert replica.requests >= 2 and replica.tokens > 0 and replica.tokens_per_s > 0  # the probe and the batch


# ----------------------------------------------------------------------------- fuzzing


@dataclass
class FuzzReport:
    sent: Counter[str]
    error_replies: int
    valid_ok: int
    # Valid requests answered with a retryable error (busy / replica_lost when a loaded machine delays
    # the replica's heartbeat past teacher.replica_timeout_s) and sent again after a pause, as TeacherClient
    # does: the ids of those requests (one outage refuses one request many times while it lasts).
    valid_retried: set[int] = field(default_factory=set)


def _header(**changes: object) -> dict[str, object]:
    fields: dict[str, object] = dict(
        type="score",
        version=P.PROTOCOL_VERSION,
        request_id=1,
        lengths=[3, 2],
        score_from=[1, 1],
        top_k=4,
        temperature=1.0,
    )
    fields.update(changes)
    return fields


def _score(ids: list[int] | np.ndarray | None = None, **changes: object) -> list[bytes]:
    ids_array = np.asarray([1, 2, 3, 4, 5] if ids is None else ids, dtype=np.int32)
    return [msgspec.msgpack.encode(_header(**changes)), ids_array.tobytes()]


def _malformed_kinds(rng: np.random.Generator) -> dict[str, Callable[[], list[bytes]]]:
    """Every kind of bad message the fuzzer sends, each expected to get exactly one error reply."""
    valid = _score()

    def garbage(n: int) -> bytes:
        return rng.bytes(int(rng.integers(0, n)))

    return {
        "garbage": lambda: [garbage(200)],
        "garbage_frames": lambda: [garbage(64) for _ in range(int(rng.integers(2, 12)))],
        "truncated_header": lambda: [valid[0][: int(rng.integers(1, len(valid[0])))], valid[1]],
        "truncated_ids": lambda: [valid[0], valid[1][: int(rng.integers(0, len(valid[1])))]],
        "missing_ids": lambda: [valid[0]],
        "extra_frames": lambda: [*valid, garbage(32)],
        "wrong_version": lambda: _score(version=int(rng.choice([0, P.PROTOCOL_VERSION + 1, -1, 1 << 40]))),
        "negative_ids": lambda: _score([1, 2, -int(rng.integers(1, 1 << 30)), 4, 5]),
        "out_of_vocab_ids": lambda: _score([1, 2, int(rng.integers(VOCAB, 1 << 31)), 4, 5]),
        "empty_sequences": lambda: _score([], lengths=[], score_from=[]),
        "zero_length": lambda: _score([1, 2, 3], lengths=[3, 0], score_from=[1, 0]),
        "top_k_too_large": lambda: _score(top_k=int(rng.integers(MAX_TOP_K + 1, 1 << 20))),
        "top_k_negative": lambda: _score(top_k=-int(rng.integers(1, 5))),  # 0 is valid: the sampled token only
        "bad_temperature": lambda: _score(temperature=float(rng.choice([0.0, -1.0, np.nan, np.inf]))),
        "bad_score_from": lambda: _score(score_from=[[0, 1], [1, 3], [1]][int(rng.integers(0, 3))]),
        "wrong_types": lambda: _score(top_k="four", lengths="3,2"),
        "unknown_type": lambda: [msgspec.msgpack.encode({"type": "shutdown", "version": 1})],
        "not_a_map": lambda: [msgspec.msgpack.encode([1, 2, 3])],
        "bad_dtype": lambda: _score(logprob_dtype="float8", id_encoding="zip"),
        "replica_message": lambda: [P.encode(P.Register(1, "x", 0, "h", [], "m", VOCAB, "t", 8, "hf", True))],
        "hello_with_arrays": lambda: [P.encode(P.Hello(P.PROTOCOL_VERSION, 1)), garbage(16)],
        "huge": lambda: [
            msgspec.msgpack.encode(_header()),
            bytes(MAX_REQUEST_BYTES + int(rng.integers(1, MAX_REQUEST_BYTES))),
        ],
    }


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def run_fuzz(address: str, n_frames: int, *, seed: int = 0, valid_every: int = 250, window: int = 64) -> FuzzReport:
    """Send n_frames malformed messages (and a valid one every `valid_every`); check every reply."""
    rng = np.random.default_rng(seed)
    kinds = _malformed_kinds(rng)
    names = sorted(kinds)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    report = FuzzReport(Counter(), 0, 0)
    outstanding = 0

    def send_valid(request_id: int) -> None:
        sock.send_multipart(request_frames(request_id, [[1, 2, 3], [4, 5]], [1, 1], top_k=4, temperature=1.0))

    def receive() -> int:
        """One reply; returns how many requests it puts back in flight (a retried valid one)."""
        assert sock.poll(REPLY_TIMEOUT_MS), f"no reply after {sum(report.sent.values())} messages"
        frames = sock.recv_multipart()
        reply = P.decode_server_reply(frames[0])
        if isinstance(reply, P.ScoreReply):
            batch = parse_score_reply(reply, frames[1:])
            assert reply.request_id >= 1 << 32 and batch.n_scored.tolist() == [2, 1]
            report.valid_ok += 1
            return 0
        assert isinstance(reply, P.ErrorReply), reply
        if reply.request_id >= 1 << 32:  # a valid request: only a retryable refusal is acceptable
            assert reply.retryable, reply
            report.valid_retried.add(reply.request_id)
            time.sleep(RETRY_PAUSE_S)
            send_valid(reply.request_id)
            return 1
        report.error_replies += 1
        return 0

    try:
        for i in range(n_frames):
            # Huge frames are 1 in 200 so that the run stays fast.
            name = "huge" if i % 200 == 199 else names[int(rng.integers(0, len(names)))]
            while name == "huge" and i % 200 != 199:
                name = names[int(rng.integers(0, len(names)))]
            sock.send_multipart(kinds[name]())
            report.sent[name] += 1
            outstanding += 1
            if i % valid_every == 0:
                send_valid((1 << 32) + i)
                outstanding += 1
            while outstanding >= window:
                outstanding += receive() - 1
        while outstanding:
            outstanding += receive() - 1
    finally:
        sock.close(linger=0)
    return report


@pytest.mark.parametrize("n_frames", [FUZZ_FRAMES, pytest.param(10_000, marks=pytest.mark.slow)])
def test_fuzz_malformed_frames(server: TeacherProcess, n_frames: int) -> None:
    run_fuzz(server.address, 200, seed=1)  # warm the allocator before measuring
    rss_before = _rss_bytes(server.pid)
    report = run_fuzz(server.address, n_frames, seed=2)
    rss_growth = _rss_bytes(server.pid) - rss_before
    assert report.error_replies == n_frames  # every malformed message got exactly one error reply
    assert report.valid_ok == len(range(0, n_frames, 250))  # valid requests in between were served
    assert len(report.valid_retried) <= 2, report  # a retry is a loaded machine's hiccup, not the norm
    assert len(report.sent) == len(_malformed_kinds(np.random.default_rng(0)))
    assert rss_growth < RSS_GROWTH_LIMIT, f"frontend RSS grew by {rss_growth >> 20} MiB"
    with _client(server.address) as client:
        assert client.score([[1, 2, 3, 4]], [2])[0].n_scored == 2


def test_frames_above_the_hard_limit_drop_the_peer_not_the_server(server: TeacherProcess) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    try:
        sock.send_multipart([msgspec.msgpack.encode(_header()), bytes(8 * MAX_REQUEST_BYTES)])
        assert not sock.poll(500)  # libzmq closed the connection (MAXMSGSIZE): nothing to reply to
    finally:
        sock.close(linger=0)
    with _client(server.address) as client:
        assert client.score([[1, 2, 3]], [1])[0].n_scored == 2


def test_a_started_server_is_waited_for_only_when_ready_is_called(tiny_model_dir: Path, tmp_path: Path) -> None:
    """start_teacher returns at once (a run starts Ray meanwhile); READY is due ready_timeout_s after the start."""
    yaml_path = write_teacher_yaml(tmp_path / "teacher.yaml", tiny_model_dir)
    with start_teacher(yaml_path, ready_timeout_s=READY_TIMEOUT_S, log_path=tmp_path / "server.log") as starting:
        assert starting.proc.poll() is None
        first = starting.ready()
        assert first is starting.ready()  # waited for once
        with TeacherClient(first.address, timeout_s=30, top_k=8) as client:
            assert client.connect().vocab_size == VOCAB
    assert starting.proc.poll() is not None  # stopped with the block
    # The deadline counts from the start: a server that cannot be READY in 0.2 s fails in ready(), and is stopped.
    with start_teacher(yaml_path, ready_timeout_s=0.2, log_path=tmp_path / "late.log") as late:
        with pytest.raises(TeacherLaunchError, match=r"not READY within 0\.2 s"):
            late.ready()
    assert late.proc.poll() is not None


# Half an ulp of each 16-bit wire dtype relative to the value (8 and 11 significant bits): one value's rounding.
HALF_ULP = {"bfloat16": 2.0**-8, "float16": 2.0**-11}


@pytest.mark.parametrize("hidden_dtype", ["bfloat16", "float16"])
def test_hidden_states_give_the_teachers_own_logits(
    server: TeacherProcess, tiny_model_dir: Path, hidden_dtype: str
) -> None:
    """teacher.output=hidden: the reply's final hidden states, times the teacher's output head, are its logits.

    Bound: a value rounded to the wire dtype moves by <= HALF_ULP x |h_j|, so each logit by <= sum_j |W_vj| |h_j|
    x HALF_ULP and a log-softmax value by twice the largest of those (plus fp32 rounding, 1e-5).
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    head_VH = model.get_output_embeddings().weight.detach().numpy()
    seqs, starts = _batch(seed=13, n=4)
    with _client(server.address, top_k=0, hidden_dtype=hidden_dtype) as client:
        assert client.connect().hidden_size == head_VH.shape[1]
        got = client.score(seqs, starts)
    assert sum(g.n_scored for g in got) > 0
    for seq, start, g in zip(seqs, starts, got, strict=True):
        assert g.hidden_states is not None and g.hidden_states.shape == (seq.size - start, head_VH.shape[1])
        if g.n_scored == 0:
            continue
        hidden_NH = g.hidden_states.astype(np.float64)
        logits_NV = hidden_NH @ head_VH.T
        logprobs_NV = logits_NV - np.logaddexp.reduce(logits_NV, axis=1, keepdims=True)
        bound_N = 2 * (np.abs(hidden_NH) @ np.abs(head_VH).T).max(axis=1) * HALF_ULP[hidden_dtype] + 1e-5
        error_N = np.abs(logprobs_NV - _full_logprobs(tiny_model_dir, seq, start)).max(axis=1)
        assert (error_N <= bound_N).all(), (error_N, bound_N)
        # No logprob comes along: the server ran no output head and no log-softmax (the actor does, exactly).
        assert np.isnan(g.sampled_logprob).all() and g.top_k == 0


def test_a_hidden_state_request_runs_no_output_head(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """teacher.output=hidden (top_k 0, no named ids): the decoder only, no [N, V] logits or log-softmax on the
    teacher; a request that also asks for a top-k still gets it from the one forward."""
    seqs, starts = _batch(seed=5, n=3)
    want = backend.score(parsed_request(seqs, starts, top_k=0, hidden_dtype="bfloat16"))

    def no_head(*args: object) -> None:
        raise AssertionError("the output head ran for a hidden-state request")

    monkeypatch.setattr(backend, "_logprobs", no_head)
    got = backend.score(parsed_request(seqs, starts, top_k=0, hidden_dtype="bfloat16"))
    assert got.hidden_states is not None and want.hidden_states is not None
    np.testing.assert_array_equal(got.hidden_states, want.hidden_states)
    assert np.isnan(got.sampled_logprob).all() and got.topk_ids.shape == (int(got.n_scored.sum()), 0)
    with pytest.raises(AssertionError, match="output head ran"):
        backend.score(parsed_request(seqs, starts, top_k=4, hidden_dtype="bfloat16"))


def test_a_hidden_state_reply_carries_one_more_frame_of_two_bytes_per_value(server: TeacherProcess) -> None:
    """The wire: 4 array frames of a top_k = 0 reply plus the hidden states at 2 bytes per value."""
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
        header = _header(request_id=7, lengths=[5], score_from=[2], top_k=0, hidden_dtype="bfloat16")
        sock.send_multipart([msgspec.msgpack.encode(header), np.arange(1, 6, dtype=np.int32).tobytes()])
        assert sock.poll(REPLY_TIMEOUT_MS)
        frames = sock.recv_multipart()
    reply = msgspec.msgpack.decode(frames[0], type=P.ServerReply)
    assert isinstance(reply, P.ScoreReply) and reply.hidden_dtype == "bfloat16" and reply.hidden_size > 0
    assert len(frames) == 1 + 4 + 1
    assert len(frames[-1]) == 3 * reply.hidden_size * 2
    assert parse_score_reply(reply, frames[1:]).hidden_states.shape == (3, reply.hidden_size)  # type: ignore[union-attr]
