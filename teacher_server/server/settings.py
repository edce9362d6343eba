"""What `python -m teacher_server --config PATH` serves: the teacher section, server knobs, replica slots.

PATH is either a run preset (configs/presets/*.yaml: the whole GKD config, of which the server
reads the `teacher:` section only) or a standalone teacher yaml (configs/teacher/*.yaml: a
`teacher:` section plus an optional `server:` section). `key=value` overrides apply to either
(`teacher.*` and `server.*` keys). A preset's teacher GPUs on a node are what the trainer's
placement plan leaves over: launch/start_teacher.sh asks the plan
(`python -m recipe_gkd.plan.placement --print teacher-gpus`) and passes them as --gpu-ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from teacher_server.config.errors import ConfigError
from teacher_server.config.teacher import TeacherBackend, TeacherConfig, TeacherLocation, validate_teacher_section

STANDALONE_KEYS = frozenset({"teacher", "server"})
PLACEMENT_COMMAND = "python -m recipe_gkd.plan.placement --config PRESET --node-rank N --print teacher-gpus"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
# Server keys that moved to the teacher section (a run sets them there too): named in the unknown-key error.
MOVED_KEYS = {"server.ready_timeout_s": "teacher.ready_timeout_s"}


@dataclass
class ServerSection:
    """Server-only knobs (the `server:` section of a standalone yaml, `server.*` overrides of `python -m teacher_server`
    and launch/start_teacher.sh); a run's config has no `server:` section."""

    gpu_ids: list[str] = field(default_factory=list)
    """Node-local GPU ids for this node's replicas, split by teacher.gpus_per_replica: what each replica's
    CUDA_VISIBLE_DEVICES gets, so indices or the UUIDs of a UUID mask (GPU-..., MIG-...). Empty:
    0..replicas*gpus_per_replica-1 (a teacher yaml, or a preset whose teacher is remote); a preset with a local
    teacher needs them (launch/start_teacher.sh passes the plan's)."""
    replica_address: str = ""
    """Where replicas connect (and `--join` points). Empty: teacher.address with port + 1 (an ephemeral port when
    teacher.address has port 0)."""
    torch_threads: int = 0
    """Intra-op threads per replica on CPU; 0 keeps torch's default."""
    log_dir: str = ""
    """Replica logs; empty: a new temporary directory (printed at start)."""
    max_restarts: int = 3
    """A replica that dies is restarted at most this many times."""


@dataclass
class TeacherFile:
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    server: ServerSection = field(default_factory=ServerSection)


@dataclass(frozen=True)
class ReplicaSlot:
    name: str
    node: int
    gpu_ids: tuple[str, ...]


@dataclass(frozen=True)
class ServerSettings:
    teacher: TeacherConfig
    server: ServerSection
    node_rank: int
    slots: tuple[ReplicaSlot, ...]

    @property
    def replica_address(self) -> str:
        return self.server.replica_address or derive_replica_address(self.teacher.address)


def load_settings(
    path: str | Path, overrides: Sequence[str] = (), *, node_rank: int = 0, teacher: str = ""
) -> ServerSettings:
    """Load a preset or standalone teacher yaml plus overrides. Raises ConfigError naming the key.

    `teacher`: of a run preset with `teachers:` (several teachers), the one to serve (--teacher NAME).
    """
    yaml_path = Path(path)
    if not yaml_path.is_file():
        raise ConfigError("--config", f"no such file {yaml_path}")
    raw = OmegaConf.load(yaml_path)
    keys = set(raw.keys()) if hasattr(raw, "keys") else set()
    preset = bool(keys - STANDALONE_KEYS)
    for override in overrides:
        key = override.partition("=")[0]
        if key.split(".")[0] not in STANDALONE_KEYS:
            raise ConfigError(key, "the teacher server takes teacher.* and server.* keys only")
    if preset:
        # A run preset: its teacher section (or teacher `teacher`'s of `teachers:`); the rest is the trainer's.
        raw = OmegaConf.create({"teacher": _preset_teacher(raw, teacher, yaml_path)})
    elif teacher:
        raise ConfigError("--teacher", f"{yaml_path} is a teacher yaml (one teacher): leave --teacher out")
    loaded = _load_standalone(raw, list(overrides), str(yaml_path))
    teacher, server = loaded.teacher, loaded.server
    _validate_server(server, teacher)
    if preset and teacher.location == TeacherLocation.local and not server.gpu_ids:
        raise ConfigError(
            "--gpu-ids",
            f"{yaml_path} is a run preset whose teacher takes the GPUs the trainer leaves over on each node: start "
            f"it with launch/start_teacher.sh (which asks `{PLACEMENT_COMMAND}`) or pass those ids as --gpu-ids",
        )
    return ServerSettings(teacher, server, node_rank, _slots(teacher, server, node_rank))


def _preset_teacher(raw: Any, name: str, path: Path) -> Any:
    """The section a run preset's server serves: `teacher:`, or `teachers: NAME:` (--teacher NAME)."""
    teachers = raw.get("teachers") or {}
    if not teachers:
        if name and name != "default":
            raise ConfigError("--teacher", f"{path} has one teacher (`teacher:`, named default), not {name!r}")
        return raw.get("teacher") or {}
    if name not in teachers:
        raise ConfigError(
            "--teacher",
            f"{path} has several teachers {list(teachers)}: start each with --teacher NAME"
            + (f" ({name!r} is not one of them)" if name else ""),
        )
    return teachers[name]


def load_teacher_file(path: str | Path, overrides: Sequence[str] = ()) -> TeacherFile:
    """A standalone configs/teacher/*.yaml, validated."""
    loaded = _load_standalone(OmegaConf.load(Path(path)), list(overrides), str(path))
    _validate_server(loaded.server, loaded.teacher)
    return loaded


def _load_standalone(raw: object, overrides: list[str], source: str) -> TeacherFile:
    schema = OmegaConf.structured(TeacherFile)
    try:
        merged = OmegaConf.merge(schema, raw, OmegaConf.from_dotlist(overrides))
    except ConfigKeyError as err:
        key = str(getattr(err, "full_key", "") or "?")
        moved = f"; it is {MOVED_KEYS[key]} now" if key in MOVED_KEYS else ""
        raise ConfigError(
            key, f"unknown key (from {source}){moved}; teacher yamls hold `teacher:` and `server:` sections"
        ) from None
    except OmegaConfBaseException as err:
        key = str(getattr(err, "full_key", "") or "?")
        raise ConfigError(key, f"{str(err).strip().splitlines()[0]} (from {source})") from None
    loaded: TeacherFile = OmegaConf.to_object(merged)  # type: ignore[assignment]
    validate_teacher_section(loaded.teacher)
    return loaded


def _validate_server(server: ServerSection, teacher: TeacherConfig) -> None:
    if teacher.backend == TeacherBackend.openai:
        raise ConfigError(
            "teacher.backend",
            "openai is a server you run yourself (vllm serve MODEL --max-logprobs K) that the trainer talks to "
            "directly; this server serves teacher.backend=hf or vllm",
        )
    if server.torch_threads < 0:
        raise ConfigError("server.torch_threads", f"must be >= 0, got {server.torch_threads}")
    if server.max_restarts < 0:
        raise ConfigError("server.max_restarts", f"must be >= 0, got {server.max_restarts}")
    if server.gpu_ids and len(server.gpu_ids) % teacher.gpus_per_replica:
        raise ConfigError(
            "server.gpu_ids",
            f"{len(server.gpu_ids)} GPU ids do not split into replicas of teacher.gpus_per_replica={teacher.gpus_per_replica}",
        )
    if server.replica_address and not server.replica_address.startswith(("tcp://", "ipc://")):
        raise ConfigError("server.replica_address", f"must be a ZeroMQ address, got {server.replica_address!r}")


def _slots(teacher: TeacherConfig, server: ServerSection, node_rank: int) -> tuple[ReplicaSlot, ...]:
    gpr = teacher.gpus_per_replica
    if server.gpu_ids:
        groups = [tuple(server.gpu_ids[i : i + gpr]) for i in range(0, len(server.gpu_ids), gpr)]
    else:
        groups = [tuple(str(g) for g in range(r * gpr, (r + 1) * gpr)) for r in range(teacher.replicas)]
    return tuple(ReplicaSlot(f"n{node_rank}-r{i}", node_rank, g) for i, g in enumerate(groups))


def derive_replica_address(address: str) -> str:
    """The replica endpoint next to a client endpoint: port + 1 (0 stays 0), or `<path>-replicas` for ipc."""
    if address.startswith("ipc://"):
        return address + "-replicas"
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + 1 if int(port) else 0}"


def with_port(address: str, port: int) -> str:
    host, _, _ = address.rpartition(":")
    return f"{host}:{port}"


def is_loopback(address: str) -> bool:
    """True for ipc:// and for tcp on a loopback host (the only binds allowed without a secret)."""
    if address.startswith("ipc://"):
        return True
    host = address.removeprefix("tcp://").rpartition(":")[0]
    return host in LOOPBACK_HOSTS
