"""Held-out greedy exact-match accuracy of a model on the demo task (HF generate, batched)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from recipe_gkd.demo.sft import encode_prompt
from recipe_gkd.demo.task import Example, read_jsonl, reward
from recipe_gkd.rollout.hf import plain_generation_config, without_model_generation_defaults

EVAL_BATCH_SIZE = 64
MAX_NEW_TOKENS = 16


@torch.no_grad()
def greedy_responses(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    batch_size: int = EVAL_BATCH_SIZE,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> list[str]:
    """Greedy completions of `prompts` (chat template, left padding), decoded without specials."""
    model.eval()
    out: list[str] = []
    for first in range(0, len(prompts), batch_size):
        encoded = [encode_prompt(tokenizer, p) for p in prompts[first : first + batch_size]]
        width = max(len(ids) for ids in encoded)
        # Left padding: every prompt ends at the same column, so new tokens line up.
        input_ids_BP = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
        attention_BP = torch.zeros((len(encoded), width), dtype=torch.long)
        for i, ids in enumerate(encoded):
            input_ids_BP[i, width - len(ids) :] = torch.tensor(ids)
            attention_BP[i, width - len(ids) :] = 1
        config = plain_generation_config(tokenizer, greedy=True, max_new_tokens=max_new_tokens)
        with without_model_generation_defaults(model):
            sequences_BS = model.generate(input_ids=input_ids_BP, attention_mask=attention_BP, generation_config=config)
        out.extend(tokenizer.batch_decode(sequences_BS[:, width:], skip_special_tokens=True))
    return out


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
