"""Fixtures of the CLI runs: tiny random models and a small data file, once per test module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runs import WORDS

from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("crash")
    student = build_tiny_causal_lm(root / "student", seed=0)
    teacher = build_tiny_causal_lm(root / "teacher", seed=1, spec=TinyModelSpec(hidden_size=96, num_layers=3))
    data = root / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"rev:{w}", "response": w[::-1], "answer": w[::-1]}) + "\n" for w in WORDS)
    )
    return {"student": student, "teacher": teacher, "data": data}
