"""Standalone ZeroMQ teacher server: scores student rollouts with the teacher's top-k logprobs.

Importing this package imports neither transformers nor vllm (only server/backends/hf.py and
server/backends/vllm.py do, when a replica loads them). The trainer-facing API:

    from teacher_server import TeacherClient, TeacherScores, tokenizer_fingerprint
"""

from teacher_server.client.zmq_client import (
    TeacherClient,
    TeacherDeadError,
    TeacherError,
    TeacherMismatchError,
    TeacherRequestError,
    TeacherTimeoutError,
)
from teacher_server.wire.protocol import PROTOCOL_VERSION, TeacherScores, tokenizer_fingerprint

__all__ = [
    "PROTOCOL_VERSION",
    "TeacherClient",
    "TeacherDeadError",
    "TeacherError",
    "TeacherMismatchError",
    "TeacherRequestError",
    "TeacherScores",
    "TeacherTimeoutError",
    "tokenizer_fingerprint",
]
