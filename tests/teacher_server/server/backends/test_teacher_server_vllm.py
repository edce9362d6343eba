"""The vllm backend (vllm-cpu on CPU), against the HF backend. Skipped when vllm is not installed.

Temperature: vLLM's prompt logprobs are of the raw logits, so the backend scores at T=1 only
and refuses any other temperature (see teacher_server/server/backends/vllm.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from repo_paths import REPO_ROOT
from teacher_servers import VOCAB, write_teacher_yaml

from teacher_server.client.launcher import TeacherProcess, launch_teacher
from teacher_server.client.zmq_client import TeacherClient, TeacherMismatchError, TeacherRequestError
from teacher_server.server.backends import Backend, BackendOptions, load_backend, parsed_request
from teacher_server.wire import protocol as P
from teacher_server.wire.score_frames import RequestLimits, parse_score_request

pytestmark = pytest.mark.vllm
TOP_K = 16
# vLLM's CPU kernels and HF's differ in summation order.
ATOL = 1e-4
READY_TIMEOUT_S = 300.0


# A run whose longest scored sequence is data.max_prompt_length + rollout.sampling.max_new_tokens.
LONGEST = ["data.max_prompt_length=48", "rollout.sampling.max_new_tokens=16"]


def least_model_len() -> int:
    """The smallest teacher.max_model_len the run's config accepts for LONGEST."""
    from recipe_gkd.config import ConfigError, load_config

    for n in range(1, 1024):
        try:
            load_config(None, [*LONGEST, f"teacher.max_model_len={n}"])
        except ConfigError as err:
            assert err.key == "teacher.max_model_len", str(err)
            continue
        return n
    raise AssertionError("no teacher.max_model_len accepted")


@pytest.fixture(scope="module")
def vllm_bpe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with head_dim 32 (vLLM's CPU attention has no kernel for the default 16), a Llama-3-shaped
    byte-level BPE and chat template (text requests need one)."""
    from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm

    spec = TinyModelSpec(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
    return build_tiny_causal_lm(tmp_path_factory.mktemp("vllm_bpe"), seed=0, spec=spec, tokenizer_kind="llama3_bpe")


@pytest.fixture(scope="module")
def vllm_server(vllm_bpe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TeacherProcess]:
    """One teacher server on the vllm backend (a process of its own) for every logprob test below: token requests
    against the HF backend, the refusals, text requests (algorithm.cross_tokenizer). Its engine is built with the
    smallest max_model_len the config accepts (LONGEST)."""
    pytest.importorskip("vllm")
    root = tmp_path_factory.mktemp("vllm_server")
    yaml_path = write_teacher_yaml(
        root / "teacher.yaml", vllm_bpe_model, backend="vllm", dtype="float32", max_model_len=least_model_len()
    )
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with launch_teacher(yaml_path, ready_timeout_s=READY_TIMEOUT_S, log_path=root / "server.log", env=env) as server:
        yield server


@pytest.fixture(scope="module")
def hf_bpe(vllm_bpe_model: Path) -> Backend:
    """The HF backend on the same model: the reference."""
    return load_backend("hf", BackendOptions(str(vllm_bpe_model), max_top_k=64))


def _batch(vocab: int) -> tuple[list[np.ndarray], list[int]]:
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, vocab, size=n).astype(np.int32) for n in (12, 40, 3, 25)]
    return seqs, [5, 1, 3, 24]


def _client(server: TeacherProcess, top_k: int = TOP_K) -> TeacherClient:
    # float32 on the wire: the comparison with HF is of the engine's values, not of the wire's rounding.
    return TeacherClient(server.address, timeout_s=120.0, top_k=top_k, logprob_dtype="float32")


@pytest.mark.slow
def test_vllm_matches_hf_at_temperature_one(vllm_server: TeacherProcess, hf_bpe: Backend) -> None:
    with _client(vllm_server) as client:
        hello = client.connect()
        assert (hello.backend, hello.vocab_size, hello.tokenizer_hash) == (
            "vllm",
            hf_bpe.info.vocab_size,
            hf_bpe.info.tokenizer_hash,
        )
        seqs, starts = _batch(hello.vocab_size)
        got = client.score(seqs, starts)
    want = hf_bpe.score(parsed_request(seqs, starts, top_k=TOP_K)).split()
    for seq, start, g, w in zip(seqs, starts, got, want, strict=True):
        assert g.n_scored == w.n_scored == seq.size - start
        if not g.n_scored:
            continue
        np.testing.assert_allclose(g.topk_logprobs, w.topk_logprobs, atol=ATOL)
        np.testing.assert_allclose(g.sampled_logprob, w.sampled_logprob, atol=ATOL)
        # The tail comes from the top-k alone (log1mexp), HF's from the rest of the vocabulary.
        np.testing.assert_allclose(g.tail_logmass, w.tail_logmass, atol=1e-3)
        gap_clear = w.topk_logprobs[:, :-1] - w.topk_logprobs[:, 1:] > ATOL
        np.testing.assert_array_equal(
            np.sort(g.topk_ids, 1)[gap_clear.all(1)], np.sort(w.topk_ids, 1)[gap_clear.all(1)]
        )


@pytest.mark.slow
def test_vllm_top_k_zero_scores_the_sampled_tokens_only(vllm_server: TeacherProcess, hf_bpe: Backend) -> None:
    seqs, starts = _batch(hf_bpe.info.vocab_size)
    with _client(vllm_server, top_k=0) as client:
        got = client.score(seqs, starts)
    want = hf_bpe.score(parsed_request(seqs, starts, top_k=0)).split()
    for seq, start, g, w in zip(seqs, starts, got, want, strict=True):
        assert g.topk_ids.shape == (seq.size - start, 0)
        np.testing.assert_allclose(g.sampled_logprob, w.sampled_logprob, atol=ATOL)
        np.testing.assert_array_equal(g.tail_logmass, np.zeros(seq.size - start, np.float32))


@pytest.mark.slow
def test_the_longest_sequence_the_config_allows_is_scored(vllm_server: TeacherProcess, hf_bpe: Backend) -> None:
    """A full-length prompt whose response runs to max_new_tokens reaches the teacher whole; one token more is
    refused naming teacher.max_model_len."""
    longest = 48 + 16
    seq = np.random.default_rng(1).integers(0, hf_bpe.info.vocab_size, size=longest).astype(np.int32)
    with _client(vllm_server) as client:
        (got,) = client.score([seq], [48])
        assert got.n_scored == 16 and np.isfinite(got.topk_logprobs).all()
        with pytest.raises(TeacherRequestError, match=r"teacher\.max_model_len"):
            client.score([np.append(seq, seq[:1])], [48])


@pytest.mark.slow
def test_vllm_named_ids_equal_hf_or_are_refused(vllm_server: TeacherProcess, hf_bpe: Backend) -> None:
    """With the V2 model runner (GPUs with Triton) vLLM scores named ids like HF's full distribution; vllm-cpu
    runs V1, where the handshake says max_named_ids=0 and the client refuses named ids before sending."""
    seqs, starts = _batch(hf_bpe.info.vocab_size)
    rng = np.random.default_rng(1)
    named = [
        rng.integers(0, hf_bpe.info.vocab_size, size=(s.size - f, 6)).astype(np.int32)
        for s, f in zip(seqs, starts, strict=True)
    ]
    with _client(vllm_server) as client:
        hello = client.connect()
        assert hello.max_named_ids in (0, 64)
        if not hello.max_named_ids:
            with pytest.raises(TeacherMismatchError):
                client.score(seqs, starts, named_ids=named)
            return
        got = client.score(seqs, starts, named_ids=named)
    want = hf_bpe.score(parsed_request(seqs, starts, top_k=TOP_K, named_ids=named)).split()
    for g, w in zip(got, want, strict=True):
        assert g.named_logprobs is not None and w.named_logprobs is not None
        np.testing.assert_allclose(g.named_logprobs, w.named_logprobs, atol=ATOL)
        # vLLM's rest comes from the values (log1mexp), HF's from the rest of the vocabulary.
        np.testing.assert_allclose(g.other_logmass, w.other_logmass, atol=1e-3)


@pytest.mark.slow
def test_vllm_refuses_temperatures_other_than_one(vllm_server: TeacherProcess, hf_bpe: Backend) -> None:
    """At the handshake (the client is told before it sends), and in a request that names one all the same."""
    with (
        TeacherClient(vllm_server.address, top_k=8, temperature=0.5) as client,
        pytest.raises(TeacherMismatchError, match=r"teacher\.temperature"),
    ):
        client.connect()
    with _client(vllm_server) as client:
        assert not client.connect().supports_temperature
        with pytest.raises(TeacherRequestError, match=r"teacher\.temperature"):
            client.score([[1, 2, 3]], [1], temperature=0.7)
    limits = RequestLimits(VOCAB, 64, 1 << 20, supports_temperature=False)
    request = P.ScoreRequest(P.PROTOCOL_VERSION, 1, [3], [1], 4, 0.7)
    with pytest.raises(P.ProtocolError) as err:
        parse_score_request(request, [np.array([1, 2, 3], np.int32).tobytes()], limits)
    assert err.value.code == P.ErrorCode.UNSUPPORTED


@pytest.mark.slow
def test_text_requests_through_the_vllm_backend_equal_hf(vllm_server: TeacherProcess, vllm_bpe_model: Path) -> None:
    """algorithm.cross_tokenizer: the replica renders the conversation before any backend, so a vllm teacher scores the
    tokens the hf backend scores for the same rendering, with the same byte offsets."""
    from cross_tokenizer_pairs import CONVERSATIONS
    from transformers import AutoTokenizer

    from teacher_server.wire.conversation import Renderer

    with TeacherClient(vllm_server.address, timeout_s=120.0, top_k=8, logprob_dtype="float32") as client:
        replies = client.score_conversations(CONVERSATIONS)
    renderer = Renderer(AutoTokenizer.from_pretrained(vllm_bpe_model))
    hf = load_backend("hf", BackendOptions(str(vllm_bpe_model), max_top_k=64))
    for conversation, reply in zip(CONVERSATIONS, replies, strict=True):
        rendered = renderer.render(conversation)
        expected = hf.score(parsed_request([rendered.ids], [rendered.score_from], top_k=8)).split()[0]
        assert np.array_equal(reply.token_ids, rendered.ids[rendered.score_from :])
        assert np.array_equal(reply.byte_offsets, rendered.byte_offsets)
        np.testing.assert_allclose(reply.sampled_logprob, expected.sampled_logprob, rtol=0, atol=ATOL)


# teacher.output=hidden with the vllm backend: a pooling-mode engine (teacher_server/server/backends/vllm.py module doc).
DEMO_TEACHER = REPO_ROOT / "assets" / "demo" / "teacher"
# Half an ulp of each 16-bit wire dtype relative to the value (8 and 11 significant bits).
HALF_ULP = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
# vLLM's CPU kernels against HF's in float32, on the demo teacher's final hidden states (measured 2.9e-5 at most).
HIDDEN_ATOL = 2e-4


def _demo_teacher() -> Path:
    if not (DEMO_TEACHER / "config.json").is_file():
        pytest.skip("demo assets missing: python -m recipe_gkd.demo.build_assets")
    return DEMO_TEACHER


@pytest.fixture(scope="module")
def vllm_hidden_backend(vllm_in_this_process: None) -> Iterator[Backend]:
    """The demo teacher in a pooling-mode vLLM engine (BackendOptions.output="hidden")."""
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    options = BackendOptions(str(_demo_teacher()), max_top_k=64, dtype="float32", max_model_len=128, output="hidden")
    yield load_backend("vllm", options)


def _demo_batch(seed: int) -> tuple[list[np.ndarray], list[int]]:
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(3, 102, size=n).astype(np.int32) for n in (12, 40, 3, 25, 7)]
    return seqs, [5, 1, 3, 24, 2]


def _teacher_logprobs_f64(seq: np.ndarray, start: int) -> np.ndarray:
    """The demo teacher's float64 log-softmax predicting positions start..len-1 (HF, an independent reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO_TEACHER, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(seq.astype(np.int64))[None]).logits[0]
    return torch.log_softmax(logits[start - 1 : seq.size - 1], dim=-1).numpy()


def _check_hidden_gives_teacher_logits(
    got: list[P.TeacherScores], seqs: list[np.ndarray], starts: list[int], dtype: str
):
    """Each reply's states x the teacher's head are the teacher's float64 logprobs within the wire's rounding bound.

    A value rounded to `dtype` moves by <= HALF_ULP x |h_j|, so a logit by <= sum_j |W_vj| |h_j| x HALF_ULP and a
    log-softmax value by twice the largest of those; plus vLLM-vs-float64 float32 differences (HIDDEN_ATOL).
    States before the final norm would miss by whole nats.
    """
    from safetensors.numpy import load_file

    head_VH = load_file(str(DEMO_TEACHER / "model.safetensors"))["model.embed_tokens.weight"].astype(np.float64)
    for seq, start, g in zip(seqs, starts, got, strict=True):
        assert g.hidden_states is not None and g.hidden_states.shape == (seq.size - start, head_VH.shape[1])
        assert g.top_k == 0 and np.isnan(g.sampled_logprob).all()  # no logprob computed on the teacher
        if not g.n_scored:
            continue
        hidden_NH = g.hidden_states.astype(np.float64)
        logits_NV = hidden_NH @ head_VH.T
        logprobs_NV = logits_NV - np.logaddexp.reduce(logits_NV, axis=1, keepdims=True)
        bound_N = 2 * (np.abs(hidden_NH) @ np.abs(head_VH).T).max(axis=1) * HALF_ULP[dtype] + HIDDEN_ATOL
        error_N = np.abs(logprobs_NV - _teacher_logprobs_f64(seq, start)).max(axis=1)
        assert (error_N <= bound_N).all(), (error_N, bound_N)


@pytest.mark.parametrize("hidden_dtype", ["bfloat16", "float16"])
def test_vllm_hidden_states_are_the_final_norm_output_equal_to_hf(
    vllm_hidden_backend: Backend, hidden_dtype: str
) -> None:
    """vLLM's pooling route returns the states after the final norm: the hf backend's to float32 differences (before
    the wire's rounding), and times the head the teacher's own logprobs."""
    hf = load_backend("hf", BackendOptions(str(DEMO_TEACHER), max_top_k=64))
    info = vllm_hidden_backend.info
    assert (info.hidden_size, info.vocab_size, info.tokenizer_hash) == (128, hf.info.vocab_size, hf.info.tokenizer_hash)
    # The pooled states stay in the model's dtype (a bf16 engine moves 2 bytes per value, not the fp32 default).
    from vllm.config.model import _get_head_dtype

    model_config = vllm_hidden_backend.llm.llm_engine.model_config  # type: ignore[attr-defined]
    assert _get_head_dtype(model_config.hf_config, torch.bfloat16, "pooling") == torch.bfloat16
    assert (info.max_top_k, info.max_named_ids, info.supports_temperature) == (0, 0, True)
    seqs, starts = _demo_batch(seed=3)
    # At 0.5: the states do not depend on the temperature (the actor applies it).
    got = vllm_hidden_backend.score(parsed_request(seqs, starts, top_k=0, temperature=0.5, hidden_dtype=hidden_dtype))
    want = hf.score(parsed_request(seqs, starts, top_k=0, hidden_dtype=hidden_dtype))
    assert got.hidden_states is not None and want.hidden_states is not None
    # Each side rounded once to the wire dtype from float32 values HIDDEN_ATOL apart at most.
    bound = 2 * HALF_ULP[hidden_dtype] * np.abs(want.hidden_states) + HIDDEN_ATOL
    assert (np.abs(got.hidden_states - want.hidden_states) <= bound).all()
    np.testing.assert_array_equal(got.n_scored, want.n_scored)
    _check_hidden_gives_teacher_logits(got.split(), seqs, starts, hidden_dtype)


def test_a_vllm_hidden_replica_refuses_logprob_requests(vllm_hidden_backend: Backend) -> None:
    """A pooling engine returns no logprobs: a top-k or a sampled-token request is refused naming teacher.output."""
    for request in (
        parsed_request([[5, 6, 7]], [1], top_k=0),
        parsed_request([[5, 6, 7]], [1], top_k=4, hidden_dtype="bfloat16"),
    ):
        with pytest.raises(ValueError, match=r"teacher\.output"):
            vllm_hidden_backend.score(request)


def test_a_teacher_with_a_scaled_head_is_refused_for_hidden_states(tmp_path: Path) -> None:
    """logit_scale (Cohere) or a Sentence-Transformers Dense module: the states x head would not be the logits."""
    from teacher_server.server.backends.vllm import check_plain_head

    (tmp_path / "config.json").write_text('{"logit_scale": 0.25}')
    with pytest.raises(ValueError, match=r"teacher\.output.*logit_scale"):
        check_plain_head(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    check_plain_head(str(tmp_path))
    (tmp_path / "modules.json").write_text('[{"type": "sentence_transformers.models.Dense", "path": "2_Dense"}]')
    with pytest.raises(ValueError, match=r"teacher\.output.*Dense"):
        check_plain_head(str(tmp_path))


def test_a_top_k_client_is_told_the_vllm_hidden_replica_serves_hidden_states_only(vllm_hidden_backend: Backend) -> None:
    """The handshake a server on this replica answers (its model's max_top_k and hidden size, as the frontend's
    HelloReply carries them): a top-k client is refused naming teacher.output=hidden, a hidden-state client accepted.
    (The replica's states through the ZeroMQ server: test_teacher_server.py's hidden round trip on the hf backend;
    a vllm replica in a server process of its own: test_vllm_server_round_trip.)"""
    info = vllm_hidden_backend.info
    hello = P.HelloReply(
        request_id=0,
        version=P.PROTOCOL_VERSION,
        server_id="s",
        model_id=str(DEMO_TEACHER),
        vocab_size=info.vocab_size,
        tokenizer_hash=info.tokenizer_hash,
        max_top_k=info.max_top_k,
        logprob_dtypes=sorted(P.LOGPROB_DTYPES),
        id_encodings=list(P.ID_ENCODINGS),
        max_request_bytes=1 << 20,
        replicas=1,
        backend="vllm",
        supports_temperature=info.supports_temperature,
        max_named_ids=info.max_named_ids,
        hidden_size=info.hidden_size,
    )
    with pytest.raises(TeacherMismatchError, match=r"teacher\.top_k=8 .* teacher\.output=hidden only"):
        TeacherClient("tcp://127.0.0.1:1", top_k=8)._check_handshake(hello)
    TeacherClient("tcp://127.0.0.1:1", top_k=0, hidden_dtype="bfloat16")._check_handshake(hello)
