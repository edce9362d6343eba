"""A teacher of another tokenizer (algorithm.cross_tokenizer): text requests through a real teacher server, and
the CLI for a few steps with a Llama-3-shaped byte-level BPE teacher beside the char-tokenizer student."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cli_runs import run_cli
from cross_tokenizer_pairs import CONVERSATIONS
from teacher_servers import READY_TIMEOUT_S, write_teacher_yaml

from recipe_gkd.observe.metrics import read_metrics
from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm
from teacher_server.client.launcher import TeacherProcess, launch_teacher
from teacher_server.client.zmq_client import TeacherClient, TeacherMismatchError
from teacher_server.server.backends import BackendOptions, load_backend, parsed_request
from teacher_server.wire.conversation import Renderer

WORDS = ["abcde", "hello", "qwert", "zyxwv", "mnopq", "lkjhg", "asdfg", "poiuy", "rtyui", "vbnmx", "ghjkl", "wersd"]


@pytest.fixture(scope="module")
def llama3_teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("xtok_teacher")
    return build_tiny_causal_lm(
        root, seed=1, spec=TinyModelSpec(hidden_size=96, num_layers=3), tokenizer_kind="llama3_bpe"
    )


@pytest.fixture(scope="module")
def server(llama3_teacher: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TeacherProcess]:
    yaml_path = write_teacher_yaml(tmp_path_factory.mktemp("xtok_server") / "teacher.yaml", llama3_teacher)
    with launch_teacher(yaml_path, ready_timeout_s=READY_TIMEOUT_S, log_path=yaml_path.parent / "server.log") as proc:
        yield proc


def test_text_requests_equal_the_in_process_rendering_and_backend(server: TeacherProcess, llama3_teacher: Path) -> None:
    from transformers import AutoTokenizer

    renderer = Renderer(AutoTokenizer.from_pretrained(llama3_teacher))
    backend = load_backend("hf", BackendOptions(str(llama3_teacher), max_top_k=64))
    with TeacherClient(server.address, timeout_s=60.0, top_k=8, logprob_dtype="float32", id_encoding="int32") as client:
        replies = client.score_conversations(CONVERSATIONS)
    for conversation, reply in zip(CONVERSATIONS, replies, strict=True):
        rendered = renderer.render(conversation)
        expected = backend.score(parsed_request([rendered.ids], [rendered.score_from], top_k=8)).split()[0]
        assert np.array_equal(reply.token_ids, rendered.ids[rendered.score_from :])
        assert np.array_equal(reply.byte_offsets, rendered.byte_offsets)
        assert reply.byte_offsets[-1, 1] == len(conversation.response.encode())
        np.testing.assert_allclose(reply.topk_logprobs, expected.topk_logprobs, rtol=0, atol=1e-6)
        np.testing.assert_allclose(reply.sampled_logprob, expected.sampled_logprob, rtol=0, atol=1e-6)
    # teacher.top_k=0 (the sampled reverse KL across tokenizers): the sampled tokens' logprobs alone, the same ones.
    with TeacherClient(server.address, timeout_s=60.0, top_k=0, logprob_dtype="float32", id_encoding="int32") as client:
        sampled_only = client.score_conversations(CONVERSATIONS)
    for reply, full in zip(sampled_only, replies, strict=True):
        assert reply.top_k == 0 and reply.topk_logprobs.shape[1] == 0
        np.testing.assert_array_equal(reply.token_ids, full.token_ids)
        np.testing.assert_array_equal(reply.byte_offsets, full.byte_offsets)
        np.testing.assert_allclose(reply.sampled_logprob, full.sampled_logprob, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def xtok_inputs(llama3_teacher: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("xtok_cli")
    data = root / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"rev:{w}", "response": w[::-1], "answer": w[::-1]}) + "\n" for w in WORDS)
    )
    return {"student": build_tiny_causal_lm(root / "student", seed=0), "teacher": llama3_teacher, "data": data}


# One CLI run (span); ULD's loss equals TRL GOLD's in tests/recipe_gkd/losses/test_cross_tokenizer_loss.py and is
# chosen by the target registry (tests/recipe_gkd/targets/test_targets.py).
@pytest.mark.parametrize("overrides", [["algorithm.cross_tokenizer=span"]], ids=["span"])
def test_the_cli_distills_across_tokenizers(xtok_inputs: dict[str, Path], tmp_path: Path, overrides: list[str]) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(xtok_inputs, run_dir, *overrides, "trainer.total_steps=2", "trainer.eval_every=0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = read_metrics(run_dir)
    assert [r["weight_version"] for r in rows] == [1, 2]
    for row in rows:
        assert np.isfinite(row["loss"])
        # A random student samples special tokens mid-response too (unaligned: no text of their own).
        assert 0 < row["align_one_to_one_frac"] <= 1 and row["align_span_len"] >= 1
        assert 0 <= row["align_unaligned_frac"] < 0.5
        assert row["align_shared_span_frac"] > 0  # shared pieces come from the teacher's top-k


def test_another_tokenizer_without_cross_tokenizer_is_a_bad_input_naming_it(
    server: TeacherProcess, xtok_inputs: dict[str, Path]
) -> None:
    """The rollout worker's teacher client (TeacherScorer) meets the server of a teacher of another tokenizer without
    algorithm.cross_tokenizer: refused at its handshake naming the key, an exit-2 error (test_exit_codes.py: also
    from a worker, through Ray), before any step."""
    from transformers import AutoTokenizer

    from recipe_gkd.config import load_config
    from recipe_gkd.exit_codes import exit_code_for
    from recipe_gkd.rollout.teacher import TeacherScorer

    overrides = [f"model.student_path={xtok_inputs['student']}", f"teacher.model_path={xtok_inputs['teacher']}"]
    cfg = load_config(None, [*overrides, "teacher.autostart=false", f"teacher.address={server.address}"])
    with pytest.raises(TeacherMismatchError, match=r"algorithm\.cross_tokenizer") as info:
        TeacherScorer(cfg, AutoTokenizer.from_pretrained(xtok_inputs["student"]), server.address)
    assert exit_code_for(info.value) == 2


def test_a_role_the_teacher_template_refuses_is_a_bad_input_naming_the_key(
    server: TeacherProcess, xtok_inputs: dict[str, Path]
) -> None:
    """A record whose prompt holds a tool turn, as the rollout worker turns it into the teacher's conversation
    (conversation_of): the teacher's template refuses the role, the reply names teacher.chat_template (exit 2), and
    the server lives on."""
    from recipe_gkd.config import load_config
    from recipe_gkd.cross_tokenizer.align import StudentText
    from recipe_gkd.cross_tokenizer.span_scores import conversation_of
    from recipe_gkd.exit_codes import exit_code_for

    cfg = load_config(None, [f"model.student_path={xtok_inputs['student']}", "algorithm.cross_tokenizer=span"])
    record = {"prompt": [{"role": "tool", "content": "rev:abcde"}, {"role": "user", "content": "go"}]}
    offsets = np.array([[0, 5]], np.int32)
    conversation = conversation_of(record, cfg.data, StudentText("edcba", offsets, np.array([True]), False))
    assert [m["role"] for m in conversation.messages] == ["tool", "user"]
    with TeacherClient(server.address, timeout_s=60.0, top_k=8) as client:
        with pytest.raises(TeacherMismatchError, match=r"teacher\.chat_template") as info:
            client.score_conversations([CONVERSATIONS[0], conversation])
        assert len(client.score_conversations(CONVERSATIONS[:1])) == 1
    assert exit_code_for(info.value) == 2
