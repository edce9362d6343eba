"""ROUGE-L (Lin 2004) over words: the longest common subsequence of a candidate and a reference.

    recall    = LCS / len(reference)
    precision = LCS / len(candidate)
    F1        = 2 * precision * recall / (precision + recall)

Words are lower-cased runs of letters and digits (punctuation dropped), as rouge-score's default
tokenizer splits them, without stemming. The GKD paper scores summarisation with ROUGE-L.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    """Lower-cased alphanumeric words of `text`."""
    return _WORD.findall(text.lower())


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence of `a` and `b` (dynamic programme, one row kept)."""
    if len(b) > len(a):
        a, b = b, a
    row = [0] * (len(b) + 1)  # row[j]: LCS of the prefix of a seen so far and b[:j]
    for x in a:
        diagonal = 0  # LCS of the previous prefix of a and b[:j - 1]
        for j, y in enumerate(b, start=1):
            above = row[j]
            row[j] = diagonal + 1 if x == y else max(row[j], row[j - 1])
            diagonal = above
    return row[-1]


@dataclass(frozen=True)
class RougeL:
    precision: float
    recall: float
    f1: float


def rouge_l(candidate: str, reference: str) -> RougeL:
    """ROUGE-L of `candidate` against `reference` over words; 0 where either has no word."""
    cand, ref = words(candidate), words(reference)
    if not cand or not ref:
        return RougeL(0.0, 0.0, 0.0)
    lcs = lcs_length(cand, ref)
    if lcs == 0:
        return RougeL(0.0, 0.0, 0.0)
    precision, recall = lcs / len(cand), lcs / len(ref)
    return RougeL(precision, recall, 2 * precision * recall / (precision + recall))
