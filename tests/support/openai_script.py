"""Answers of an OpenAI-compatible server for the scripted HTTP server (tests/conftest.py `scripted`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# (status, body) per request, in order; a callable body sees the request's JSON (tests/conftest.py `scripted`).
Script = list[tuple[int, object]]


def prompt_logprobs(seq: list[int], logprobs_LV: np.ndarray, top_k: int) -> list[dict[str, dict[str, float]] | None]:
    """What vLLM sends: position 0 None, then the token at p and the top-K by rank (K or K + 1 entries)."""
    out: list[dict[str, dict[str, float]] | None] = [None]
    for p in range(1, len(seq)):
        row = logprobs_LV[p]
        ranks = np.argsort(-row, kind="stable")
        entries = {int(t): row[t] for t in ranks[:top_k]} | {seq[p]: row[seq[p]]}
        rank_of = {int(t): r + 1 for r, t in enumerate(ranks)}
        out.append(
            {str(t): {"logprob": float(v), "rank": rank_of[t], "decoded_token": "x"} for t, v in entries.items()}
        )
    return out


def completions(table: dict[tuple[int, ...], np.ndarray]) -> Callable[[dict], dict]:
    """A /completions answer from full log-probs per prompt, at the request's prompt_logprobs."""

    def answer(body: dict) -> dict:
        k = body["prompt_logprobs"]
        choices = [
            {"index": i, "prompt_logprobs": prompt_logprobs(seq, table[tuple(seq)], k)}
            for i, seq in enumerate(body["prompt"])
        ]
        return {"choices": choices[::-1]}  # out of order on purpose: the client sorts by index

    return answer


MODELS = (200, {"data": [{"id": "served-teacher"}]})
