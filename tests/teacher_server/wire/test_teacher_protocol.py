"""The teacher wire protocol, id codec, HF backend numerics and teacher config, without servers."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
from repo_paths import REPO_ROOT

from recipe_gkd.config import ConfigError, load_config
from teacher_server.client.zmq_client import split_balanced
from teacher_server.server.backends import token_budget_groups
from teacher_server.server.settings import derive_replica_address, load_settings, load_teacher_file
from teacher_server.wire import idcodec
from teacher_server.wire import protocol as P
from teacher_server.wire.score_frames import (
    RequestLimits,
    parse_score_reply,
    parse_score_request,
    reply_frames,
    request_frames,
)

VOCAB = 102


def test_import_teacher_server_imports_no_engine() -> None:
    code = (
        "import sys, teacher_server, teacher_server.wire.protocol, teacher_server.client.zmq_client, teacher_server.server.frontend, "
        "teacher_server.client.launcher, teacher_server.server.settings, teacher_server.server.supervisor, teacher_server.server.replica, "
        "teacher_server.server.backends, teacher_server.__main__\n"
        "print(sorted(m for m in ('vllm', 'transformers', 'torch') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT, check=True
    )
    assert out.stdout.strip() == "[]"


class _FakeTokenizer:
    def __init__(self, vocab: dict[str, int], special: list[str]) -> None:
        self._vocab = vocab
        self.all_special_tokens = special

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)


def test_tokenizer_fingerprint_is_stable_and_sensitive(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert P.tokenizer_fingerprint(tok) == P.tokenizer_fingerprint(AutoTokenizer.from_pretrained(tiny_model_dir))
    base = _FakeTokenizer({"a": 0, "b": 1}, ["<s>"])
    assert P.tokenizer_fingerprint(base) == P.tokenizer_fingerprint(_FakeTokenizer({"b": 1, "a": 0}, ["<s>"]))
    assert P.tokenizer_fingerprint(base) != P.tokenizer_fingerprint(_FakeTokenizer({"a": 1, "b": 0}, ["<s>"]))
    assert P.tokenizer_fingerprint(base) != P.tokenizer_fingerprint(_FakeTokenizer({"a": 0, "b": 1}, ["<pad>"]))


# ----------------------------------------------------------------------------- id codec


@pytest.mark.parametrize(
    ("vocab", "top_k"), [(32000, 256), (32000, 64), (102, 102), (102, 1), (2, 1), (7, 3), (65536, 64), (152064, 256)]
)
def test_elias_fano_roundtrip(vocab: int, top_k: int) -> None:
    rng = np.random.default_rng(vocab + top_k)
    ids = np.stack([rng.choice(vocab, top_k, replace=False) for _ in range(33)]).astype(np.int32)
    buf = idcodec.encode(ids, vocab)
    assert len(buf) == 33 * idcodec.row_bytes(vocab, top_k)
    decoded = idcodec.decode(buf, 33, top_k, vocab)
    assert decoded.dtype == np.int32
    np.testing.assert_array_equal(decoded, np.sort(ids, axis=1))


def test_elias_fano_rejects_corrupt_blocks() -> None:
    ids = np.array([[3, 9, 1], [0, 5, 7]], dtype=np.int32)
    buf = bytearray(idcodec.encode(ids, 10))
    with pytest.raises(ValueError, match="expected"):
        idcodec.decode(bytes(buf[:-1]), 2, 3, 10)
    buf[-1] ^= 0xFF
    with pytest.raises(ValueError, match="corrupt"):
        idcodec.decode(bytes(buf), 2, 3, 10)


# ----------------------------------------------------------------------------- replies


def _random_batch(rng: np.random.Generator, n_scored: list[int], top_k: int, vocab: int) -> P.TopKBatch:
    rows = sum(n_scored)
    logits = rng.standard_normal((rows, vocab)) * 3
    logprobs = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    ids = np.argsort(-logprobs, axis=1)[:, :top_k].astype(np.int32)
    values = np.take_along_axis(logprobs, ids, axis=1).astype(np.float32)
    values, ids = P.canonical_order(values, ids)
    sampled = logprobs[np.arange(rows), rng.integers(0, vocab, rows)].astype(np.float32)
    return P.TopKBatch(np.asarray(n_scored), values, ids, sampled, P.tail_from_topk(values))


@pytest.mark.parametrize("logprob_dtype", ["float32", "float16"])
@pytest.mark.parametrize("id_encoding", ["int32", "elias_fano"])
def test_reply_roundtrip(logprob_dtype: str, id_encoding: str) -> None:
    batch = _random_batch(np.random.default_rng(0), [3, 0, 5, 1], top_k=16, vocab=300)
    frames = reply_frames(7, batch, vocab_size=300, logprob_dtype=logprob_dtype, id_encoding=id_encoding)
    header = P.decode_server_reply(frames[0])
    assert isinstance(header, P.ScoreReply) and header.request_id == 7
    out = parse_score_reply(header, frames[1:])
    assert out.topk_logprobs.dtype == np.float32 and out.topk_ids.dtype == np.int32
    np.testing.assert_array_equal(out.n_scored, batch.n_scored)
    np.testing.assert_array_equal(out.sampled_logprob, batch.sampled_logprob)
    np.testing.assert_array_equal(out.tail_logmass, batch.tail_logmass)
    if logprob_dtype == "float32":
        np.testing.assert_array_equal(out.topk_ids, batch.topk_ids)
        np.testing.assert_array_equal(out.topk_logprobs, batch.topk_logprobs)
    else:
        np.testing.assert_array_equal(np.sort(out.topk_ids, axis=1), np.sort(batch.topk_ids, axis=1))
        np.testing.assert_allclose(out.topk_logprobs, batch.topk_logprobs, rtol=2**-10, atol=1e-6)
        assert np.all(np.diff(out.topk_logprobs, axis=1) <= 0)
    assert [p.n_scored for p in out.split()] == [3, 0, 5, 1]


def test_wire_bytes_per_token_meet_the_goal_at_k256() -> None:
    batch = _random_batch(np.random.default_rng(1), [64], top_k=256, vocab=32000)
    frames = reply_frames(1, batch, vocab_size=32000, logprob_dtype="float16", id_encoding="elias_fano")
    assert sum(len(f) for f in frames[1:]) / 64 <= 1024


@pytest.mark.parametrize("id_encoding", ["int32", "elias_fano"])
def test_top_k_zero_sends_four_bytes_per_token(id_encoding: str) -> None:
    """teacher.top_k=0: only the sampled token's logprob travels; the tail comes back as log 1 = 0."""
    batch = _random_batch(np.random.default_rng(2), [40, 0, 24], top_k=0, vocab=32000)
    frames = reply_frames(3, batch, vocab_size=32000, logprob_dtype="float16", id_encoding=id_encoding)
    assert sum(len(f) for f in frames[1:]) == 4 * 64
    header = P.decode_server_reply(frames[0])
    out = parse_score_reply(header, frames[1:])
    assert out.topk_ids.shape == (64, 0) and out.topk_logprobs.shape == (64, 0)
    np.testing.assert_array_equal(out.sampled_logprob, batch.sampled_logprob)
    np.testing.assert_array_equal(out.tail_logmass, np.zeros(64, np.float32))
    assert [p.n_scored for p in out.split()] == [40, 0, 24]


@pytest.mark.parametrize("id_encoding", ["int32", "elias_fano"])
def test_named_ids_roundtrip_and_cost_per_scored_token(id_encoding: str) -> None:
    """Named ids: 4 bytes per id up, 4 per id + 4 (the rest's log-mass) down, per scored token."""
    rng = np.random.default_rng(5)
    n_scored, top_k, k_s, vocab = [6, 0, 9], 8, 8, 300
    full = np.log(rng.dirichlet(np.ones(vocab), size=sum(n_scored)))
    named = rng.integers(0, vocab, size=(sum(n_scored), k_s)).astype(np.int32)
    ref = P.scores_from_logprobs(full, np.zeros(sum(n_scored), np.int64), top_k, named_ids_NS=named)
    batch = P.TopKBatch(np.asarray(n_scored), *[getattr(ref, f) for f in P.TeacherScores.__dataclass_fields__])
    plain = P.TopKBatch(
        *[getattr(batch, f) for f in ("n_scored", "topk_logprobs", "topk_ids")],
        batch.sampled_logprob,
        batch.tail_logmass,
    )
    kwargs = dict(vocab_size=vocab, logprob_dtype="float16", id_encoding=id_encoding)
    frames = reply_frames(4, batch, **kwargs)
    extra = sum(map(len, frames[1:])) - sum(map(len, reply_frames(4, plain, **kwargs)[1:]))
    assert extra == (4 * k_s + 4) * sum(n_scored)
    out = parse_score_reply(P.decode_server_reply(frames[0]), frames[1:])
    np.testing.assert_array_equal(out.named_logprobs, batch.named_logprobs)
    np.testing.assert_array_equal(out.other_logmass, batch.other_logmass)
    assert [p.named_logprobs.shape for p in out.split()] == [(6, k_s), (0, k_s), (9, k_s)]
    # The request: the named ids as one int32 frame after the tokens, parsed back per position.
    seqs = [np.arange(1, n + 3) for n in n_scored]
    per_seq = np.split(named, np.cumsum(n_scored)[:-1])
    req = request_frames(1, seqs, [2] * 3, top_k=top_k, temperature=1.0, named_ids=per_seq)
    assert len(req[2]) == 4 * k_s * sum(n_scored)
    limits = RequestLimits(vocab, 64, 1 << 20, max_named_ids=k_s)
    parsed = parse_score_request(P.decode_client_message(req[0]), req[1:], limits)
    np.testing.assert_array_equal(parsed.named_ids, named)
    # The vllm backend's rest from values alone equals the exact one (each id counted once).
    other = P.other_from_union(ref.topk_logprobs, ref.topk_ids, ref.named_logprobs, named)
    np.testing.assert_allclose(other, ref.other_logmass, atol=1e-5)


@pytest.mark.parametrize(("hidden_dtype", "half_ulp"), [("bfloat16", 2.0**-8), ("float16", 2.0**-11)])
def test_hidden_states_roundtrip_at_two_bytes_per_value(hidden_dtype: str, half_ulp: float) -> None:
    """teacher.output=hidden: one more reply frame of 2 bytes per value; values round to nearest, exact once rounded."""
    from teacher_server.wire import hidden_codec

    rng = np.random.default_rng(8)
    n_scored, hidden = [5, 0, 3], 48
    values = rng.standard_normal((sum(n_scored), hidden)).astype(np.float32) * 3
    batch = _random_batch(rng, n_scored, top_k=0, vocab=300)
    with_hidden = dataclasses.replace(batch, hidden_states=values)
    kwargs = dict(vocab_size=300, logprob_dtype="float16", id_encoding="int32")
    frames = reply_frames(2, with_hidden, hidden_dtype=hidden_dtype, **kwargs)
    assert len(frames) == len(reply_frames(2, batch, **kwargs)) + 1 and len(frames[-1]) == 2 * hidden * 8
    out = parse_score_reply(P.decode_server_reply(frames[0]), frames[1:])
    assert out.hidden_states is not None and out.hidden_states.dtype == np.float32
    assert np.all(np.abs(out.hidden_states - values) <= half_ulp * np.abs(values))
    np.testing.assert_array_equal(hidden_codec.round_to(values, hidden_dtype), out.hidden_states)
    np.testing.assert_array_equal(hidden_codec.round_to(out.hidden_states, hidden_dtype), out.hidden_states)
    assert [p.hidden_states.shape for p in out.split()] == [(5, hidden), (0, hidden), (3, hidden)]
    # bf16 ties round to even: 1 + 2^-8 (halfway between 1 and 1 + 2^-7) -> 1.
    if hidden_dtype == "bfloat16":
        assert hidden_codec.round_to(np.asarray([[1 + 2.0**-8]], np.float32), "bfloat16")[0, 0] == 1.0
    # A request for hidden states from a server that sends none is refused for that request only.
    req = request_frames(1, [np.arange(1, 5)], [2], top_k=0, temperature=1.0, hidden_dtype=hidden_dtype)
    with pytest.raises(P.ProtocolError, match="no hidden states"):
        parse_score_request(P.decode_client_message(req[0]), req[1:], RequestLimits(300, 64, 1 << 20))
    parsed = parse_score_request(
        P.decode_client_message(req[0]), req[1:], RequestLimits(300, 64, 1 << 20, hidden_size=hidden)
    )
    assert parsed.hidden_dtype == hidden_dtype


def test_a_hello_reply_of_an_older_server_offers_no_named_ids() -> None:
    """Named ids are optional fields of protocol 1: a handshake without max_named_ids reads as 0."""
    fields = {
        f: getattr(P.HelloReply(1, 1, "s", "m", 10, "h", 8, [], [], 1, 1, "hf", True), f)
        for f in P.HelloReply.__struct_fields__
        if f != "max_named_ids"
    }
    reply = P.decode_server_reply(msgspec.msgpack.encode({"type": "hello_reply", **fields}))
    assert isinstance(reply, P.HelloReply) and reply.max_named_ids == 0


def test_tail_from_topk_matches_float64() -> None:
    probs = np.array([[0.5, 0.3], [0.9999, 1e-5], [1.0 - 1e-12, 1e-12]])
    expected = np.log(1.0 - probs[:2].sum(axis=1))
    got = P.tail_from_topk(np.log(probs))
    np.testing.assert_allclose(got[:2], expected, rtol=1e-5)
    assert got[2] == -math.inf or got[2] < -25


# ----------------------------------------------------------------------------- requests


def _request(**changes: object) -> tuple[P.ScoreRequest, list[bytes]]:
    fields = dict(version=P.PROTOCOL_VERSION, request_id=1, lengths=[3, 2], score_from=[1, 2], top_k=4, temperature=1.0)
    ids = changes.pop("ids", np.array([1, 2, 3, 4, 5], dtype=np.int32))
    fields.update(changes)
    return P.ScoreRequest(**fields), [np.asarray(ids, dtype=np.int32).tobytes()]  # type: ignore[arg-type]


LIMITS = RequestLimits(vocab_size=VOCAB, max_top_k=64, max_request_bytes=1 << 20, supports_temperature=False)


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"version": 99}, P.ErrorCode.VERSION),
        ({"lengths": [], "score_from": [], "ids": []}, P.ErrorCode.BAD_REQUEST),
        ({"lengths": [5, 0], "ids": [1, 2, 3, 4, 5]}, P.ErrorCode.BAD_REQUEST),
        ({"score_from": [0, 2]}, P.ErrorCode.BAD_REQUEST),
        ({"score_from": [1, 3]}, P.ErrorCode.BAD_REQUEST),
        ({"score_from": [1]}, P.ErrorCode.BAD_REQUEST),
        ({"ids": [1, 2, 3, 4]}, P.ErrorCode.BAD_REQUEST),
        ({"ids": [1, 2, -3, 4, 5]}, P.ErrorCode.BAD_REQUEST),
        ({"ids": [1, 2, 3, 4, VOCAB]}, P.ErrorCode.BAD_REQUEST),
        ({"top_k": -1}, P.ErrorCode.BAD_REQUEST),
        ({"top_k": 65}, P.ErrorCode.BAD_REQUEST),
        ({"temperature": 0.0}, P.ErrorCode.BAD_REQUEST),
        ({"temperature": float("nan")}, P.ErrorCode.BAD_REQUEST),
        ({"temperature": 0.5}, P.ErrorCode.UNSUPPORTED),
        ({"logprob_dtype": "bfloat8"}, P.ErrorCode.BAD_REQUEST),
        ({"id_encoding": "zip"}, P.ErrorCode.BAD_REQUEST),
    ],
)
def test_parse_score_request_rejects(changes: dict[str, object], code: str) -> None:
    request, frames = _request(**changes)
    with pytest.raises(P.ProtocolError) as err:
        parse_score_request(request, frames, LIMITS)
    assert err.value.code == code


def test_parse_score_request_accepts_and_splits() -> None:
    request, frames = _request()
    parsed = parse_score_request(request, frames, LIMITS)
    assert [s.tolist() for s in parsed.sequences()] == [[1, 2, 3], [4, 5]]


def test_undecodable_headers_are_protocol_errors() -> None:
    for frame in (b"", b"\xc1", b"\x93\x01\x02\x03", P.encode(P.Pong(1, "x")), b"x" * (P.MAX_HEADER_BYTES + 1)):
        with pytest.raises(P.ProtocolError):
            P.decode_client_message(frame)


# ----------------------------------------------------------------------------- batching helpers


def test_token_budget_groups_respect_the_budget() -> None:
    lengths = np.array([5, 40, 7, 40, 1, 100])
    groups = token_budget_groups(lengths, max_batch_tokens=80)
    assert sorted(np.concatenate(groups).tolist()) == list(range(6))
    for group in groups:
        assert len(group) == 1 or len(group) * lengths[group].max() <= 80


def test_split_balanced() -> None:
    assert split_balanced([10] * 8, 4, 1000) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert split_balanced([10] * 8, 1, 25) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert split_balanced([1, 1, 1, 100], 4, 1000) == [(0, 3), (3, 4)]
    assert split_balanced([500], 4, 10) == [(0, 1)]


# ----------------------------------------------------------------------------- HF backend numerics


def _reference(model: object, seq: np.ndarray, start: int, temperature: float) -> np.ndarray:
    """Float64 full-vocabulary log-probabilities of positions start..len-1 (one unpadded forward)."""
    import torch

    with torch.no_grad():
        logits = model(torch.as_tensor(seq[None], dtype=torch.long)).logits[0].double()  # type: ignore[operator]
    return torch.log_softmax(logits / temperature, dim=-1)[start - 1 : seq.size - 1].numpy()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_backend_matches_float64_reference(tiny_model_dir: Path, temperature: float) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from teacher_server.server.backends import BackendOptions, load_backend, parsed_request

    top_k = 16
    # A small token budget forces several padded groups.
    backend = load_backend("hf", BackendOptions(str(tiny_model_dir), max_top_k=64, max_batch_tokens=64))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, VOCAB, size=n).astype(np.int32) for n in (9, 33, 2, 20, 17)]
    starts = [4, 1, 2, 19, 17]
    out = backend.score(parsed_request(seqs, starts, top_k=top_k, temperature=temperature)).split()
    for seq, start, got in zip(seqs, starts, out, strict=True):
        assert got.n_scored == seq.size - start  # only positions >= score_from are scored
        if got.n_scored == 0:
            continue
        ref = _reference(model, seq, start, temperature)
        # Logprobs of the returned ids, the sampled token and the tail against float64.
        np.testing.assert_allclose(got.topk_logprobs, np.take_along_axis(ref, got.topk_ids.astype(int), 1), atol=1e-5)
        np.testing.assert_allclose(got.sampled_logprob, ref[np.arange(got.n_scored), seq[start:]], atol=1e-5)
        rest = ref.copy()
        np.put_along_axis(rest, got.topk_ids.astype(int), -np.inf, axis=1)
        np.testing.assert_allclose(got.tail_logmass, np.logaddexp.reduce(rest, axis=1), atol=1e-5)
        # The returned ids are the reference top-k wherever the k-th/(k+1)-th gap is resolvable.
        ref_sorted = -np.sort(-ref, axis=1)
        clear = ref_sorted[:, top_k - 1] - ref_sorted[:, top_k] > 1e-5
        ref_ids = np.argsort(-ref, axis=1)[:, :top_k]
        np.testing.assert_array_equal(np.sort(got.topk_ids[clear], 1), np.sort(ref_ids[clear], 1))
        assert np.all(np.diff(got.topk_logprobs, axis=1) <= 0)


def test_hf_backend_top_k_zero_scores_the_sampled_tokens(tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from teacher_server.server.backends import BackendOptions, load_backend, parsed_request

    backend = load_backend("hf", BackendOptions(str(tiny_model_dir), max_top_k=64, max_batch_tokens=64))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rng = np.random.default_rng(4)
    seqs = [rng.integers(0, VOCAB, size=n).astype(np.int32) for n in (9, 21, 3)]
    starts = [4, 1, 3]
    out = backend.score(parsed_request(seqs, starts, top_k=0)).split()
    for seq, start, got in zip(seqs, starts, out, strict=True):
        assert got.topk_ids.shape == (seq.size - start, 0)
        if got.n_scored == 0:
            continue
        ref = _reference(model, seq, start, 1.0)
        np.testing.assert_allclose(got.sampled_logprob, ref[np.arange(got.n_scored), seq[start:]], atol=1e-5)
        np.testing.assert_array_equal(got.tail_logmass, np.zeros(got.n_scored, np.float32))


# ----------------------------------------------------------------------------- config


def test_every_teacher_yaml_loads() -> None:
    paths = sorted((REPO_ROOT / "configs" / "teacher").glob("*.yaml"))
    assert paths
    for path in paths:
        loaded = load_teacher_file(path)
        assert loaded.teacher.model_path


def test_preset_gives_replica_gpu_ids_per_node(capsys: pytest.CaptureFixture[str]) -> None:
    """launch/start_teacher.sh asks the trainer's plan for a preset's teacher GPUs; the server splits them."""
    from recipe_gkd.plan.placement import main as placement_cli

    preset = REPO_ROOT / "configs" / "presets" / "2x8_a8_r4_t4.yaml"
    args = ["teacher-argv", "--config", str(preset), "trainer.total_steps=3", "teacher.top_k=32", "--node-rank"]
    assert placement_cli([*args, "0"]) == 2, "node 0 is all actor GPUs"
    assert "no teacher GPUs" in capsys.readouterr().err
    assert placement_cli([*args, "1"]) == 0
    argv = capsys.readouterr().out.split()
    assert argv == ["--config", str(preset), "--node-rank", "1", "--gpu-ids", "4,5,6,7", "teacher.top_k=32"]
    standalone = ["--config", str(REPO_ROOT / "configs" / "teacher" / "cpu_demo.yaml"), "teacher.nope=1"]
    assert placement_cli(["teacher-argv", *standalone]) == 0
    assert capsys.readouterr().out.split() == standalone, "a teacher yaml's keys go to the server, which checks them"
    assert placement_cli([*args[:-1], "actor.nope=1", "--gpu-ids", "4,5,6,7"]) == 2, "trainer keys are checked"
    assert "actor.nope" in capsys.readouterr().err
    settings = load_settings(preset, ["server.gpu_ids=[4,5,6,7]"], node_rank=1)
    assert [s.gpu_ids for s in settings.slots] == [("4", "5", "6", "7")]
    with pytest.raises(ConfigError) as err:
        load_settings(preset, node_rank=1)
    assert err.value.key == "--gpu-ids" and "launch/start_teacher.sh" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_settings(preset, ["server.gpu_ids=[4]", "trainer.total_steps=3"])
    assert err.value.key == "trainer.total_steps", "the server refuses the trainer's keys"
    explicit = load_settings(
        REPO_ROOT / "configs" / "teacher" / "cpu_demo.yaml", ["server.gpu_ids=[3,5]", "teacher.replicas=2"]
    )
    assert [s.gpu_ids for s in explicit.slots] == [("3",), ("5",)]


def test_replica_address_is_derived_from_the_client_address() -> None:
    assert derive_replica_address("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5556"
    assert derive_replica_address("tcp://127.0.0.1:0") == "tcp://127.0.0.1:0"
    assert derive_replica_address("ipc:///tmp/t") == "ipc:///tmp/t-replicas"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("teacher.queue_depth=0", "teacher.queue_depth"),
        ("teacher.max_request_mb=0", "teacher.max_request_mb"),
        ("teacher.max_batch_tokens=0", "teacher.max_batch_tokens"),
        ("teacher.replica_timeout_s=-1", "teacher.replica_timeout_s"),
        ("teacher.dtype=int8", "teacher.dtype"),
        ("teacher.client.logprob_dtype=bfloat8", "teacher.client.logprob_dtype"),
        ("teacher.client.id_encoding=zip", "teacher.client.id_encoding"),
    ],
)
def test_teacher_fields_are_validated(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert err.value.key == key
    with pytest.raises(ConfigError) as err:
        load_teacher_file(REPO_ROOT / "configs" / "teacher" / "cpu_demo.yaml", [override])
    assert err.value.key == key


def test_unknown_teacher_yaml_key_names_it() -> None:
    with pytest.raises(ConfigError) as err:
        load_teacher_file(REPO_ROOT / "configs" / "teacher" / "cpu_demo.yaml", ["server.gpus=[1]"])
    assert err.value.key == "server.gpus"
    with pytest.raises(ConfigError) as err:
        load_teacher_file(REPO_ROOT / "configs" / "teacher" / "cpu_demo.yaml", ["server.ready_timeout_s=5"])
    assert err.value.key == "server.ready_timeout_s" and "it is teacher.ready_timeout_s now" in err.value.message


def test_the_teacher_server_refuses_the_openai_backend() -> None:
    """teacher.backend=openai is a vLLM server the user runs; `python -m teacher_server` does not serve it."""
    openai = ["teacher.backend=openai", "teacher.address=http://127.0.0.1:8000/v1"]
    with pytest.raises(ConfigError) as err:
        load_teacher_file(REPO_ROOT / "configs" / "teacher" / "cpu_demo.yaml", openai)
    assert err.value.key == "teacher.backend" and "vllm serve" in err.value.message


def test_a_text_request_weighs_its_estimated_tokens_for_dispatch() -> None:
    """The frontend sends a request to the replica with the fewest outstanding tokens (teacher_server/server/frontend.py `_pick`):
    a text request, not rendered yet, weighs its text's bytes / 4 + 1 per conversation, not 0 (with 0, every
    cross-tokenizer request went to one replica)."""
    from teacher_server.wire.conversation import Conversation

    short = Conversation([{"role": "user", "content": "rev:abc"}], "", "cba", True)
    long = Conversation([{"role": "user", "content": "naïve " * 40}], "", "日本 " * 30, False)
    frames = request_frames(7, [], [], top_k=4, temperature=1.0, conversations=[short, long])
    header = P.decode_client_message(frames[0])
    assert isinstance(header, P.ScoreRequest)
    parsed = parse_score_request(header, frames[1:], LIMITS)
    assert parsed.conversations is not None and parsed.ids.size == 0
    # 7 + 3 bytes; 40 x 7 bytes ("naïve " is 7 in UTF-8) + 30 x 7 ("日本 ").
    assert parsed.n_tokens == (10 // 4 + 1) + (490 // 4 + 1) == 126


def test_a_server_without_text_requests_is_refused_at_connect_naming_the_key(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    """An older server (no text_requests in its handshake, read as False) would answer every text request with
    bad_request (exit 1 mid-run): algorithm.cross_tokenizer refuses it at connect time, a mismatch (exit 2)."""
    from transformers import AutoTokenizer

    from recipe_gkd.config import load_config
    from recipe_gkd.cross_tokenizer.route import CrossTokenizerScorer
    from recipe_gkd.exit_codes import EXIT_BAD_CONFIG, exit_code_for
    from teacher_server.client.zmq_client import TeacherClient, TeacherMismatchError

    fields = {
        f: getattr(P.HelloReply(1, 1, "s", "m", 10, "h", 8, [], [], 1, 1, "hf", True), f)
        for f in P.HelloReply.__struct_fields__
        if f != "text_requests"
    }
    older = P.decode_server_reply(msgspec.msgpack.encode({"type": "hello_reply", **fields}))
    assert isinstance(older, P.HelloReply) and older.text_requests is False
    monkeypatch.setattr(TeacherClient, "connect", lambda self: older)
    overrides = ["algorithm.cross_tokenizer=span", f"teacher.model_path={tiny_model_dir}", "teacher.autostart=false"]
    cfg = load_config(None, [*overrides, "teacher.address=tcp://127.0.0.1:9"])
    with pytest.raises(TeacherMismatchError, match=r"predates text requests.*launch/start_teacher\.sh") as err:
        CrossTokenizerScorer.connect(cfg, AutoTokenizer.from_pretrained(tiny_model_dir), None)
    assert exit_code_for(err.value) == EXIT_BAD_CONFIG
