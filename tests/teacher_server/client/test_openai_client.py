"""The OpenAI-compatible teacher client against a scripted stdlib HTTP server (tests/conftest.py `scripted`):
parsing, retries, timeouts, errors.

The real vLLM server is in tests/teacher_server/client/test_teacher_openai.py; this one answers what each test scripts.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest
from openai_script import MODELS, Script, completions

from teacher_server.client.openai_client import OpenAITeacherClient, scores_from_prompt_logprobs
from teacher_server.client.zmq_client import TeacherRequestError, TeacherTimeoutError
from teacher_server.config.errors import ConfigError

VOCAB = 11


def full_logprobs(rng: np.random.Generator, length: int) -> np.ndarray:
    logits = rng.normal(size=(length, VOCAB)) * 2
    return logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)


@pytest.mark.parametrize("top_k", [0, 1, 4])
def test_scores_equal_the_full_distribution(
    scripted: tuple[str, Script, list[dict]], tiny_model_dir: Path, top_k: int
) -> None:
    address, script, seen = scripted
    rng = np.random.default_rng(top_k)
    seqs = [rng.integers(0, VOCAB, size=n).tolist() for n in (6, 9, 2)]
    starts = [3, 1, 2]
    table = {tuple(s): full_logprobs(rng, len(s)) for s in seqs}
    probe = (200, completions({(0, 0): full_logprobs(rng, 2)}))
    script += [MODELS, probe, (200, completions(table))]
    # teacher.model_path: a local directory with tokenizer files (checked by files, not by /tokenize) while the
    # server serves one model under another name: that one is scored.
    client = OpenAITeacherClient(address, top_k=top_k, max_inflight=1, api_key="k", model_path=str(tiny_model_dir))
    assert client.connect() == "served-teacher"
    got = client.score([np.asarray(s) for s in seqs], starts)
    assert [r["path"] for r in seen] == ["/v1/models", "/v1/completions", "/v1/completions"]
    assert seen[-1]["body"]["prompt"] == seqs and seen[-1]["body"]["prompt_logprobs"] == top_k
    assert all(r["auth"] == "Bearer k" for r in seen)
    for seq, start, g in zip(seqs, starts, got, strict=True):
        full = table[tuple(seq)][start:]
        assert g.n_scored == len(seq) - start and g.top_k == top_k
        np.testing.assert_allclose(g.sampled_logprob, full[np.arange(g.n_scored), seq[start:]], atol=1e-6)
        want_ids = np.argsort(-full, axis=1, kind="stable")[:, :top_k]
        np.testing.assert_array_equal(g.topk_ids, want_ids)
        np.testing.assert_allclose(g.topk_logprobs, np.take_along_axis(full, want_ids, 1), atol=1e-6)
        rest = full.copy()
        np.put_along_axis(rest, want_ids, -math.inf, axis=1)
        np.testing.assert_allclose(g.tail_logmass, np.logaddexp.reduce(rest, axis=1) if top_k else 0.0, atol=1e-5)


def test_retryable_statuses_are_retried_then_refusals_fail_at_once(scripted: tuple[str, Script, list[dict]]) -> None:
    address, script, seen = scripted
    script += [(503, {"message": "loading"}), (429, {"error": {"message": "slow down"}}), MODELS]
    client = OpenAITeacherClient(address, top_k=0, retries=2)
    assert client._served_model() == "served-teacher" and len(seen) == 3
    script += [(503, {}), (503, {}), (503, {})]
    with pytest.raises(Exception, match=r"teacher\.address") as err:
        client._served_model()
    assert type(err.value).__name__ == "TeacherDeadError"
    script += [(400, {"error": {"message": "Requested prompt logprobs of 9, which is greater than max allowed: 8"}})]
    client.model, client.top_k = "served-teacher", 9
    with pytest.raises(ConfigError) as config_err:
        client._check_top_k()
    assert config_err.value.key == "teacher.top_k" and "max allowed: 8" in config_err.value.message
    script += [(401, {"error": {"message": "Unauthorized"}})]
    with pytest.raises(TeacherRequestError, match=r"teacher\.api_key_file"):
        client._served_model()
    script += [(200, b"<html>not json</html>")]
    with pytest.raises(TeacherRequestError, match="no JSON"):
        client._served_model()


def test_a_silent_server_is_a_timeout_naming_the_key(scripted: tuple[str, Script, list[dict]]) -> None:
    address, script, _ = scripted
    script += [(200, 1.5), (200, 1.5)]
    client = OpenAITeacherClient(address, top_k=0, timeout_s=0.3, retries=1)
    start = time.monotonic()
    with pytest.raises(TeacherTimeoutError, match=r"teacher\.timeout_s"):
        client._served_model()
    assert time.monotonic() - start < 5


def test_a_choice_without_the_scored_token_is_refused() -> None:
    payload = [None, {"3": {"logprob": -0.1, "rank": 1}}]
    with pytest.raises(TeacherRequestError, match="lack the token"):
        scores_from_prompt_logprobs(payload, np.asarray([1, 2]), 1, top_k=1)
    with pytest.raises(TeacherRequestError, match="for top_k=2"):
        scores_from_prompt_logprobs([None, {"2": {"logprob": -0.1, "rank": 1}}], np.asarray([1, 2]), 1, top_k=2)
