"""The paper task (running digit sums) and its preset: records checked against arithmetic done here."""

from __future__ import annotations

import random
import re

import pytest

from recipe_gkd.config import CONFIG_DIR, load_config
from recipe_gkd.demo import build_assets, sum_task
from recipe_gkd.demo.sft import IGNORE_INDEX, collate, encode_example, encode_prompt
from recipe_gkd.demo.task import Example, reward
from recipe_gkd.offline_models import build_char_tokenizer

STEP = re.compile(r"\+(\d)=(\d+)")


@pytest.fixture(scope="module")
def splits():
    return sum_task.generate_splits()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"))


def steps_of(response: str) -> list[tuple[int, int]]:
    steps = [(int(d), int(t)) for d, t in STEP.findall(response)]
    assert "".join(f"+{d}={t}" for d, t in steps) == response
    return steps


def test_every_response_adds_the_digits_left_to_right_with_true_totals(splits) -> None:
    for example in splits.train[:3000] + splits.eval:
        digits = example.prompt.removeprefix(sum_task.PROMPT_PREFIX)
        steps = steps_of(example.response)
        assert [d for d, _ in steps] == [int(c) for c in digits]
        assert [t for _, t in steps] == [sum(int(c) for c in digits[: i + 1]) for i in range(len(digits))]
        assert example.answer == f"={sum(int(c) for c in digits)}"
        assert reward(example.response, example.answer, "suffix") == 1.0


def test_splits_cover_every_prompt_once(splits) -> None:
    prompts = [e.prompt for part in (splits.train, splits.dev, splits.eval) for e in part]
    assert len(prompts) == len(set(prompts)) == len(sum_task.all_prompts()) == 9**4 + 9**5
    assert (len(splits.eval), len(splits.dev)) == (sum_task.EVAL_SIZE, sum_task.DEV_SIZE)
    assert sum_task.generate_splits() == splits  # deterministic


def test_a_slip_is_one_wrong_intermediate_total_and_the_rest_stay_true(splits) -> None:
    rng = random.Random(0)
    for example in splits.train[:500]:
        text, (start, end) = sum_task.with_slip(example, rng)
        true, slipped = steps_of(example.response), steps_of(text)
        wrong = [i for i, (a, b) in enumerate(zip(true, slipped, strict=True)) if a != b]
        assert len(wrong) == 1 and wrong[0] < len(true) - 1  # one total, never the answer
        assert 1 <= abs(slipped[wrong[0]][1] - true[wrong[0]][1]) <= sum_task.MAX_SLIP
        assert text[start:end] == str(slipped[wrong[0]][1]) and text.endswith(example.answer)


def test_the_teachers_examples_carry_no_loss_on_the_slip(splits, tokenizer) -> None:
    encoded = [sum_task.encode_with_slip(tokenizer, e) for e in splits.train[:2000]]
    with_slips = [e for e in encoded if not all(e.loss_mask)]
    assert abs(len(with_slips) / len(encoded) - sum_task.TEACHER_SLIP_FRACTION) < 0.05
    assert [sum_task.encode_with_slip(tokenizer, e) for e in splits.train[:50]] == encoded[:50]  # fixed per prompt
    example = with_slips[0]
    _, _, labels = collate([example], tokenizer.pad_token_id)
    masked = [i for i, keep in enumerate(example.loss_mask) if not keep]
    response_labels = labels[0, len(example.prompt_ids) : len(example.prompt_ids) + len(example.response_ids)]
    assert [i for i, v in enumerate(response_labels.tolist()) if v == IGNORE_INDEX] == masked
    assert response_labels[-1] == tokenizer.eos_token_id


def test_records_fit_the_paper_preset(splits, tokenizer) -> None:
    cfg = load_config(str(CONFIG_DIR / "presets" / "cpu_paper.yaml"), [])
    assert cfg.data.answer_match == "suffix"
    assert cfg.rollout.sampling.max_new_tokens == build_assets.PAPER_MAX_NEW_TOKENS
    longest = max(splits.train + splits.eval, key=lambda e: len(e.response))
    assert len(encode_example(tokenizer, longest).response_ids) <= cfg.rollout.sampling.max_new_tokens
    assert len(encode_prompt(tokenizer, longest.prompt)) <= cfg.data.max_prompt_length


def test_the_paper_assets_have_their_own_recipe() -> None:
    demo, paper = build_assets.recipe(build_assets.DEMO), build_assets.recipe(build_assets.PAPER)
    assert demo["task"]["name"] == "reverse" and paper["task"]["name"] == sum_task.TASK_NAME
    assert paper["task"]["answer_match"] == "suffix" and paper["task"]["teacher_slip_fraction"] == 0.5
    assert build_assets.TASKS == {"demo": build_assets.DEMO, "paper": build_assets.PAPER}
    assert build_assets.PAPER.teacher_encode is sum_task.encode_with_slip
    assert build_assets.DEMO.teacher_encode is encode_example


def test_example_type_is_the_demos() -> None:
    assert isinstance(sum_task.make_example("3816"), Example)
    assert sum_task.make_example("3816") == Example("sum:3816", "+3=3+8=11+1=12+6=18", "=18")
