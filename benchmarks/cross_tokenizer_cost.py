"""Scoring cost per student response token, in process (no wire), 1 thread: the same-tokenizer demo teacher on
token ids vs the cross-tokenizer route (render, teacher forward, align + map) on the BPE demo teacher.

    python benchmarks/cross_tokenizer_cost.py   (docs/cross_tokenizer.md)

The 500 held-out prompts of the demo with their reference responses + EOS in the student's tokens, scored
3 times each way at top_k=8; prints one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from recipe_gkd.config import load_config
from recipe_gkd.cross_tokenizer.route import CrossTokenizerScorer
from recipe_gkd.data import encode_prompt
from teacher_server.server.backends import BackendOptions, load_backend, parsed_request
from teacher_server.wire.conversation import Conversation, Renderer
from teacher_server.wire.protocol import TeacherScores

REPS = 3
TOP_K = 8


class TimedTextTeacher:
    """The replica's text path in this process (render, then the hf backend), timing each part."""

    def __init__(self, model: str) -> None:
        self.renderer = Renderer(AutoTokenizer.from_pretrained(model))
        self.backend = load_backend("hf", BackendOptions(model, max_top_k=64))
        self.render_s = self.score_s = 0.0

    def score_conversations(self, conversations: Sequence[Conversation]) -> list[TeacherScores]:
        start = time.perf_counter()
        rendered = [self.renderer.render(c) for c in conversations]
        self.render_s += time.perf_counter() - start
        start = time.perf_counter()
        request = parsed_request([r.ids for r in rendered], [r.score_from for r in rendered], top_k=TOP_K)
        batch = self.backend.score(request).split()
        self.score_s += time.perf_counter() - start
        return [
            dataclasses.replace(b, token_ids=r.ids[r.score_from :], byte_offsets=r.byte_offsets)
            for b, r in zip(batch, rendered, strict=True)
        ]


def main() -> dict[str, Any]:
    torch.set_num_threads(1)
    data = load_config(None, []).data
    student = AutoTokenizer.from_pretrained("assets/demo/student")
    with open("assets/demo/data/eval.jsonl") as f:
        records = [json.loads(line) for line in f][:500]
    prompts = [encode_prompt(student, r, "prompt", True) for r in records]
    responses = [
        student(r["response"], add_special_tokens=False)["input_ids"] + [student.eos_token_id] for r in records
    ]
    seqs = [np.asarray(p + q, np.int32) for p, q in zip(prompts, responses, strict=True)]
    starts = [len(p) for p in prompts]
    tokens = sum(len(q) for q in responses)
    same = load_backend("hf", BackendOptions("assets/demo/teacher", max_top_k=64))
    same.score(parsed_request(seqs[:8], starts[:8], top_k=TOP_K))  # warm-up
    start = time.perf_counter()
    for _ in range(REPS):
        same.score(parsed_request(seqs, starts, top_k=TOP_K))
    same_us = (time.perf_counter() - start) / REPS / tokens * 1e6
    teacher = TimedTextTeacher("assets/demo_xtok/teacher")
    route = CrossTokenizerScorer(teacher, student, teacher.renderer.tokenizer, TOP_K, data)
    route.score_records(seqs[:8], starts[:8], records[:8])  # warm-up
    teacher.render_s = teacher.score_s = 0.0
    start = time.perf_counter()
    for _ in range(REPS):
        route.score_records(seqs, starts, records)
    total = (time.perf_counter() - start) / REPS
    render, forward = teacher.render_s / REPS, teacher.score_s / REPS
    per_token = lambda s: round(s / tokens * 1e6, 1)  # noqa: E731
    result = {
        "student_response_tokens": tokens,
        "same_tokenizer_us_per_token": round(same_us, 1),
        "cross_us_per_token": per_token(total),
        "cross_render_us": per_token(render),
        "cross_forward_us": per_token(forward),
        "cross_align_map_us": per_token(total - render - forward),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
