"""One teacher replica process: load the backend, then serve the frontend over a DEALER socket.

    python -m teacher_server.server.replica --spec '<ReplicaSpec as JSON>'

Started by the supervisor (`python -m teacher_server`) with CUDA_VISIBLE_DEVICES set to its
GPUs. The main thread owns the socket (work in, results out, a Register heartbeat every
HEARTBEAT_S); a worker thread runs the backend, so heartbeats continue during long batches.
A failing request becomes an ErrorReply for that request only. Prints REPLICA_READY once
the frontend has accepted it; exits when its parent supervisor is gone.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import queue
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import msgspec
import numpy as np
import zmq

from teacher_server.server.backends import Backend, BackendOptions, load_backend, parsed_request
from teacher_server.wire import hidden_codec
from teacher_server.wire import protocol as P
from teacher_server.wire.conversation import Renderer, RenderError
from teacher_server.wire.score_frames import ParsedRequest, RequestLimits, parse_score_request, reply_frames

log = logging.getLogger("teacher_server.replica")

HEARTBEAT_S = 0.5
POLL_MS = 100
READY_MARKER = "REPLICA_READY"
# Exit codes the supervisor reports.
EXIT_LOAD_FAILED = 2
EXIT_REFUSED = 3
EXIT_WORKER_DIED = 4
# A replica takes any request size the frontend let through.
UNLIMITED_BYTES = 1 << 62


class ReplicaSpec(msgspec.Struct):
    name: str
    connect: str
    backend: str
    options: BackendOptions
    gpu_ids: list[str]
    secret_file: str = ""
    parent_pid: int = 0


@dataclass
class _Work:
    header: P.ScoreRequest
    arrays: list[bytes]


def self_test_request(options: BackendOptions) -> ParsedRequest:
    """A replica's first request: one scored token, in the mode the server runs (teacher.output)."""
    if options.output == "hidden":
        return parsed_request([[0, 0]], [1], top_k=0, hidden_dtype=hidden_codec.HIDDEN_DTYPES[0])
    return parsed_request([[0, 0]], [1], top_k=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m teacher_server.server.replica")
    parser.add_argument("--spec", required=True, help="ReplicaSpec as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec = msgspec.json.decode(args.spec, type=ReplicaSpec)
    log.info("replica %s: loading %s backend from %s", spec.name, spec.backend, spec.options.model_path)
    try:
        backend = load_backend(spec.backend, spec.options)
        # Self-test before joining: a replica that cannot score never takes work.
        backend.score(self_test_request(spec.options))
    except (OSError, ValueError, RuntimeError, ImportError) as err:
        log.error("replica %s failed to load: %s", spec.name, err)
        traceback.print_exc()
        return EXIT_LOAD_FAILED
    log.info("replica %s: model loaded (%s)", spec.name, backend.info)
    return ReplicaLoop(spec, backend).run()


class ReplicaLoop:
    def __init__(self, spec: ReplicaSpec, backend: Backend) -> None:
        self.spec = spec
        self.backend = backend
        info = backend.info
        self.register = P.Register(
            version=P.PROTOCOL_VERSION,
            name=spec.name,
            pid=os.getpid(),
            host=socket.gethostname(),
            gpu_ids=spec.gpu_ids,
            model_id=info.model_id,
            vocab_size=info.vocab_size,
            tokenizer_hash=info.tokenizer_hash,
            max_top_k=info.max_top_k,
            backend=info.backend,
            supports_temperature=info.supports_temperature,
            max_named_ids=info.max_named_ids,
            hidden_size=info.hidden_size,
            auth=P.auth_token(P.read_secret(spec.secret_file)),
        )
        self.limits = RequestLimits(
            info.vocab_size,
            info.max_top_k,
            UNLIMITED_BYTES,
            info.supports_temperature,
            info.max_named_ids,
            info.hidden_size,
        )
        self.ctx = zmq.Context()
        self.work: queue.Queue[_Work | None] = queue.Queue()
        self.results: queue.Queue[list[bytes]] = queue.Queue()
        self.wake_address = f"inproc://replica-wake-{id(self)}"
        self._renderer: Renderer | None = None  # built at the first text request (its tokenizer)

    def run(self) -> int:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.spec.connect)
        wake = self.ctx.socket(zmq.PAIR)
        wake.bind(self.wake_address)
        worker = threading.Thread(target=self._worker, name="replica-worker", daemon=True)
        worker.start()
        try:
            return self._loop(sock, wake, worker)
        finally:
            self.work.put(None)
            sock.close(linger=0)
            wake.close(linger=0)

    def _loop(self, sock: zmq.Socket, wake: zmq.Socket, worker: threading.Thread) -> int:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        next_beat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_beat:
                sock.send(P.encode(self.register))
                next_beat = now + HEARTBEAT_S
                if self.spec.parent_pid and os.getppid() != self.spec.parent_pid:
                    log.warning("replica %s: supervisor %d is gone, exiting", self.spec.name, self.spec.parent_pid)
                    return 0
                if not worker.is_alive():
                    log.error("replica %s: worker thread died", self.spec.name)
                    return EXIT_WORKER_DIED
            events = dict(poller.poll(POLL_MS))
            if wake in events:
                while wake.poll(0):
                    wake.recv()
                while not self.results.empty():
                    sock.send_multipart(self.results.get_nowait(), copy=False)
            if sock in events:
                code = self._on_frontend(sock.recv_multipart(copy=False))
                if code is not None:
                    return code

    def _on_frontend(self, frames: list[zmq.Frame]) -> int | None:
        """Queue work; print the ready marker on each ack (one per frontend); a refusal ends the replica."""
        try:
            message = P.decode_frontend_message(frames[0].buffer)
        except P.ProtocolError as err:
            log.warning("replica %s: undecodable frontend message: %s", self.spec.name, err.message)
            return None
        if isinstance(message, P.RegisterAck):
            print(f"{READY_MARKER} {self.spec.name} server={message.server_id}", flush=True)
        elif isinstance(message, P.ErrorReply):
            log.error("replica %s refused by the frontend: %s", self.spec.name, message.message)
            return EXIT_REFUSED
        else:
            self.work.put(_Work(message, [f.bytes for f in frames[1:]]))
        return None

    def _worker(self) -> None:
        wake = self.ctx.socket(zmq.PAIR)
        wake.connect(self.wake_address)
        try:
            while (item := self.work.get()) is not None:
                self.results.put(self._score(item))
                wake.send(b"")
        finally:
            wake.close(linger=0)

    def _score(self, item: _Work) -> list[bytes]:
        """The reply frames for one request; any failure is an ErrorReply for this request only."""
        header = item.header
        start = time.perf_counter()
        try:
            request = parse_score_request(header, item.arrays, self.limits)
            if request.conversations:
                request, token_ids, offsets = self._render(request)
                batch = dataclasses.replace(self.backend.score(request), token_ids=token_ids, byte_offsets=offsets)
            else:
                batch = self.backend.score(request)
        except RenderError as err:
            return [P.error_reply(header.request_id, P.ErrorCode.RENDER, str(err))]
        except P.ProtocolError as err:
            return [P.error_reply(header.request_id, err.code, err.message)]
        except Exception as err:  # noqa: BLE001 - scoped to this request: reported to the client, logged here
            log.error("replica %s: request %d failed:\n%s", self.spec.name, header.request_id, traceback.format_exc())
            return [P.error_reply(header.request_id, P.ErrorCode.BACKEND_ERROR, f"{type(err).__name__}: {err}")]
        return reply_frames(
            header.request_id,
            batch,
            vocab_size=self.backend.info.vocab_size,
            logprob_dtype=header.logprob_dtype,
            id_encoding=header.id_encoding,
            replica=self.spec.name,
            compute_s=time.perf_counter() - start,
            hidden_dtype=header.hidden_dtype,
        )

    def _render(self, request: ParsedRequest) -> tuple[ParsedRequest, np.ndarray, np.ndarray]:
        """A text request in this teacher's tokens (teacher_server/wire/conversation.py): the id request, and the
        token at each scored position [N] with its byte range in the response text [N, 2]."""
        if self._renderer is None:
            from transformers import AutoTokenizer

            options = self.spec.options
            template = open(options.chat_template).read() if options.chat_template else ""
            self._renderer = Renderer(AutoTokenizer.from_pretrained(options.model_path), template)
        rendered = [self._renderer.render(c) for c in request.conversations or []]
        ids = np.concatenate([r.ids for r in rendered])
        if ids.size and int(ids.max()) >= self.limits.vocab_size:
            raise RenderError(
                f"the teacher's tokenizer made id {int(ids.max())} >= its model's {self.limits.vocab_size}"
            )
        lengths = np.asarray([r.ids.size for r in rendered], dtype=np.int64)
        score_from = np.asarray([r.score_from for r in rendered], dtype=np.int64)
        parsed = dataclasses.replace(request, ids=ids, lengths=lengths, score_from=score_from, conversations=None)
        token_ids = np.concatenate([r.ids[r.score_from :] for r in rendered]).astype(np.int32)
        return parsed, token_ids, np.concatenate([r.byte_offsets for r in rendered]).reshape(-1, 2)


if __name__ == "__main__":
    sys.exit(main())
