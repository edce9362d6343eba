"""Client/frontend failure handling against an in-process frontend and model-free fake replicas.

The fake replica obeys the replica protocol (register, heartbeat, answer) without a model, so
these tests cover timeouts, busy replies, failover, restarts, authentication and handshake
checks in a few seconds. Real replicas are exercised in test_teacher_server*.py.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from teacher_server.client.zmq_client import (
    TeacherClient,
    TeacherDeadError,
    TeacherMismatchError,
    TeacherRequestError,
    TeacherTimeoutError,
)
from teacher_server.server.frontend import Frontend, FrontendOptions
from teacher_server.wire import protocol as P
from teacher_server.wire.score_frames import reply_frames, request_frames

VOCAB = 50
HEARTBEAT_S = 0.1
WAIT_S = 10.0


class FakeReplica:
    """Registers and heartbeats like a replica; answers requests with uniform scores, or never."""

    def __init__(
        self, address: str, *, name: str = "fake", answer: bool = True, secret: bytes = b"", vocab: int = VOCAB
    ) -> None:
        self.address = address
        self.answer = answer
        self.register = P.Register(
            P.PROTOCOL_VERSION,
            name,
            0,
            "test",
            [],
            "fake-model",
            vocab,
            "fake-hash",
            16,
            "fake",
            False,
            P.auth_token(secret),
        )
        self.received = 0
        self.refused = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        next_beat = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_beat:
                sock.send(P.encode(self.register))
                next_beat = time.monotonic() + HEARTBEAT_S
            if sock.poll(20):
                frames = sock.recv_multipart()
                message = P.decode_frontend_message(frames[0])
                if isinstance(message, P.ErrorReply):
                    self.refused.set()
                elif isinstance(message, P.ScoreRequest):
                    self.received += 1
                    if self.answer:
                        sock.send_multipart(self._reply(message, frames[1]))
        sock.close(linger=0)

    def _reply(self, request: P.ScoreRequest, ids: bytes) -> list[bytes]:
        n_scored = [n - s for n, s in zip(request.lengths, request.score_from, strict=True)]
        rows, k = sum(n_scored), request.top_k
        uniform = np.full((rows, k), -np.log(self.register.vocab_size), dtype=np.float32)
        batch = P.TopKBatch(
            np.asarray(n_scored),
            uniform,
            np.tile(np.arange(k, dtype=np.int32), (rows, 1)),
            uniform[:, 0].copy(),
            P.tail_from_topk(uniform),
        )
        return reply_frames(
            request.request_id,
            batch,
            vocab_size=self.register.vocab_size,
            logprob_dtype=request.logprob_dtype,
            id_encoding=request.id_encoding,
        )


def _frontend(address: str = "tcp://127.0.0.1:0", **options: object) -> Frontend:
    frontend = Frontend(FrontendOptions(address=address, replica_address="tcp://127.0.0.1:0", **options))  # type: ignore[arg-type]
    frontend.start()
    return frontend


@pytest.fixture()
def frontend() -> Iterator[Frontend]:
    server = _frontend(replica_timeout_s=0.5, queue_depth=2)
    yield server
    server.stop()


def _wait_for(predicate: object, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _client(address: str, **kwargs: object) -> TeacherClient:
    options: dict[str, object] = dict(timeout_s=5.0, retries=1, top_k=4, logprob_dtype="float32", id_encoding="int32")
    options.update(kwargs)
    return TeacherClient(address, **options)  # type: ignore[arg-type]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nothing_listening_raises_dead_error_naming_the_address() -> None:
    client = _client(f"tcp://127.0.0.1:{_free_port()}", timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(TeacherDeadError, match=r"teacher\.address=tcp://127\.0\.0\.1"):
        client.connect()
    assert time.monotonic() - start < WAIT_S
    client.close()


def test_no_replicas_times_out_naming_the_timeout_key(frontend: Frontend) -> None:
    with _client(frontend.address, timeout_s=0.5) as client, pytest.raises(TeacherTimeoutError) as err:
        client.connect()
    assert "teacher.timeout_s=0.5" in str(err.value) and "no_replicas" in str(err.value)


def test_silent_replica_times_out_after_retries() -> None:
    frontend = _frontend(queue_depth=8)
    fake = FakeReplica(frontend.replica_address, answer=False)
    try:
        _wait_for(lambda: frontend.replica_names() == ["fake"])
        with _client(frontend.address, timeout_s=0.5, retries=2) as client, pytest.raises(TeacherTimeoutError) as err:
            client.score([[1, 2, 3]], [1])
        assert "teacher.timeout_s" in str(err.value) and "teacher.client.retries=2" in str(err.value)
        assert fake.received == 3  # the first attempt and two retries
    finally:
        fake.stop()
        frontend.stop()


def test_full_queues_answer_busy(frontend: Frontend) -> None:
    fake = FakeReplica(frontend.replica_address, answer=False)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(frontend.address)
    try:
        _wait_for(lambda: frontend.replica_names() == ["fake"])
        for request_id in (1, 2, 3):  # queue_depth=2: the third finds every queue full
            sock.send_multipart(request_frames(request_id, [[1, 2]], [1], top_k=2, temperature=1.0))
        assert sock.poll(int(WAIT_S * 1000))
        reply = P.decode_server_reply(sock.recv_multipart()[0])
        assert isinstance(reply, P.ErrorReply) and reply.request_id == 3
        assert reply.code == P.ErrorCode.BUSY and reply.retryable and "teacher.queue_depth=2" in reply.message
        stats = _client(frontend.address).stats()
        assert [r.queue_depth for r in stats.replicas] == [2] and stats.busy_replies == 1
    finally:
        sock.close(linger=0)
        fake.stop()


def test_lost_replica_fails_over_to_another(frontend: Frontend) -> None:
    silent = FakeReplica(frontend.replica_address, name="silent", answer=False)
    _wait_for(lambda: frontend.replica_names() == ["silent"])
    result: dict[str, object] = {}

    def score() -> None:
        with _client(frontend.address, timeout_s=WAIT_S, retries=1) as client:
            result["scores"] = client.score([[1, 2, 3, 4]], [2])

    worker = threading.Thread(target=score)
    worker.start()
    _wait_for(lambda: silent.received == 1)
    answering = FakeReplica(frontend.replica_address, name="answering")
    silent.stop()  # no more heartbeats: dropped after replica_timeout_s, its request re-sent to `answering`
    worker.join(WAIT_S)
    answering.stop()
    assert not worker.is_alive()
    scores = result["scores"]
    assert isinstance(scores, list) and scores[0].n_scored == 2 and answering.received == 1


def test_restarted_frontend_gets_pending_requests_resent() -> None:
    first = _frontend(replica_timeout_s=5.0)
    address = first.address
    silent = FakeReplica(first.replica_address, answer=False)
    _wait_for(lambda: first.replica_names() == ["fake"])
    result: dict[str, object] = {}

    def score() -> None:
        with _client(address, timeout_s=WAIT_S, retries=0) as client:
            client.connect()
            result["scores"] = client.score([[1, 2, 3]], [1])

    worker = threading.Thread(target=score)
    worker.start()
    _wait_for(lambda: silent.received == 1)
    first.stop()
    silent.stop()
    second = _frontend(address=address)
    answering = FakeReplica(second.replica_address)
    try:
        worker.join(WAIT_S)
        assert not worker.is_alive() and result["scores"][0].n_scored == 2  # type: ignore[index]
    finally:
        answering.stop()
        second.stop()


def test_shared_secret_is_required_from_clients_and_replicas() -> None:
    server = _frontend(secret=b"s3cret")
    intruder = FakeReplica(server.replica_address, name="intruder")
    member = FakeReplica(server.replica_address, name="member", secret=b"s3cret")
    try:
        assert intruder.refused.wait(WAIT_S)
        _wait_for(lambda: server.replica_names() == ["member"])
        with _client(server.address) as client, pytest.raises(TeacherRequestError, match=r"teacher\.secret_file"):
            client.connect()
        with _client(server.address, secret=b"s3cret") as client:
            assert client.connect().replicas == 1
    finally:
        intruder.stop()
        member.stop()
        server.stop()


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"expect_vocab_size": VOCAB + 1}, "model.student_path"),
        ({"expect_tokenizer_hash": "other"}, "model.tokenizer_path"),
        ({"top_k": 17}, "teacher.top_k"),
        ({"temperature": 0.5}, "teacher.temperature"),
    ],
)
def test_handshake_refuses_a_mismatched_teacher(frontend: Frontend, kwargs: dict[str, object], key: str) -> None:
    fake = FakeReplica(frontend.replica_address)
    try:
        _wait_for(lambda: frontend.replica_names() == ["fake"])
        with (
            _client(frontend.address, **kwargs) as client,
            pytest.raises(TeacherMismatchError, match=key.replace(".", r"\.")),
        ):
            client.connect()
    finally:
        fake.stop()
