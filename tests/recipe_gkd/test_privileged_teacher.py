"""A teacher prompt of its own per record (privileged context), on the real rollout worker with a ChatML tokenizer
shaped like real instruct models (byte-level BPE, a default system prompt injected by the template, eos == pad):

- the teacher receives its own prompt, rendered with its chat template and generation prompt (the hand-written
  ChatML text), followed by exactly the student's sampled ids, with score_from at the join; its reply rows are its
  own full forward pass on those ids, position for position;
- the student samples from its own prompt only, in training and in held-out evaluation, and the actor's sequences
  carry the student's prompt, never the teacher's;
- a record without the field exits 2 naming the key and the record, before anything starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# pytest's default (prepend) import mode puts this directory on sys.path: the in-process teacher that records.
from scorers import RecordingScorer

from recipe_gkd.config import GKDConfig, load_config
from recipe_gkd.offline_models import CHATML_DEFAULT_SYSTEM, IM_END, IM_START
from recipe_gkd.rollout.worker import RolloutWorker
from recipe_gkd.runtime.local_pools import InProcessTeacher
from recipe_gkd.targets import build_target

pytestmark = pytest.mark.slow

TEMPLATE = "{prompt} -- Reference solution: {solution}"
WORDS = ("abcde", "hello", "qwert", "zyxwv")


def chatml_text(user: str, system: str = CHATML_DEFAULT_SYSTEM) -> str:
    return f"{IM_START}system\n{system}{IM_END}\n{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n"


def records() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"prompt": f"rev:{w}", "solution": w[::-1], "answer": w[::-1]} for w in WORDS]
    # A record with its own system turn (the template must keep it) and a solution with a split UTF-8 character.
    out.append(
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "rev:héllo"}],
            "solution": "olléh ✓",
            "answer": "olléh",
        }
    )
    return out


def expected_teacher_text(record: dict[str, Any]) -> str:
    prompt = record["prompt"]
    if isinstance(prompt, list):
        return chatml_text(TEMPLATE.format(prompt=prompt[1]["content"], solution=record["solution"]), "Be brief.")
    return chatml_text(TEMPLATE.format(prompt=prompt, solution=record["solution"]))


def expected_student_text(record: dict[str, Any]) -> str:
    prompt = record["prompt"]
    return chatml_text(prompt[1]["content"], "Be brief.") if isinstance(prompt, list) else chatml_text(prompt)


def privileged_config(models: dict[str, Path], data: Path, run_dir: Path, *overrides: str) -> GKDConfig:
    return load_config(
        None,
        [
            f"model.student_path={models['student']}",
            f"teacher.model_path={models['teacher']}",
            f"data.train_files=[{data}]",
            f"data.eval_files=[{data}]",
            f"data.train_batch_size={len(records())}",
            f"data.eval_batch_size={len(records())}",
            "data.max_prompt_length=48",
            "data.max_teacher_prompt_length=80",
            f"data.teacher_prompt_template='{TEMPLATE}'",
            f"actor.micro_batch_size={len(records())}",
            "rollout.sampling.max_new_tokens=8",
            "teacher.top_k=8",
            "algorithm.schedule=sync",
            f"trainer.run_dir={run_dir}",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("privileged_data") / "train.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records()))
    return path


@pytest.fixture(scope="module")
def privileged_rollout(
    chatml_models: dict[str, Path], data_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    cfg = privileged_config(chatml_models, data_file, tmp_path_factory.mktemp("privileged") / "run")
    scorer = RecordingScorer(InProcessTeacher(cfg))
    worker = RolloutWorker(cfg, 0, 1, build_target(cfg))
    worker.setup(scorer=scorer)
    assert worker.engine is not None
    sampled_from: list[list[int]] = []
    generate = worker.engine.generate

    def recording_generate(prompts: list[list[int]], **kwargs: Any) -> Any:
        sampled_from.extend(list(p) for p in prompts)
        return generate(prompts, **kwargs)

    worker.engine.generate = recording_generate  # type: ignore[method-assign]
    _, shards = worker.produce(0, dp_size=1)
    train = {"asked": list(scorer.asked), "sampled_from": list(sampled_from), "sequences": shards[0].sequences}
    scorer.asked.clear()
    sampled_from.clear()
    _, eval_shards = worker.produce_eval(dp_size=1)
    held_out = {"asked": list(scorer.asked), "sampled_from": list(sampled_from), "sequences": eval_shards[0].sequences}
    return {"worker": worker, "train": train, "eval": held_out}


@pytest.mark.parametrize("phase", ["train", "eval"])
def test_the_teacher_scores_its_own_prompt_then_the_students_sampled_ids(
    privileged_rollout: dict[str, Any], chatml_models: dict[str, Path], phase: str
) -> None:
    from transformers import AutoModelForCausalLM

    tokenizer = privileged_rollout["worker"].engine.tokenizer
    got = privileged_rollout[phase]
    assert len(got["asked"]) == len(got["sampled_from"]) == len(got["sequences"]) == len(records())
    teacher = AutoModelForCausalLM.from_pretrained(chatml_models["teacher"], dtype=torch.float32).eval()
    for seq, (scored, start), student_prompt in zip(got["sequences"], got["asked"], got["sampled_from"], strict=True):
        record = records()[seq.sample_id]
        student_ids = tokenizer(expected_student_text(record), add_special_tokens=False)["input_ids"]
        teacher_ids = tokenizer(expected_teacher_text(record), add_special_tokens=False)["input_ids"]
        assert student_prompt == student_ids, "the student samples from its own prompt only"
        assert seq.input_ids[: seq.response_start].tolist() == student_ids, "the actor trains on the student's prompt"
        assert start == len(teacher_ids) and scored[:start] == teacher_ids, "the teacher's own ChatML prompt"
        response = seq.input_ids[seq.response_start :].tolist()
        assert scored[start:] == response, "the student's sampled ids, exactly, after the join"
        assert "Reference solution" not in tokenizer.decode(seq.input_ids)
        # Row i of the reply is the teacher's distribution for response token i: its own full forward pass on the
        # concatenated ids (float64 log-softmax of fp32 logits; the backend's fp32 logits differ by reduction
        # order only, far below 1e-3).
        with torch.no_grad():
            logits_TV = teacher(input_ids=torch.tensor([scored])).logits[0].double()
        logprobs_TV = torch.log_softmax(logits_TV, dim=-1)[start - 1 : len(scored) - 1]
        expected = logprobs_TV.gather(-1, torch.tensor(response)[:, None])[:, 0].numpy()
        np.testing.assert_allclose(seq.teacher_sampled_logprob, expected, atol=1e-3)
        top_lp, top_ids = logprobs_TV.topk(8, dim=-1)
        np.testing.assert_allclose(seq.teacher_topk_logprobs, top_lp.numpy(), atol=1e-3)
        assert (seq.teacher_topk_ids[:, 0] == top_ids[:, 0].numpy()).all()


def test_a_record_without_the_field_exits_2_naming_the_key_and_the_record(
    chatml_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from recipe_gkd.main import main

    data = tmp_path / "train.jsonl"
    rows = records()[:3]
    del rows[2]["solution"]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        f"model.student_path={chatml_models['student']}",
        f"teacher.model_path={chatml_models['teacher']}",
        f"data.train_files=[{data}]",
        "data.eval_files=[]",
        "trainer.eval_every=0",
        "data.train_batch_size=4",
        "actor.micro_batch_size=4",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]
    assert main([*overrides, "data.teacher_prompt_template='{prompt} {solution}'"]) == 2
    err = capsys.readouterr().err
    assert "data.teacher_prompt_template" in err and f"record 2 of {data}" in err and "'solution'" in err
    assert main([*overrides, "data.teacher_prompt_key=hint"]) == 2
    err = capsys.readouterr().err
    assert "data.teacher_prompt_key" in err and "'hint'" in err


def test_the_privileged_preset_runs_through_the_cli(tmp_path: Path, repo_root: Path) -> None:
    """configs/presets/cpu_privileged.yaml through the CLI (the autostarted ZeroMQ teacher, hf backend) for a few
    steps: the report gives the teacher's held-out accuracy from the student's prompt (the letters: it cannot
    answer) and from its own (rev: + the letters: it can)."""
    import subprocess
    import sys

    preset = repo_root / "configs" / "presets" / "cpu_privileged.yaml"
    if not (repo_root / "assets" / "privileged" / "data" / "train.jsonl").is_file():
        pytest.skip("the demo's data are not built (python -m recipe_gkd.demo.privileged)")
    run_dir = tmp_path / "run"
    overrides = ["trainer.total_steps=2", "trainer.eval_every=2", "data.eval_batch_size=16", "teacher.timeout_s=180"]
    cmd = [sys.executable, "-m", "recipe_gkd.main", "--config", str(preset), f"trainer.run_dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=repo_root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = (run_dir / "summary.txt").read_text()
    assert "teacher held-out accuracy: 0.0% over the 16 of 16" in summary, summary
    own = "teacher held-out accuracy from its own prompt (privileged context): "
    line = next(x for x in summary.splitlines() if x.startswith(own))
    assert float(line.removeprefix(own).split("%")[0]) >= 90.0, line
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
