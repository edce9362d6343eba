"""The paper task: add 4-5 digits left to right, writing every running total.

    prompt    "sum:3816"
    response  "+3=3+8=11+1=12+6=18"
    answer    "=18"          (held-out accuracy: the response ends with the true sum)

Each total is written after the previous one, so a slip early in a response (a wrong total)
carries into every later total and the final answer, unless the model recomputes the total
from the prompt's digits. The teacher is trained to do that: in half of its SFT examples one
intermediate total is wrong (no loss on it) and the totals after it are the true ones, so it
recovers from slips it did not make (`encode_with_slip`). The student's warm-up and the
dataset's responses (what supervised KD, lmbda=0, trains on) have no slips: only a student
that samples its own responses (on-policy, lmbda=1) reaches the states after a slip, where
the teacher shows it how to recover. That is the train/inference mismatch GKD is about.
Records are ``{"prompt", "response", "answer"}`` like the demo's; the run compares with
``data.answer_match=suffix``.
"""

from __future__ import annotations

import itertools
import random
import re
from typing import Any

from recipe_gkd.demo.sft import EncodedExample, encode_prompt
from recipe_gkd.demo.task import Example, Splits

TASK_NAME = "running_sum"
PROMPT_PREFIX = "sum:"
DIGITS = "123456789"
MIN_DIGITS = 4
MAX_DIGITS = 5
EVAL_SIZE = 500
DEV_SIZE = 256
DEFAULT_SEED = 4321
# Share of the teacher's SFT examples with one wrong intermediate total to recover from.
TEACHER_SLIP_FRACTION = 0.5
# A slip moves a total by 1..MAX_SLIP either way (never below 0).
MAX_SLIP = 3
STEP = re.compile(r"\+(\d)=(\d+)")


def make_example(digits: str) -> Example:
    """The record asking for the sum of `digits`, its response adding them left to right."""
    totals = list(itertools.accumulate(int(d) for d in digits))
    response = "".join(f"+{d}={t}" for d, t in zip(digits, totals, strict=True))
    return Example(prompt=f"{PROMPT_PREFIX}{digits}", response=response, answer=f"={totals[-1]}")


def all_prompts() -> list[str]:
    """Every prompt of the task: 4 or 5 digits 1-9 (repeats allowed): 65,610 of them."""
    return ["".join(p) for n in range(MIN_DIGITS, MAX_DIGITS + 1) for p in itertools.product(DIGITS, repeat=n)]


def generate_splits(seed: int = DEFAULT_SEED, eval_size: int = EVAL_SIZE, dev_size: int = DEV_SIZE) -> Splits:
    """Every prompt once, shuffled: held-out eval, build-time dev, the rest train."""
    prompts = all_prompts()
    random.Random(seed).shuffle(prompts)
    examples = [make_example(digits) for digits in prompts]
    return Splits(
        train=examples[eval_size + dev_size :],
        dev=examples[eval_size : eval_size + dev_size],
        eval=examples[:eval_size],
    )


def with_slip(example: Example, rng: random.Random) -> tuple[str, tuple[int, int]]:
    """`example`'s response with one intermediate total wrong, and that total's (start, end) characters.

    The totals after the slip stay the true running sums: the text shows a recovery.
    """
    steps = list(STEP.finditer(example.response))
    slipped = steps[rng.randrange(len(steps) - 1)]  # never the final total: that is the answer
    true_total = int(slipped.group(2))
    wrong = max(0, true_total + rng.choice([-1, 1]) * rng.randint(1, MAX_SLIP))
    if wrong == true_total:
        wrong = true_total + 1
    start, end = slipped.span(2)
    text = example.response[:start] + str(wrong) + example.response[end:]
    return text, (start, start + len(str(wrong)))


def encode_with_slip(tokenizer: Any, example: Example) -> EncodedExample:
    """The teacher's SFT encoding: in TEACHER_SLIP_FRACTION of the examples (fixed per prompt) one slipped
    total, carrying no loss, before the true totals (one token per character: the char tokenizer)."""
    rng = random.Random(f"{DEFAULT_SEED}:{example.prompt}")
    text, loss_mask = example.response, [True] * (len(example.response) + 1)  # + EOS
    if rng.random() < TEACHER_SLIP_FRACTION:
        text, (start, end) = with_slip(example, rng)
        loss_mask = [not start <= i < end for i in range(len(text) + 1)]
    response_ids = [*tokenizer(text, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    if len(response_ids) != len(loss_mask):
        raise ValueError(f"encode_with_slip needs one token per character (the char tokenizer), got {text!r}")
    return EncodedExample(encode_prompt(tokenizer, example.prompt), response_ids, loss_mask)
