"""The project's small SFT loop: masked cross-entropy on response tokens, through the chat template.

Prompts are encoded exactly as the pipeline encodes them (``apply_chat_template`` with the
generation prompt), the response is ``tokenizer(response).input_ids + [eos]``, and only the
response tokens (EOS included) carry loss. Plain torch + transformers forward, AdamW.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from recipe_gkd.demo.task import Example

# Label value cross_entropy ignores (prompt and padding positions).
IGNORE_INDEX = -100


@dataclass(frozen=True)
class SFTConfig:
    """Optimisation settings of one SFT run (linear warm-up, then cosine decay to `min_lr_ratio`)."""

    steps: int
    batch_size: int
    lr: float
    warmup_steps: int = 0
    min_lr_ratio: float = 1.0
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class EncodedExample:
    """Prompt ids (chat template, generation prompt included) and response ids ending with EOS.

    `loss_mask`: which response tokens carry loss (None: all), e.g. not a deliberate slip in
    the text that the tokens after it learn to recover from.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[bool] | None = None


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Prompt ids exactly as the pipeline builds them (chat template + generation prompt)."""
    messages = [{"role": "user", "content": prompt}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def encode_example(tokenizer: Any, example: Example) -> EncodedExample:
    """Prompt ids through the chat template and the reference response ids plus EOS."""
    response_ids = list(tokenizer(example.response, add_special_tokens=False).input_ids)
    return EncodedExample(encode_prompt(tokenizer, example.prompt), [*response_ids, tokenizer.eos_token_id])


def collate(batch: Sequence[EncodedExample], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded input ids, attention mask and labels [B, L] (labels only on response tokens).

    Right padding keeps every sequence's positions starting at 0, as generate's positions
    (computed from the attention mask of the left-padded prompt) do.
    """
    width = max(len(e.prompt_ids) + len(e.response_ids) for e in batch)
    input_ids_BL = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_BL = torch.zeros((len(batch), width), dtype=torch.long)
    labels_BL = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    for i, e in enumerate(batch):
        ids = e.prompt_ids + e.response_ids
        input_ids_BL[i, : len(ids)] = torch.tensor(ids)
        attention_BL[i, : len(ids)] = 1
        labels = torch.tensor(e.response_ids)
        if e.loss_mask is not None:
            labels[~torch.tensor(e.loss_mask)] = IGNORE_INDEX
        labels_BL[i, len(e.prompt_ids) : len(ids)] = labels
    return input_ids_BL, attention_BL, labels_BL


def response_loss(model: torch.nn.Module, input_ids_BL: Tensor, attention_BL: Tensor, labels_BL: Tensor) -> Tensor:
    """Token-mean cross-entropy of the labelled (response) tokens."""
    logits_BLV = model(input_ids=input_ids_BL, attention_mask=attention_BL).logits
    # Position t predicts token t + 1.
    logits_NV = logits_BLV[:, :-1].reshape(-1, logits_BLV.shape[-1])  # [B*(L-1), V]
    targets_N = labels_BL[:, 1:].reshape(-1)  # [B*(L-1)]
    return torch.nn.functional.cross_entropy(logits_NV.float(), targets_N, ignore_index=IGNORE_INDEX)


def lr_at(step: int, cfg: SFTConfig) -> float:
    """Learning rate of `step` (0-based): linear warm-up, then cosine from lr to lr * min_lr_ratio."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def batch_order(num_examples: int, steps: int, batch_size: int, seed: int) -> list[list[int]]:
    """Index batches for `steps` steps: a fresh seeded permutation each epoch, no partial batch."""
    rng = random.Random(seed)
    batches: list[list[int]] = []
    order: list[int] = []
    while len(batches) < steps:
        if len(order) < batch_size:
            epoch = list(range(num_examples))
            rng.shuffle(epoch)
            order = epoch
        batches.append(order[:batch_size])
        order = order[batch_size:]
    return batches


def sft_train(
    model: torch.nn.Module,
    tokenizer: Any,
    examples: Sequence[Example],
    cfg: SFTConfig,
    stop: Callable[[int], bool] | None = None,
    encode: Callable[[Any, Example], EncodedExample] = encode_example,
) -> list[float]:
    """Train `model` in place for up to `cfg.steps` AdamW steps; returns the loss of every step.

    `stop(steps_done)` is called after every step; training ends early when it returns True.
    `encode` turns an example into token ids (once, before training).
    """
    encoded = [encode(tokenizer, e) for e in examples]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    losses: list[float] = []
    for step, indices in enumerate(batch_order(len(encoded), cfg.steps, cfg.batch_size, cfg.seed)):
        model.train()  # `stop` may have evaluated the model
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = response_loss(model, *collate([encoded[i] for i in indices], tokenizer.pad_token_id))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        optimizer.step()
        losses.append(loss.item())
        if stop is not None and stop(step + 1):
            break
    model.eval()
    return losses
