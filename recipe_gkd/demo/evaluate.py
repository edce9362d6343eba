"""Held-out greedy exact-match accuracy of a model on the demo task (HF generate, batched)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from recipe_gkd.demo.sft import encode_prompt
from recipe_gkd.demo.task import Example, read_jsonl, reward
from recipe_gkd.rollout.answer_accuracy import greedy_texts
from recipe_gkd.stop_set import stop_set_of

EVAL_BATCH_SIZE = 64
MAX_NEW_TOKENS = 16


def greedy_responses(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    batch_size: int = EVAL_BATCH_SIZE,
    max_new_tokens: int = MAX_NEW_TOKENS,
    prefixes: Sequence[str] | None = None,
) -> list[str]:
    """Greedy completions of `prompts` (chat template, left padding), decoded without specials.

    `prefixes`: a forced start of each response (its tokens follow the prompt); returned in front
    of the completion.
    """
    starts = list(prefixes) if prefixes is not None else [""] * len(prompts)
    encoded = [
        encode_prompt(tokenizer, prompt) + (list(tokenizer(start, add_special_tokens=False).input_ids) if start else [])
        for prompt, start in zip(prompts, starts, strict=True)
    ]
    # The demo's tokenizers close a turn with their EOS, and their models ship no generation_config eos list.
    stop = stop_set_of(tokenizer, None, chat_template=True, what="the demo's tokenizer")
    texts = greedy_texts(model, tokenizer, stop, encoded, max_new_tokens, batch_size)
    return [start + text for start, text in zip(starts, texts, strict=True)]


def accuracy_on(
    model: torch.nn.Module,
    tokenizer: Any,
    examples: Sequence[Example],
    match: str = "exact",
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> float:
    """Mean reward (`match`: task.reward) of greedy responses over `examples`."""
    if not examples:
        raise ValueError("accuracy_on needs at least one example")
    responses = greedy_responses(model, tokenizer, [e.prompt for e in examples], max_new_tokens=max_new_tokens)
    return sum(reward(r, e.answer, match) for r, e in zip(responses, examples, strict=True)) / len(examples)


def greedy_accuracy(
    model_dir: str | Path,
    eval_file: str | Path,
    n: int | None = None,
    match: str = "exact",
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> float:
    """Greedy accuracy (`match`: task.reward) of the HF model in `model_dir` on the first `n` eval records."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return accuracy_on(model, tokenizer, read_jsonl(eval_file, limit=n), match, max_new_tokens)
