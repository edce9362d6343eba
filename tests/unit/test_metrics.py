"""Metrics sinks: jsonl rows flushed per step, TensorBoard events, plots and the before/after table."""

from __future__ import annotations

import math
from pathlib import Path

from recipe_gkd.metrics import MetricsLogger, read_metrics
from recipe_gkd.plots import before_after_table, plot_run


def test_jsonl_tensorboard_and_plots(tmp_path: Path, capsys) -> None:
    logger = MetricsLogger(tmp_path, ["console", "jsonl", "tensorboard"], total_steps=3)
    logger.log_eval({"step": 0, "eval_reward": 0.25, "eval_teacher_kl": 0.8})
    for step in (1, 2, 3):
        logger.log_step({"step": step, "loss": 1.0 / step, "teacher_kl": 1.0 / step, "step_s": 0.1, "bad": math.nan})
        # Flushed at once: a crash after this line loses nothing already logged.
        assert len(read_metrics(tmp_path)) == step
    logger.log_eval({"step": 3, "eval_reward": 0.75, "eval_teacher_kl": 0.2})
    logger.close()
    rows = read_metrics(tmp_path)
    assert [r["loss"] for r in rows] == [1.0, 0.5, 1.0 / 3] and rows[0]["bad"] == "nan"
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert "[step 2] loss=0.5" in capsys.readouterr().out
    png = plot_run(tmp_path, teacher_accuracy=0.99)
    assert png.stat().st_size > 10_000
    table = before_after_table(read_metrics(tmp_path, "eval.jsonl"), 0.99)
    assert "25.0%" in table and "75.0%" in table and "99.0%" in table and "0.8000" in table


def test_table_without_evaluation() -> None:
    assert "no evaluation" in before_after_table([], None)
