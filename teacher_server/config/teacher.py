"""The teacher server's settings: the `teacher` section (of a run preset or a standalone teacher yaml).

The trainer (recipe_gkd/config/schema.py) embeds the same section in its run config and checks it with
the same rules; `ConfigError` is the one error both raise for a bad value, naming the key.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from teacher_server.config.fields import bounded, check_fields, one_of, require


class TeacherBackend(enum.StrEnum):
    vllm = "vllm"
    hf = "hf"
    # Not served by this package: the trainer's client talks to a vLLM OpenAI-compatible server at
    # teacher.address (http://host:port/v1), see teacher_server/client/openai_client.py.
    openai = "openai"


class TeacherOutput(enum.StrEnum):
    """What the teacher server sends per scored token."""

    # Its top-k logprobs and ids, the exact tail and the sampled token's logprob (teacher.top_k).
    topk = "topk"
    # Its final hidden state (16-bit); the actor applies the teacher's output head: the whole vocabulary.
    hidden = "hidden"


class TeacherLocation(enum.StrEnum):
    """Where the teacher's GPUs are: `local` = the GPUs this cluster leaves over, `remote` = elsewhere."""

    local = "local"
    remote = "remote"


@dataclass
class TeacherClientConfig:
    max_inflight: int = bounded(4, ge=1)
    """Concurrent requests the trainer keeps in flight to the server. Not a GPU count."""
    retries: int = bounded(3, ge=0)
    """Times a timed-out request is resent before the client gives up with an error naming teacher.timeout_s."""
    logprob_dtype: str = one_of("float16", ("float16", "float32"))
    """Wire dtype of top-k logprobs: float16 (half the bytes, |error| <= 4e-3 at logprob -16) or float32 (exact)."""
    id_encoding: str = one_of("elias_fano", ("elias_fano", "int32"))
    """Wire encoding of top-k ids: elias_fano (~1.1 B/id at K=256, decoded to int32) or int32."""
    hidden_dtype: str = one_of("bfloat16", ("bfloat16", "float16"))
    """teacher.output=hidden: wire dtype of the hidden states (2 bytes per value, decoded to float32)."""


@dataclass
class TeacherConfig:
    address: str = "tcp://127.0.0.1:5555"
    """Where the teacher server listens (tcp://host:port), or with backend=openai the server's http://host:port/v1."""
    autostart: bool = False
    """Start the server from the driver (CPU demo). On GPU clusters use launch/start_teacher.sh."""
    location: TeacherLocation = TeacherLocation.local
    """local: the teacher runs on the GPUs this cluster leaves over; remote: on another host (no GPU may be left
    over)."""
    backend: TeacherBackend = TeacherBackend.vllm
    """vllm or hf: the ZeroMQ teacher server's engine; openai: a vLLM OpenAI-compatible server you run."""
    model_path: str = ""
    """The teacher model: a local HF directory or a hub id read from the Hugging Face cache."""
    replicas: int = bounded(1, ge=1)
    """Teacher replicas; replicas x gpus_per_replica must equal the teacher GPUs of the split."""
    gpus_per_replica: int = bounded(1, ge=1)
    """GPUs of one replica (vLLM tensor parallel); a replica stays on one node."""
    output: TeacherOutput = TeacherOutput.topk
    """topk: the teacher's top-k logprobs per scored token (teacher.top_k); hidden: its final hidden state (after its
    final norm), from which the actor computes the teacher's whole distribution with the teacher's output head,
    loaded from teacher.model_path (2 x hidden_size bytes per token; every divergence exact over the vocabulary; hf
    or vllm backend, the vllm one running a pooling-mode engine; the teacher's tokenizer must be the student's,
    heads padded differently over it are compared over the ids both have).
    See docs/objectives.md."""
    top_k: int = bounded(64, ge=0, note="0: the sampled token's logprob only")
    """Teacher logprobs sent per scored token (its top-k); 0: only the logprob of the token at each position
    (algorithm.divergence=sampled_reverse_kl; ~4 bytes/token)."""
    max_top_k: int = bounded(256, ge=1)
    """The largest top_k the server will return; the handshake reports the server's value."""
    temperature: float = bounded(1.0, gt=0)
    """Temperature the teacher scores at; must equal algorithm.temperature (vllm and openai: 1 only)."""
    timeout_s: float = bounded(300.0, gt=0)
    """A request unanswered this long is resent (up to teacher.client.retries times); nothing heard from the
    server this long: the teacher is down."""
    client: TeacherClientConfig = field(default_factory=TeacherClientConfig)
    """The trainer's client: its concurrency, retries and wire formats."""
    secret_file: str = ""
    """File holding a shared secret that clients and replicas present; required for a non-loopback address."""
    api_key_file: str = ""
    """backend=openai: file holding the server's API key (vllm serve --api-key), sent as a Bearer token."""
    max_request_mb: float = bounded(64.0, gt=0)
    """The server answers `too_large` to bigger requests; clients split their batches below it."""
    max_batch_tokens: int = bounded(8192, ge=1)
    """hf backend: padded tokens (rows x longest sequence) per forward pass."""
    queue_depth: int = bounded(8, ge=1)
    """Requests queued per replica before the server answers `busy` instead of growing memory."""
    ready_timeout_s: float = bounded(600.0, gt=0)
    """The server stops, naming this key, if a replica has not loaded and answered a probe by then (a 70B teacher
    read from network storage can take longer); an autostarted server gets this plus 120 s from the driver."""
    replica_timeout_s: float = bounded(30.0, gt=0)
    """A replica silent (no heartbeat) this long is dropped and its requests are retried elsewhere."""
    dtype: str = one_of("auto", ("auto", "float32", "bfloat16", "float16"))
    """Teacher weights: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16."""
    gpu_memory_utilization: float = bounded(0.9, gt=0, le=1)
    """vllm backend: fraction of each replica GPU's memory for weights + KV cache."""
    chat_template: str = ""
    """algorithm.cross_tokenizer: a Jinja chat template file the server (with backend=openai, the client) renders
    conversations with instead of its tokenizer's own (for a tokenizer that ships none, or a template that refuses
    the data's roles); empty: its own."""
    max_model_len: int = bounded(0, ge=0, note="0: the model's own")
    """vllm backend: vLLM's max_model_len, at least the longest sequence (prompt + response) a replica scores plus
    VLLM_LEN_MARGIN (1); 0 takes the model's own maximum."""
    prompt_key: str = ""
    """The trainer's side: the record field holding this teacher's own prompt (data.teacher_prompt_key for this
    teacher only; docs/privileged_teacher.md); empty: data's rule."""
    prompt_template: str = ""
    """The trainer's side: this teacher's prompt as a template over the record (data.teacher_prompt_template for
    this teacher only); empty: data's rule."""


# vLLM scores a sequence as a prompt and then samples one token after it, so a sequence must be
# shorter than max_model_len: vllm/v1/engine/input_processor.py `_validate_prompt_len` (0.24.0,
# 0.33.0) and the one sampled token's slot. teacher_server/server/backends/vllm.py refuses it first.
VLLM_LEN_MARGIN = 1


def min_vllm_model_len(longest_sequence: int) -> int:
    """The smallest vLLM max_model_len that scores sequences of `longest_sequence` tokens."""
    return longest_sequence + VLLM_LEN_MARGIN


def validate_teacher_section(t: TeacherConfig) -> None:
    """The rules of the `teacher` section alone (also used for standalone configs/teacher/*.yaml)."""
    check_fields(t, "teacher")
    require(t.top_k <= t.max_top_k, "teacher.top_k", f"top_k={t.top_k} exceeds teacher.max_top_k={t.max_top_k}")
    # Hidden states do not depend on the temperature (the actor applies algorithm.temperature to the logits).
    require(
        t.backend == TeacherBackend.hf or t.temperature == 1.0 or t.output == TeacherOutput.hidden,
        "teacher.temperature",
        f"is {t.temperature} but the {t.backend.value} teacher backend scores at temperature 1 only (vLLM returns "
        "the top-k of the T=1 distribution, from which another temperature cannot be recovered); use teacher.backend=hf",
    )
    require(
        t.output == TeacherOutput.topk or t.backend != TeacherBackend.openai,
        "teacher.output",
        "=hidden needs this project's teacher server (teacher.backend=hf or vllm): a server behind "
        "teacher.backend=openai returns logprobs only; or set teacher.output=topk",
    )
    if t.backend == TeacherBackend.openai:
        require(
            t.address.startswith(("http://", "https://")),
            "teacher.address",
            f"teacher.backend=openai talks to an OpenAI-compatible server: an address like http://127.0.0.1:8000/v1, "
            f"got {t.address!r}",
        )
        require(
            not t.autostart,
            "teacher.autostart",
            "teacher.backend=openai uses a server you start (vllm serve MODEL --max-logprobs K): set "
            "teacher.autostart=false",
        )
        return
    require(
        not t.api_key_file,
        "teacher.api_key_file",
        "is for teacher.backend=openai; the ZeroMQ server uses teacher.secret_file",
    )
    require(
        t.address.startswith(("tcp://", "ipc://")),
        "teacher.address",
        f"must be a ZeroMQ address like tcp://127.0.0.1:5555 (or teacher.backend=openai for http://), got {t.address!r}",
    )
