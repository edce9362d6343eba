"""A Qwen3-Base-shaped student (EOS `<|endoftext|>`, a ChatML template closing turns with `<|im_end|>`) beside an
Instruct teacher of the same vocabulary, through the CLI: no response holds a token after its turn end, the teacher
scores the turn end as sampled, and the metrics and samples.jsonl say how each response ended."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runs import BATCH, WORDS, run_cli
from stop_models import biased_student

from recipe_gkd.observe.metrics import read_metrics
from recipe_gkd.offline_models import build_tiny_causal_lm
from recipe_gkd.rollout.samples import SAMPLES_FILE

pytestmark = pytest.mark.slow
MAX_NEW_TOKENS = 12


def test_a_base_student_stops_at_its_templates_turn_end(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    student = biased_student(tmp_path / "student", "qwen3_base_bpe", "<|im_end|>")
    teacher = build_tiny_causal_lm(tmp_path / "teacher", seed=1, tokenizer_kind="qwen3_instruct_bpe")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"rev:{w}", "answer": w[::-1]}) + "\n" for w in WORDS))
    run_dir = tmp_path / "run"
    inputs = {"student": student, "teacher": teacher, "data": data}
    overrides = (
        "trainer.total_steps=2",
        "trainer.eval_every=2",
        f"trainer.log_samples={BATCH}",
        f"rollout.sampling.max_new_tokens={MAX_NEW_TOKENS}",
        "data.max_prompt_length=64",
        "algorithm.schedule=sync",
    )
    proc = run_cli(inputs, run_dir, *overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    tokenizer = AutoTokenizer.from_pretrained(student)
    im_end, eos = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id
    assert im_end != eos
    samples = [json.loads(line) for line in (run_dir / SAMPLES_FILE).read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * BATCH + [2] * BATCH, "the first step, then every trainer.eval_every"
    ended_at_turn_end = 0
    for sample in samples:
        ids = sample["response_ids"]
        assert not {im_end, eos} & set(ids[:-1]), f"a token after the turn end: {sample}"
        if ids[-1] == im_end:
            ended_at_turn_end += 1
            assert sample["ended"] == f"stop '<|im_end|>' ({im_end})" and sample["response"].endswith("<|im_end|>")
        else:
            assert sample["ended"] == "length" and len(ids) == MAX_NEW_TOKENS
        # The teacher scored the response as sampled, its turn end included.
        assert sample["teacher_mean_logprob"] < 0 and sample["prompt"].endswith("<|im_start|>assistant\n")
    assert ended_at_turn_end >= 4
    rows = read_metrics(run_dir)
    for row in rows:
        assert 0 <= row["response_clipped_frac"] <= 1 and 1 <= row["response_length"] <= MAX_NEW_TOKENS
    step_one = [s for s in samples if s["step"] == 1]
    clipped = sum(s["ended"] == "length" for s in step_one) / len(step_one)
    assert rows[0]["response_clipped_frac"] == pytest.approx(clipped), "one worker: its whole batch is logged"
