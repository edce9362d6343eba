"""The doctor's checks, each fed the broken input it exists for (in-process; the whole command on the CPU demo:
tests/e2e/test_doctor.py): a prompt past data.max_prompt_length, a teacher template that renders a system turn the
student's does not, a teacher whose batched answer differs from its single one, a client refusing a top_k above the
server's, a first batch whose responses all hit the length limit. Each names the key to change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from recipe_gkd import doctor
from recipe_gkd.config import load_config
from recipe_gkd.preflight import Check, Status
from teacher_server.client.zmq_client import TeacherMismatchError
from teacher_server.wire.protocol import scores_from_logprobs

VOCAB, TOP_K = 102, 4


def test_prompts_past_the_limit_are_counted_and_refused() -> None:
    ok = Check("prompt lengths", doctor.prompt_lengths).finding(load_config(None, []))
    assert ok.status == Status.ok and "the longest 15 tokens" in ok.line
    cfg = load_config(None, ["data.max_prompt_length=12", "doctor.data_records=50"])
    bad = Check("prompt lengths", doctor.prompt_lengths).finding(cfg)
    assert bad.failed and bad.key == "data.max_prompt_length"
    assert "of the 100 prompts read are longer than data.max_prompt_length=12 (the longest: 15 tokens)" in bad.line


def test_a_teacher_template_with_a_system_turn_of_its_own_is_refused(tmp_path: Path) -> None:
    """The demo's char tokenizer for both; the teacher's template (teacher.chat_template) puts a system line first."""
    cfg = load_config(None, [])
    assert Check("chat templates", doctor.template_agreement).finding(cfg).status == Status.ok
    from transformers import AutoTokenizer

    template = AutoTokenizer.from_pretrained(cfg.teacher.model_path).chat_template
    own = tmp_path / "teacher.jinja"
    own.write_text(template.replace("{{ bos_token }}", "{{ bos_token }}<user>You are a teacher.", 1))
    finding = Check("chat templates", doctor.template_agreement).finding(
        load_config(None, [f"teacher.chat_template={own}"])
    )
    assert finding.failed and finding.key == "teacher.chat_template"
    assert "renders the first training record differently from the student (first difference at token" in finding.line


class Teacher:
    """A teacher scorer over a fixed random table: each position's logprobs from (its token, its position);
    `batched_shift` is added to every logprob of a request with more than one sequence (a batch-variant kernel)."""

    def __init__(self, batched_shift: float = 0.0) -> None:
        self.table = np.random.default_rng(0).standard_normal((VOCAB, VOCAB))
        self.shift = batched_shift

    def score(self, sequences: list[np.ndarray], score_from: list[int], named_ids: Any = None) -> list[Any]:
        out = []
        for seq, start in zip(sequences, score_from, strict=True):
            logits = self.table[np.asarray(seq[start - 1 : -1]) % VOCAB]
            logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            if len(sequences) > 1:
                logprobs = logprobs + self.shift
            out.append(scores_from_logprobs(logprobs, np.asarray(seq[start:]), TOP_K))
        return out

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("shift", "fails"), [(0.0, False), (0.2, True)])
def test_a_teacher_whose_batched_answer_differs_is_refused(shift: float, fails: bool) -> None:
    cfg = load_config(None, [f"teacher.top_k={TOP_K}"])
    finding = doctor.teacher_agreement(cfg, "default", cfg, lambda: Teacher(shift), replicas=2)
    assert finding.failed is fails
    assert "batched with 3 others and in 4 concurrent requests" in finding.line
    if fails:
        assert finding.key == "doctor.teacher_tolerance" and "largest |logprob difference| 0.2 " in finding.line


def test_a_client_refusing_the_top_k_stops_the_doctor_in_its_words() -> None:
    cfg = load_config(None, [])

    def refuse() -> Any:
        raise TeacherMismatchError("teacher.top_k=64 exceeds the server's max_top_k=20")

    (finding,) = doctor.one_teacher(cfg, "default", cfg, refuse, "tcp://127.0.0.1:1")
    assert finding.failed and finding.check == "teacher connects"
    assert "TeacherMismatchError: teacher.top_k=64 exceeds the server's max_top_k=20" in finding.line


def test_a_first_batch_cut_by_the_length_limit_everywhere_is_refused() -> None:
    cfg = load_config(None, ["rollout.sampling.max_new_tokens=3"])
    row = {
        "sequences": 4,
        "loss": 1.0,
        "sync_logprob_diff": 0.0,
        "sync_tensors_checked": 20.0,
        **dict.fromkeys(("generate_s", "teacher_s", "train_s", "sync_s", "sync_check_s"), 0.1),
        "actor0_rss_mb": 500.0,
    }
    assert doctor.smoke_finding(cfg, {**row, "response_clipped_frac": 0.5}).status == Status.ok
    cut = doctor.smoke_finding(cfg, {**row, "response_clipped_frac": 1.0})
    assert cut.failed and cut.key == "rollout.sampling.max_new_tokens"
    assert "every one of the 4 responses ran to rollout.sampling.max_new_tokens=3" in cut.line
