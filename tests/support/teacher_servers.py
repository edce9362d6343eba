"""A standalone teacher server for tests: its yaml (loopback, ephemeral port) and the limits the tests size against."""

from __future__ import annotations

from pathlib import Path

import msgspec

VOCAB = 102
MAX_TOP_K = 64
# Small, so that the fuzzer's "huge" frames stay cheap: 256 KiB (libzmq drops frames above 4x).
MAX_REQUEST_MB = 0.25
READY_TIMEOUT_S = 180.0


def write_teacher_yaml(path: Path, model_dir: Path, **teacher: object) -> Path:
    """A standalone teacher yaml for tests: loopback, ephemeral port."""
    fields: dict[str, object] = dict(
        address="tcp://127.0.0.1:0",
        backend="hf",
        model_path=str(model_dir),
        replicas=1,
        top_k=8,
        max_top_k=MAX_TOP_K,
        timeout_s=60,
        max_request_mb=MAX_REQUEST_MB,
        replica_timeout_s=5,
    )
    fields.update(teacher)
    path.write_text(msgspec.json.encode({"teacher": fields, "server": {"log_dir": str(path.parent / "logs")}}).decode())
    return path
