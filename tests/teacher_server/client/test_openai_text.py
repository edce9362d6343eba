"""teacher.backend=openai across tokenizers: the client renders with the teacher's tokenizer (teacher_server/client/openai_text.py),
against a scripted stdlib HTTP server serving a bigram "teacher" over the teacher's vocabulary.

The real vLLM server is in tests/teacher_server/client/test_teacher_openai.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# pytest's default (prepend) import mode puts this directory on sys.path: vLLM's reply shape. The scripted server:
# tests/conftest.py `scripted`.
from openai_script import MODELS, Script, prompt_logprobs

from recipe_gkd.config import REPO_ROOT, GKDConfig, load_config
from recipe_gkd.cross_tokenizer.route import CrossTokenizerScorer
from recipe_gkd.data import encode_prompt
from recipe_gkd.exit_codes import EXIT_BAD_CONFIG, exit_code_for
from teacher_server.client.openai_text import OpenAITextTeacher
from teacher_server.client.zmq_client import TeacherMismatchError
from teacher_server.config.errors import ConfigError
from teacher_server.wire.conversation import Conversation, Renderer
from teacher_server.wire.protocol import TeacherScores, scores_from_logprobs

# A Llama-3-shaped byte-level BPE teacher tokenizer (384 pieces) and the demo's char-tokenizer student.
TEACHER = REPO_ROOT / "assets" / "demo_xtok" / "teacher"
STUDENT = REPO_ROOT / "assets" / "demo" / "student"
TOP_K = 4
RECORDS = [
    {"prompt": "rev:hello world"},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "rev:abc de"}]},
    {"prompt": "rev:x"},
]
RESPONSES = [("dlrow olleh", True), ("ed cba", False), ("", True)]


def _tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class Bigram:
    """The scripted server's model: log p(next | previous token) = log_softmax(W[previous]) over the teacher vocabulary."""

    def __init__(self, vocab: int) -> None:
        self.logits_VV = np.random.default_rng(38).normal(size=(vocab, vocab)) * 2.0

    def logprobs(self, seq: Sequence[int]) -> np.ndarray:
        """[L, V]: row p is the distribution of the token at p (row 0 unused, as vLLM sends None there)."""
        rows = self.logits_VV[[seq[0], *seq[:-1]]]
        return rows - np.logaddexp.reduce(rows, axis=1, keepdims=True)

    def completions(self, body: dict) -> dict:
        k = body["prompt_logprobs"]
        choices = [
            {"index": i, "prompt_logprobs": prompt_logprobs(seq, self.logprobs(seq), k)}
            for i, seq in enumerate(body["prompt"])
        ]
        return {"choices": choices}


class InProcessTeacher:
    """The ZeroMQ route in this process: the replica's Renderer, then the exact scores of the same bigram."""

    def __init__(self, renderer: Renderer, bigram: Bigram) -> None:
        self.renderer, self.bigram = renderer, bigram

    def score_conversations(self, conversations: Sequence[Conversation]) -> list[TeacherScores]:
        out = []
        for conversation in conversations:
            r = self.renderer.render(conversation)
            ids = r.ids.tolist()
            scored = scores_from_logprobs(self.bigram.logprobs(ids)[r.score_from :], r.ids[r.score_from :], TOP_K)
            out.append(dataclasses.replace(scored, token_ids=r.ids[r.score_from :], byte_offsets=r.byte_offsets))
        return out


def _cfg(address: str, **teacher: object) -> GKDConfig:
    overrides = ["teacher.backend=openai", "teacher.autostart=false", f"teacher.address={address}"]
    cfg = load_config(None, ["algorithm.cross_tokenizer=span", f"teacher.top_k={TOP_K}", *overrides])
    cfg.teacher.model_path = str(TEACHER)
    cfg.teacher.timeout_s = 10.0
    cfg.teacher.client.retries = 0
    cfg.teacher.client.max_inflight = 1
    for key, value in teacher.items():
        setattr(cfg.teacher, key, value)
    return cfg


def _student_sequences(student: Any) -> tuple[list[np.ndarray], list[int]]:
    sequences, starts = [], []
    for record, (text, eos) in zip(RECORDS, RESPONSES, strict=True):
        prompt = encode_prompt(student, record, "prompt", True)
        response = student(text, add_special_tokens=False)["input_ids"] + ([student.eos_token_id] if eos else [])
        sequences.append(np.asarray(prompt + response, dtype=np.int32))
        starts.append(len(prompt))
    return sequences, starts


def _tokenize(tokenizer: Any, shift: int = 0) -> Any:
    return lambda body: {"tokens": [t + shift for t in tokenizer.encode(body["prompt"], add_special_tokens=False)]}


def test_the_openai_route_renders_on_the_client_and_aligns_as_the_server_route(
    scripted: tuple[str, Script, list[dict]],
) -> None:
    address, script, seen = scripted
    teacher_tok, student = _tokenizer(TEACHER), _tokenizer(STUDENT)
    bigram = Bigram(len(teacher_tok))
    # /models, the top-k probe, the served tokenizer against teacher.model_path's, then one scoring request.
    script += [MODELS, (200, bigram.completions), (200, _tokenize(teacher_tok)), (200, bigram.completions)]
    cfg = _cfg(address)
    scorer = CrossTokenizerScorer.connect(cfg, student, None)
    assert isinstance(scorer.teacher, OpenAITextTeacher)
    sequences, starts = _student_sequences(student)
    got = scorer.score_records(sequences, starts, RECORDS)
    assert [r["path"] for r in seen] == ["/v1/models", "/v1/completions", "/tokenize", "/v1/completions"]
    # The server received the teacher's token ids as the replica renders them: its template, its end of turn.
    renderer = Renderer(teacher_tok)
    texts = [t for t, _ in RESPONSES]
    conversations = [
        Conversation([{"role": "user", "content": "rev:hello world"}], "", texts[0], True),
        Conversation(RECORDS[1]["prompt"], "", texts[1], False),  # type: ignore[arg-type]
        Conversation([{"role": "user", "content": "rev:x"}], "", texts[2], True),
    ]
    rendered = [renderer.render(c) for c in conversations]
    assert seen[-1]["body"]["prompt"] == [r.ids.tolist() for r in rendered]
    assert seen[-1]["body"]["prompt_logprobs"] == TOP_K and seen[-1]["body"]["max_tokens"] == 1
    assert teacher_tok.convert_ids_to_tokens(int(rendered[0].ids[-1])) == "<|eot_id|>"
    # The same conversations through the ZeroMQ route's pieces: the same aligned arrays (the tail: the client
    # rebuilds it from the top-k, the server sums the rest of the vocabulary).
    reference = CrossTokenizerScorer(InProcessTeacher(renderer, bigram), student, teacher_tok, TOP_K, cfg.data)
    want = reference.score_records(sequences, starts, RECORDS)
    for g, w, seq, start in zip(got, want, sequences, starts, strict=True):
        assert g.span_len.tolist() == w.span_len.tolist() and len(g.span_len) == seq.size - start
        assert g.counts == w.counts
        np.testing.assert_array_equal(g.topk_ids, w.topk_ids)
        for field in ("topk_logprobs", "sampled_logprob", "tail_logmass"):
            np.testing.assert_allclose(getattr(g, field), getattr(w, field), rtol=0, atol=1e-5, err_msg=field)
    # Not a one-to-one identity: the teacher's BPE pieces span several student characters.
    assert got[0].counts["one_to_one_tokens"] < got[0].counts["response_tokens"]
    assert (got[0].span_len > 1).any()
    scorer.close()


def test_a_conversation_the_teacher_cannot_render_exits_2_before_any_request(
    scripted: tuple[str, Script, list[dict]],
) -> None:
    address, _, seen = scripted
    teacher_tok = _tokenizer(TEACHER)
    client_cfg = _cfg(address)
    text_teacher = OpenAITextTeacher(_unconnected_client(client_cfg), Renderer(teacher_tok))
    tool = Conversation([{"role": "tool", "content": "42"}], "", "ok", False)
    with pytest.raises(TeacherMismatchError, match=r"teacher\.chat_template") as err:
        text_teacher.score_conversations([tool])
    assert exit_code_for(err.value) == EXIT_BAD_CONFIG and not seen
    # A tokenizer without a chat template: the same error, naming the key to set.
    teacher_tok.chat_template = None
    text_teacher = OpenAITextTeacher(_unconnected_client(client_cfg), Renderer(teacher_tok))
    user = Conversation([{"role": "user", "content": "rev:ab"}], "", "ba", True)
    with pytest.raises(TeacherMismatchError, match=r"no chat template.*teacher\.chat_template"):
        text_teacher.score_conversations([user])
    assert not seen


def _unconnected_client(cfg: GKDConfig) -> Any:
    from teacher_server.client.openai_client import OpenAITeacherClient

    return OpenAITeacherClient(cfg.teacher.address, top_k=TOP_K, timeout_s=5.0, retries=0)


def test_connect_needs_the_served_tokenizer_files_at_teacher_model_path(
    scripted: tuple[str, Script, list[dict]], tmp_path: Path
) -> None:
    address, script, seen = scripted
    student = _tokenizer(STUDENT)
    # A served model's name (no local files): the client has nothing to render with.
    with pytest.raises(ConfigError) as err:
        CrossTokenizerScorer.connect(_cfg(address, model_path="meta-llama/Llama-3-8B"), student, None)
    assert err.value.key == "teacher.model_path" and exit_code_for(err.value) == EXIT_BAD_CONFIG and not seen
    with pytest.raises(ConfigError) as err:
        CrossTokenizerScorer.connect(_cfg(address, model_path=str(tmp_path)), student, None)
    assert err.value.key == "teacher.model_path"
    # Local files of another tokenizer than the served one: the server's /tokenize differs.
    bigram = Bigram(len(_tokenizer(TEACHER)))
    script += [MODELS, (200, bigram.completions), (200, _tokenize(_tokenizer(TEACHER), shift=1))]
    with pytest.raises(TeacherMismatchError, match=r"/tokenize.*teacher\.model_path") as mismatch:
        CrossTokenizerScorer.connect(_cfg(address), student, None)
    assert exit_code_for(mismatch.value) == EXIT_BAD_CONFIG
    assert [r["path"] for r in seen] == ["/v1/models", "/v1/completions", "/tokenize"]
