"""Held-out greedy exact-match accuracy of a model on the demo task (HF generate, batched)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from recipe_gkd.demo.sft import encode_prompt
from recipe_gkd.demo.task import Example, read_jsonl, reward
from recipe_gkd.rollout.hf import left_pad, plain_generation_config, without_model_generation_defaults

EVAL_BATCH_SIZE = 64
MAX_NEW_TOKENS = 16


@torch.no_grad()
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
    model.eval()
    starts = list(prefixes) if prefixes is not None else [""] * len(prompts)
    out: list[str] = []
    for first in range(0, len(prompts), batch_size):
        batch = range(first, min(first + batch_size, len(prompts)))
        encoded = [
            encode_prompt(tokenizer, prompts[i])
            + (list(tokenizer(starts[i], add_special_tokens=False).input_ids) if starts[i] else [])
            for i in batch
        ]
        input_ids_BP, attention_BP = left_pad(encoded, tokenizer.pad_token_id)
        config = plain_generation_config(tokenizer, greedy=True, max_new_tokens=max_new_tokens)
        with without_model_generation_defaults(model):
            sequences_BS = model.generate(input_ids=input_ids_BP, attention_mask=attention_BP, generation_config=config)
        texts = tokenizer.batch_decode(sequences_BS[:, input_ids_BP.shape[1] :], skip_special_tokens=True)
        out.extend(starts[i] + text for i, text in zip(batch, texts, strict=True))
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
