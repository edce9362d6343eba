"""Greedy responses and the three held-out measures of a student against the teacher.

For each held-out prompt the student writes its greedy response (chat template, up to
max_new_tokens, EOS included when written); then, over the response tokens only:

(a) teacher_kl: KL(teacher || student) over the full vocabulary, mean per token, on the
    student's own greedy response (what on-policy distillation trains on);
(b) teacher_logprob: the teacher's mean log-probability of the tokens the student wrote;
(c) rouge_l: ROUGE-L F1 (words) of the student's response against the teacher's greedy response.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.real_pair.rouge import rouge_l
from recipe_gkd.demo.sft import encode_prompt
from recipe_gkd.rollout.hf import left_pad, plain_generation_config, without_model_generation_defaults

GREEDY_BATCH = 16


@dataclass(frozen=True)
class Response:
    ids: list[int]  # generated ids, EOS included when the model wrote it
    text: str  # decoded without special tokens
    ended: bool  # EOS within max_new_tokens


def greedy(model: Any, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int) -> list[Response]:
    """Greedy responses of `model` (left-padded batches of GREEDY_BATCH), cut after the first EOS."""
    model.eval()
    config = plain_generation_config(tokenizer, greedy=True, max_new_tokens=max_new_tokens)
    eos = tokenizer.eos_token_id
    out: list[Response] = []
    for first in range(0, len(prompts), GREEDY_BATCH):
        encoded = [encode_prompt(tokenizer, p) for p in prompts[first : first + GREEDY_BATCH]]
        input_ids_BP, attention_BP = left_pad(encoded, tokenizer.pad_token_id)
        with torch.no_grad(), without_model_generation_defaults(model):
            sequences_BS = model.generate(input_ids=input_ids_BP, attention_mask=attention_BP, generation_config=config)
        for row in sequences_BS[:, input_ids_BP.shape[1] :].tolist():
            ended = eos in row
            ids = row[: row.index(eos) + 1] if ended else row
            out.append(Response(ids, tokenizer.decode(ids, skip_special_tokens=True), ended))
    return out


def response_logprobs(model: Any, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """Log-softmax [R, V] (float32) of `model` at the positions predicting each response token."""
    input_ids_1L = torch.tensor([prompt_ids + response_ids], dtype=torch.long)
    with torch.no_grad():
        logits_LV = model(input_ids=input_ids_1L).logits[0].float()
    # Position t predicts token t + 1: the response's predictions start at the prompt's last token.
    start = len(prompt_ids) - 1
    return torch.log_softmax(logits_LV[start : start + len(response_ids)], dim=-1)


@dataclass(frozen=True)
class Scores:
    teacher_kl: float  # mean per response token, nats
    teacher_logprob: float  # mean per response token, nats
    rouge_l: float  # mean F1 over prompts
    mean_response_tokens: float
    ended_fraction: float


def score_student(
    student: Any,
    teacher: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    teacher_responses: Sequence[str],
    max_new_tokens: int,
) -> tuple[Scores, list[Response]]:
    """The three measures of `student` on `prompts` (token means pooled over all response tokens)."""
    responses = greedy(student, tokenizer, prompts, max_new_tokens)
    kl_sum, logprob_sum, tokens = 0.0, 0.0, 0
    for prompt, response in zip(prompts, responses, strict=True):
        if not response.ids:
            continue
        prompt_ids = encode_prompt(tokenizer, prompt)
        teacher_RV = response_logprobs(teacher, prompt_ids, response.ids)
        student_RV = response_logprobs(student, prompt_ids, response.ids)
        kl_sum += float((teacher_RV.exp() * (teacher_RV - student_RV)).sum())
        logprob_sum += float(teacher_RV.gather(1, torch.tensor(response.ids)[:, None]).sum())
        tokens += len(response.ids)
    rouge = [rouge_l(r.text, ref).f1 for r, ref in zip(responses, teacher_responses, strict=True)]
    scores = Scores(
        teacher_kl=kl_sum / tokens,
        teacher_logprob=logprob_sum / tokens,
        rouge_l=statistics.mean(rouge),
        mean_response_tokens=tokens / len(responses),
        ended_fraction=sum(r.ended for r in responses) / len(responses),
    )
    return scores, responses
