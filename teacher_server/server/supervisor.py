"""Starts the frontend and this node's replica processes, waits until they serve, keeps them alive.

Serve mode: bind the frontend, spawn one replica per slot (CUDA_VISIBLE_DEVICES = its GPU ids),
wait until every replica has registered and answered a real scoring request through the
frontend, then print `READY <address> replica_address=<where --join points>`. Join mode
(`--join ADDRESS`): spawn the replicas against another node's frontend and print `JOINED <address>` once it has accepted them all.
A replica that dies during start-up fails the start (exit 1, with its log tail); one that dies
later is reported to the frontend at once (its requests in flight go to a live replica, or
wait for its restart) and restarted up to server.max_restarts times; once no replica is left the
server exits 1. SIGTERM/SIGINT stop exactly the processes this supervisor started.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from teacher_server.server.backends import BackendOptions
from teacher_server.server.frontend import Frontend, FrontendOptions
from teacher_server.server.replica import READY_MARKER, ReplicaSpec
from teacher_server.server.settings import ReplicaSlot, ServerSettings
from teacher_server.wire import protocol as P

log = logging.getLogger("teacher_server")

SUPERVISE_INTERVAL_S = 0.2
STOP_TIMEOUT_S = 10.0
LOG_TAIL_LINES = 40
# The readiness probe: score one position of a two-token sequence on each replica.
PROBE_SEQUENCE = (0, 0)
EXIT_OK = 0
EXIT_FAILED = 1
PACKAGE_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class _Child:
    slot: ReplicaSlot
    proc: subprocess.Popen[bytes]
    log_path: Path
    # Size of the (appended) log when this child started: older lines belong to earlier runs.
    log_offset: int
    restarts: int = 0
    gave_up: bool = False


class StartupError(RuntimeError):
    """A replica failed or did not become ready; the message carries its log tail."""


class Supervisor:
    def __init__(self, settings: ServerSettings, *, join: str = "") -> None:
        self.settings = settings
        self.join = join
        self.secret = P.read_secret(settings.teacher.secret_file)
        log_dir = settings.server.log_dir or tempfile.mkdtemp(prefix="teacher_server_logs_")
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[_Child] = []
        self.frontend: Frontend | None = None
        # Set by the signal handler; a plain flag because Event.set() from a handler can deadlock
        # against Event.wait() in the main thread.
        self.stopping = False

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            print(self._start(), flush=True)
            return self._supervise()
        except StartupError as err:
            print(f"teacher_server: {err}", file=sys.stderr, flush=True)
            return EXIT_FAILED
        finally:
            self._stop_all()

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stopping = True

    # ------------------------------------------------------------------ start-up

    def _start(self) -> str:
        """Start everything; returns the line announcing readiness."""
        t = self.settings.teacher
        if self.join:
            connect = self.join
        else:
            options = FrontendOptions(
                address=t.address,
                replica_address=self.settings.replica_address,
                secret=self.secret,
                max_request_bytes=int(t.max_request_mb * (1 << 20)),
                queue_depth=t.queue_depth,
                replica_timeout_s=t.replica_timeout_s,
            )
            self.frontend = Frontend(options)
            self.frontend.start()
            connect = self.frontend.replica_address
            log.info("frontend on %s, replicas connect to %s", self.frontend.address, connect)
        log.info("replica logs in %s", self.log_dir)
        for slot in self.settings.slots:
            self.children.append(self._spawn(slot, connect))
        self._wait_registered()
        if self.frontend is None:
            return f"JOINED {connect}"
        self._probe_each_replica()
        return f"READY {self.frontend.address} replica_address={self.frontend.replica_address}"

    def _spawn(self, slot: ReplicaSlot, connect: str, restarts: int = 0) -> _Child:
        t = self.settings.teacher
        spec = ReplicaSpec(
            name=slot.name,
            connect=connect,
            backend=t.backend.value if hasattr(t.backend, "value") else str(t.backend),
            options=BackendOptions(
                model_path=t.model_path,
                max_top_k=t.max_top_k,
                max_batch_tokens=t.max_batch_tokens,
                dtype=t.dtype,
                torch_threads=self.settings.server.torch_threads,
                gpus=len(slot.gpu_ids) or 1,
                gpu_memory_utilization=t.gpu_memory_utilization,
                max_model_len=t.max_model_len,
                output=t.output.value if hasattr(t.output, "value") else str(t.output),
                chat_template=t.chat_template,
            ),
            gpu_ids=list(slot.gpu_ids),
            secret_file=t.secret_file,
            parent_pid=os.getpid(),
        )
        log_path = self.log_dir / f"{slot.name}.log"
        log_offset = log_path.stat().st_size if log_path.exists() else 0
        cmd = [sys.executable, "-m", "teacher_server.server.replica", "--spec", msgspec.json.encode(spec).decode()]
        with open(log_path, "ab") as log_file:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(cmd, env=self._child_env(slot), stdout=log_file, stderr=subprocess.STDOUT)
        log.info("replica %s: pid %d, GPUs %s, log %s", slot.name, proc.pid, ",".join(slot.gpu_ids) or "-", log_path)
        return _Child(slot, proc, log_path, log_offset, restarts)

    def _child_env(self, slot: ReplicaSlot) -> dict[str, str]:
        env = dict(os.environ)
        if slot.gpu_ids:
            # --gpu-ids are the node's device ids, already mapped through any CUDA_VISIBLE_DEVICES the
            # trainer met (recipe_gkd.plan.placement.physical_gpu_ids), so they replace this process's mask.
            env["CUDA_VISIBLE_DEVICES"] = ",".join(slot.gpu_ids)
        if self.settings.server.torch_threads:
            env["OMP_NUM_THREADS"] = str(self.settings.server.torch_threads)
        # Never download: the model directory is all a replica may read.
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
        return env

    def _wait_registered(self) -> None:
        deadline = time.monotonic() + self.settings.teacher.ready_timeout_s
        while not self._all_registered():
            if self.stopping:
                raise StartupError("stopped by a signal during start-up")
            for child in self.children:
                if child.proc.poll() is not None:
                    raise StartupError(
                        self._failure(child, f"replica {child.slot.name} exited with code {child.proc.returncode}")
                    )
            if time.monotonic() > deadline:
                slow = [c for c in self.children if not self._registered(c)]
                limit = self.settings.teacher.ready_timeout_s
                what = f"replica {slow[0].slot.name} was not ready within teacher.ready_timeout_s={limit}"
                raise StartupError(self._failure(slow[0], what))
            time.sleep(SUPERVISE_INTERVAL_S)

    def _all_registered(self) -> bool:
        return all(self._registered(c) for c in self.children)

    def _registered(self, child: _Child) -> bool:
        if self.frontend is not None:
            return child.slot.name in self.frontend.replica_names()
        return READY_MARKER in _read_from(child.log_path, child.log_offset)

    def _probe_each_replica(self) -> None:
        """A real scoring round trip through the frontend to every replica before READY."""
        from teacher_server.client.zmq_client import TeacherClient, TeacherError

        assert self.frontend is not None
        t = self.settings.teacher
        # teacher.output=hidden: probe what the trainer will ask (a vllm replica then runs a pooling engine, no top-k).
        hidden = str(getattr(t.output, "value", t.output)) == "hidden"
        probe = {"top_k": 0, "hidden_dtype": t.client.hidden_dtype} if hidden else {"top_k": 1}
        with TeacherClient(
            self.frontend.address, timeout_s=t.timeout_s, retries=0, secret=self.secret, **probe
        ) as client:
            for child in self.children:
                try:
                    client.score([PROBE_SEQUENCE], [1], temperature=1.0, replica=child.slot.name)
                except TeacherError as err:
                    raise StartupError(
                        self._failure(child, f"replica {child.slot.name} failed its probe: {err}")
                    ) from None

    def _failure(self, child: _Child, what: str) -> str:
        lines = _read_from(child.log_path, child.log_offset).splitlines()[-LOG_TAIL_LINES:]
        tail = "\n".join(f"  | {line}" for line in lines)
        return f"{what}; last lines of {child.log_path}:\n{tail}"

    # ------------------------------------------------------------------ steady state

    def _supervise(self) -> int:
        """Restart replicas that die until a signal arrives; fail if the frontend thread died."""
        while True:
            time.sleep(SUPERVISE_INTERVAL_S)
            if self.stopping:  # checked after the sleep: a group SIGTERM also kills the replicas
                return EXIT_OK
            if self.frontend is not None and not self.frontend.alive():
                log.error("the frontend thread died (traceback above): stopping")
                return EXIT_FAILED
            for i, child in enumerate(self.children):
                if child.gave_up or child.proc.poll() is None:
                    continue
                exited = f"replica {child.slot.name} exited with code {child.proc.returncode}"
                if self.frontend is not None:  # its requests go elsewhere now, not after replica_timeout_s
                    self.frontend.replica_exited(child.slot.name)
                if child.restarts >= self.settings.server.max_restarts:
                    log.error("%s; not restarting it (server.max_restarts)", self._failure(child, exited))
                    child.gave_up = True
                    continue
                log.warning("%s: restarting it (%d/%d)", exited, child.restarts + 1, self.settings.server.max_restarts)
                connect = self.join or (self.frontend.replica_address if self.frontend else "")
                self.children[i] = self._spawn(child.slot, connect, child.restarts + 1)
            if all(child.gave_up for child in self.children):
                # Nothing left to serve: exit, so clients hear the server is gone instead of waiting on it.
                log.error(
                    "every replica has exited and none is restarted (server.max_restarts=%d): stopping the server",
                    self.settings.server.max_restarts,
                )
                return EXIT_FAILED

    def _stop_all(self) -> None:
        log.info("stopping %d replicas", len(self.children))
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in self.children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        if self.frontend is not None:
            self.frontend.stop()


def _read_from(path: Path, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")
