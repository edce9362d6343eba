"""Tokenizers as real instruct models ship them (SmolLM2, Qwen): byte-level BPE, a ChatML template that injects
a default system prompt, eos == pad, no BOS added; in-process, on the real rollout worker, teacher and actor.

- the tokenizer itself has that shape;
- the response mask covers the EOS the student sampled (with eos == pad a mask from `!= pad_id` would drop it);
- the prompt the student samples from and the prompt the teacher scores are the same token ids, those of the
  ChatML text written out by hand, and the teacher's scores are those of its own forward pass on them;
- a student distilled from a teacher that answers and stops learns to stop: its response length falls.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scorers import RecordingScorer

from recipe_gkd import gkd
from recipe_gkd.actor.collate import collate
from recipe_gkd.config import GKDConfig, load_config
from recipe_gkd.observe.metrics import MetricsLogger, read_metrics
from recipe_gkd.offline_models import CHATML_DEFAULT_SYSTEM, IM_END, IM_START
from recipe_gkd.rollout.worker import RolloutWorker
from recipe_gkd.runtime.local_pools import InProcessTeacher, local_pools
from recipe_gkd.targets import build_target

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 16


def chatml_text(user: str) -> str:
    """The ChatML prompt written out by hand: the default system turn, the user turn, the assistant's start."""
    return f"{IM_START}system\n{CHATML_DEFAULT_SYSTEM}{IM_END}\n{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n"


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from chatml import CHATML_PROMPTS

    path = tmp_path_factory.mktemp("chatml_data") / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CHATML_PROMPTS))
    return path


def chatml_config(student: Path, teacher: Path, data: Path, run_dir: Path, *overrides: str) -> GKDConfig:
    return load_config(
        None,
        [
            f"model.student_path={student}",
            f"teacher.model_path={teacher}",
            f"data.train_files=[{data}]",
            "data.eval_files=[]",
            "data.train_batch_size=8",
            "data.max_prompt_length=64",
            "actor.micro_batch_size=8",
            f"rollout.sampling.max_new_tokens={MAX_NEW_TOKENS}",
            "algorithm.schedule=sync",
            "trainer.eval_every=0",
            f"trainer.run_dir={run_dir}",
            *overrides,
        ],
    )


def test_the_tokenizer_is_shaped_like_real_instruct_models(chatml_models: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chatml_models["student"])
    assert tokenizer.eos_token == tokenizer.pad_token == IM_END and tokenizer.bos_token is None
    text = "héllo wörld ✓ 42"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text, "byte-level: any text round-trips"
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"], "no BOS (nor anything else) added"
    messages = [{"role": "user", "content": "rev:abc"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == chatml_text("rev:abc"), "the template injects the default system prompt"
    own_system = [{"role": "system", "content": "Be brief."}, *messages]
    rendered = tokenizer.apply_chat_template(own_system, add_generation_prompt=True, tokenize=False)
    assert CHATML_DEFAULT_SYSTEM not in rendered and rendered.startswith(f"{IM_START}system\nBe brief.{IM_END}")


@pytest.fixture(scope="module")
def stopping_rollout(
    chatml_models: dict[str, Path], prompts_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """One batch sampled by a student that answers and stops (the taught teacher's weights), scored by the teacher."""
    teacher = chatml_models["teacher"]
    cfg = chatml_config(teacher, teacher, prompts_file, tmp_path_factory.mktemp("rollout") / "run")
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
    return {"cfg": cfg, "worker": worker, "scorer": scorer, "sampled_from": sampled_from, "shard": shards[0]}


def test_the_response_mask_includes_the_eos_the_student_sampled(stopping_rollout: dict[str, Any]) -> None:
    tokenizer = stopping_rollout["worker"].engine.tokenizer
    eos = tokenizer.eos_token_id
    assert eos == tokenizer.pad_token_id
    sequences = stopping_rollout["shard"].sequences
    stopped = [s for s in sequences if s.input_ids[-1] == eos]
    assert len(stopped) >= len(sequences) // 2, "the student answers and stops"
    batch = collate(sequences, pad_id=tokenizer.pad_token_id)
    for row, seq in enumerate(sequences):
        length = len(seq.input_ids)
        # Position t predicts token t + 1: the response rs..L-1 is predicted at rs-1..L-2, its last token included.
        expected = np.zeros(batch.loss_mask_BT.shape[1], dtype=bool)
        expected[seq.response_start - 1 : length - 1] = True
        np.testing.assert_array_equal(batch.loss_mask_BT[row].numpy(), expected)
    assert batch.num_tokens == sum(s.num_response_tokens for s in sequences)
    # The same batch masked the way eos == pad breaks (`!= pad_id`) would drop every sampled EOS.
    naive = sum(int((s.input_ids[s.response_start :] != tokenizer.pad_token_id).sum()) for s in sequences)
    assert naive == batch.num_tokens - len(stopped)


def test_the_student_and_the_teacher_see_the_same_prompt_ids(
    stopping_rollout: dict[str, Any], chatml_models: dict[str, Path]
) -> None:
    from chatml import CHATML_PROMPTS
    from transformers import AutoModelForCausalLM

    tokenizer = stopping_rollout["worker"].engine.tokenizer
    sequences = stopping_rollout["shard"].sequences
    asked = stopping_rollout["scorer"].asked
    sampled_from = stopping_rollout["sampled_from"]
    assert len(asked) == len(sampled_from) == len(sequences) == 8
    teacher = AutoModelForCausalLM.from_pretrained(chatml_models["teacher"], dtype=torch.float32).eval()
    for seq, (scored_ids, start), student_prompt in zip(sequences, asked, sampled_from, strict=True):
        reference = tokenizer(chatml_text(CHATML_PROMPTS[seq.sample_id]), add_special_tokens=False)["input_ids"]
        assert reference[0] == tokenizer.convert_tokens_to_ids(IM_START), "no BOS in front of the chat"
        assert student_prompt == reference, "the student sampled from the ChatML prompt, default system turn included"
        assert start == len(reference) and scored_ids[:start] == reference, "the teacher scored the same prompt"
        assert scored_ids == seq.input_ids.tolist()
        # What the teacher returned is its own forward pass on exactly those ids (nothing re-tokenized or added).
        with torch.no_grad():
            logits_TV = teacher(input_ids=torch.tensor([scored_ids])).logits[0].double()
        logprobs_TV = torch.log_softmax(logits_TV, dim=-1)
        targets = torch.tensor(scored_ids[start:])
        expected = logprobs_TV[start - 1 : len(scored_ids) - 1].gather(-1, targets[:, None])[:, 0].numpy()
        np.testing.assert_allclose(seq.teacher_sampled_logprob, expected, atol=2e-3)


def test_a_student_that_learns_to_stop_does_stop(
    chatml_models: dict[str, Path], prompts_file: Path, tmp_path: Path
) -> None:
    """A random student rambles to rollout.sampling.max_new_tokens; the teacher answers in one token and stops.
    Forward KL on the student's own samples teaches it the EOS too: its responses get short."""
    steps = 30
    cfg = chatml_config(
        chatml_models["student"],
        chatml_models["teacher"],
        prompts_file,
        tmp_path / "run",
        f"trainer.total_steps={steps}",
        "actor.optim.lr=1e-2",
    )
    metrics = MetricsLogger(cfg.trainer.run_dir, cfg.trainer.loggers, steps)
    try:
        with local_pools(cfg) as pools:
            gkd.train(cfg, pools, metrics, None)
    finally:
        metrics.close()
    lengths = [r["response_tokens"] / r["sequences"] for r in read_metrics(Path(cfg.trainer.run_dir))]
    assert np.mean(lengths[:3]) > 0.8 * MAX_NEW_TOKENS, f"the random student does not stop: {lengths}"
    assert np.mean(lengths[-5:]) < 4, f"the distilled student answers and stops: {lengths}"
