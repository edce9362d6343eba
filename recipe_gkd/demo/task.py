"""The demo's toy task: reverse a string of 5-8 lowercase letters (``rev:abcde`` -> ``edcba``).

A few hundred thousand parameters learn it on a CPU in minutes, and a 2-layer student warmed
up briefly gets only about a third of held-out prompts right, which leaves room for
distillation to show. Every record is ``{"prompt", "response", "answer"}``: ``prompt`` is the
user text (fed through the chat template), ``response`` the reference answer without EOS
(off-policy distillation, SFT), ``answer`` the exact-match target of :func:`reward`.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from recipe_gkd.data import answer_reward

TASK_NAME = "reverse"
PROMPT_PREFIX = "rev:"
ALPHABET = string.ascii_lowercase
MIN_LETTERS = 5
MAX_LETTERS = 8
TRAIN_SIZE = 20_000
EVAL_SIZE = 500
# Held out like eval, but only used while building the assets (to stop the student's warm-up).
DEV_SIZE = 256
DEFAULT_SEED = 1234


@dataclass(frozen=True)
class Example:
    """One task record, as written to the jsonl files."""

    prompt: str
    response: str
    answer: str


def make_example(word: str) -> Example:
    """The record asking to reverse `word`."""
    reversed_word = word[::-1]
    return Example(prompt=f"{PROMPT_PREFIX}{word}", response=reversed_word, answer=reversed_word)


def _random_word(rng: random.Random) -> str:
    length = rng.randint(MIN_LETTERS, MAX_LETTERS)
    return "".join(rng.choice(ALPHABET) for _ in range(length))


@dataclass(frozen=True)
class Splits:
    """Disjoint task splits: `train` (written), `dev` (build-time only) and held-out `eval` (written)."""

    train: list[Example]
    dev: list[Example]
    eval: list[Example]


def generate_splits(
    seed: int = DEFAULT_SEED, train_size: int = TRAIN_SIZE, eval_size: int = EVAL_SIZE, dev_size: int = DEV_SIZE
) -> Splits:
    """Deterministic splits with distinct prompts and no prompt in two splits.

    Words are drawn in the order eval, dev, train, so the held-out splits do not depend on
    `train_size`.
    """
    rng = random.Random(seed)
    seen: set[str] = set()
    words: list[str] = []
    while len(words) < eval_size + dev_size + train_size:
        word = _random_word(rng)
        if word not in seen:
            seen.add(word)
            words.append(word)
    examples = [make_example(w) for w in words]
    return Splits(
        train=examples[eval_size + dev_size :],
        dev=examples[eval_size : eval_size + dev_size],
        eval=examples[:eval_size],
    )


def reward(response: str, answer: str, match: str = "exact") -> float:
    """The pipeline's task reward (data.answer_match = `match`): 1.0 for a matching response, else 0.0."""
    return answer_reward(response, answer, match)


def write_records(path: str | Path, records: Iterable[dict[str, Any]]) -> Path:
    """Write one JSON object per line (sorted keys, so the bytes are reproducible): every demo task's data files."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, sort_keys=True) + "\n")
    return out


def read_records(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The first `limit` JSON objects (all when None) of a jsonl file, blank lines skipped."""
    records: list[dict[str, Any]] = []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(records) >= limit:
                break
            if line.strip():
                records.append(json.loads(line))
    return records


def write_jsonl(path: str | Path, examples: Iterable[Example]) -> Path:
    """Write the examples one JSON object per line."""
    return write_records(path, (asdict(example) for example in examples))


def read_jsonl(path: str | Path, limit: int | None = None) -> list[Example]:
    """Read the first `limit` records (all when None) of a task jsonl file."""
    return [Example(r["prompt"], r["response"], r["answer"]) for r in read_records(path, limit)]
