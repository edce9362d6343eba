"""Greedy answers of an HF model to held-out records and its accuracy on those that carry an answer.

Held-out sets mix records with a short answer (`data.answer_key`) and open-ended prompts
without one: accuracy counts only the records with an answer and says how many there were
(`AnswerAccuracy.answered`); with none, there is no accuracy. Prompts are encoded exactly as the
rollout worker encodes them (`data.prompt_key`, `data.apply_chat_template`), answers compared by
`data.answer_match`. The run's report uses it for the teacher's own figure (rollout worker 0,
after training); the demo's asset builder for its models.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from recipe_gkd.config import DataConfig
from recipe_gkd.data import answer_reward, encode_prompt
from recipe_gkd.stop_set import StopSet, stop_set_of

# Prompts decoded together: bounds the KV cache (batch x (prompt + new tokens) x layers).
GREEDY_BATCH = 64


@dataclass(frozen=True)
class AnswerAccuracy:
    """Greedy accuracy over the records that have an answer, and how many records that was."""

    correct: float  # sum of the rewards (1 per matching response)
    answered: int  # records with an answer: the ones scored
    records: int  # records read (with and without an answer)

    @property
    def accuracy(self) -> float | None:
        """correct / answered; None when no record had an answer."""
        return self.correct / self.answered if self.answered else None

    def describe(self, what: str, answer_key: str) -> str:
        """One line with the figure and what it counts (the run's report)."""
        if self.accuracy is None:
            return f"{what}: none of the {self.records} held-out records has an answer (data.answer_key={answer_key})"
        return (
            f"{what}: {100 * self.accuracy:.1f}% over the {self.answered} of {self.records} held-out records "
            f"that have an answer (data.answer_key={answer_key})"
        )


def greedy_texts(
    model: Any,
    tokenizer: Any,
    stop: StopSet,
    prompt_ids: Sequence[list[int]],
    max_new_tokens: int,
    batch_size: int = GREEDY_BATCH,
) -> list[str]:
    """Greedy completions of prompts given as token ids (left-padded batches), each cut at its first stop id,
    decoded without specials.

    Only the given settings shape the decoding: the model's generation_config.json is kept out (its eos ids are
    in `stop`).
    """
    # torch and transformers only here: the driver imports this module's AnswerAccuracy.
    import torch

    from recipe_gkd.rollout.hf import left_pad, plain_generation_config, without_model_generation_defaults

    model.eval()
    config = plain_generation_config(tokenizer, stop, greedy=True, max_new_tokens=max_new_tokens)
    device = next(model.parameters()).device
    out: list[str] = []
    for first in range(0, len(prompt_ids), batch_size):
        input_ids_BP, attention_BP = left_pad(list(prompt_ids[first : first + batch_size]), tokenizer.pad_token_id)
        with torch.no_grad(), without_model_generation_defaults(model):
            sequences_BS = model.generate(
                input_ids=input_ids_BP.to(device), attention_mask=attention_BP.to(device), generation_config=config
            )
        for new_ids in sequences_BS[:, input_ids_BP.shape[1] :].cpu().tolist():
            length, _ = stop.end(new_ids)  # the padding after a stop id is not the response's
            out.append(tokenizer.decode(new_ids[:length], skip_special_tokens=True))
    return out


def answer_accuracy(
    model: Any,
    tokenizer: Any,
    stop: StopSet,
    records: Sequence[dict[str, Any]],
    data: DataConfig,
    max_new_tokens: int,
    encode: Callable[[Any, dict[str, Any]], list[int]] | None = None,
) -> AnswerAccuracy:
    """Greedy accuracy of `model` on the `records` that have `data.answer_key` (the others are only counted).

    `encode(tokenizer, record)`: the prompt ids (default: the student's prompt, as the rollout worker encodes it)."""
    answered = [r for r in records if r.get(data.answer_key) is not None]
    if not answered:
        return AnswerAccuracy(correct=0.0, answered=0, records=len(records))
    if encode is None:
        prompts = [encode_prompt(tokenizer, r, data.prompt_key, data.apply_chat_template) for r in answered]
    else:
        prompts = [encode(tokenizer, r) for r in answered]
    responses = greedy_texts(model, tokenizer, stop, prompts, max_new_tokens)
    correct = sum(
        answer_reward(text, str(r[data.answer_key]), data.answer_match)
        for text, r in zip(responses, answered, strict=True)
    )
    return AnswerAccuracy(correct=correct, answered=len(answered), records=len(records))


def model_answer_accuracy(
    model_dir: str,
    records: Sequence[dict[str, Any]],
    data: DataConfig,
    max_new_tokens: int,
    encode: Callable[[Any, dict[str, Any]], list[int]] | None = None,
) -> AnswerAccuracy:
    """`answer_accuracy` of the HF model and tokenizer in `model_dir` (fp32, CPU), loaded for this call only; it
    stops where the model's own stop set says (its EOS, generation_config.json's, its template's turn end)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stop = stop_set_of(tokenizer, model_dir, chat_template=data.apply_chat_template, what=model_dir)
    return answer_accuracy(model, tokenizer, stop, records, data, max_new_tokens, encode)
