"""Metrics sinks: jsonl rows flushed per step, TensorBoard events, plots and the before/after table."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from recipe_gkd.observe.metrics import MetricsLogger, read_metrics
from recipe_gkd.observe.plots import before_after_table, plot_run, training_figure


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
    table = before_after_table(read_metrics(tmp_path, "eval.jsonl"), 0.99, "forward_kl")
    assert "25.0%" in table and "75.0%" in table and "99.0%" in table and "0.8000" in table


def test_plots_draw_a_line_per_teacher() -> None:
    """Several teachers: each panel adds each teacher's own line (teacher_<name>_loss, eval_teacher_<name>_kl and
    eval_teacher_<name>_reward); one teacher keeps its single unlabelled line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [
        {"step": s, "loss": 1.0 / s, "teacher_reverse_loss": 0.5 / s, "teacher_sum_loss": 2.0 / s, "teacher_kl": 1.0}
        for s in (1, 2, 3)
    ]
    evals = [
        {"step": s, "eval_teacher_kl": 0.5, "eval_reward": 0.4, "eval_teacher_kl_s": 1.0}
        | {f"eval_teacher_{n}_{k}": v for n in ("reverse", "sum") for k, v in (("kl", 0.3), ("reward", 0.2))}
        for s in (0, 3)
    ]
    fig = training_figure(steps, evals, teacher_accuracy=None)
    labels = [ax.get_legend_handles_labels()[1] for ax in fig.axes]
    assert labels == [["all teachers", "teacher reverse", "teacher sum"]] * 3
    loss_lines = fig.axes[0].get_lines()
    assert [list(line.get_ydata()) for line in loss_lines][1] == [0.5, 0.25, 0.5 / 3]
    plt.close(fig)
    single = training_figure([{"step": 1, "loss": 1.0}], [{"step": 0, "eval_reward": 0.3}], teacher_accuracy=None)
    assert [len(ax.get_lines()) for ax in single.axes] == [1, 0, 1] and not single.axes[0].get_legend()
    plt.close(single)


def test_a_multi_turn_run_plots_its_tool_use_per_trajectory() -> None:
    """metrics.jsonl holds a step's totals (tool calls, failures) and its sequences; the fourth panel divides."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [
        {"step": 1, "loss": 0.2, "sequences": 32, "turns": 2.5, "tool_calls": 48.0, "tool_failures": 8.0}
        | {"tool_token_frac": 0.4},
        {"step": 2, "loss": 0.1, "sequences": 16, "turns": 3.0, "tool_calls": 32.0, "tool_failures": 0.0}
        | {"tool_token_frac": 0.35},
    ]
    fig = training_figure(steps, [{"step": 0, "eval_reward": 0.1}], teacher_accuracy=None)
    assert len(fig.axes) == 4
    lines = {line.get_label(): list(line.get_ydata()) for line in fig.axes[3].get_lines()}
    assert lines == {
        "turns": [2.5, 3.0],
        "tool calls": [1.5, 2.0],
        "tool failures": [0.25, 0.0],
        "tool-token fraction": [0.4, 0.35],
    }
    plt.close(fig)
    # A single-turn run's rows (no turns) keep the three panels.
    single = training_figure([{"step": 1, "loss": 1.0, "sequences": 8}], [], teacher_accuracy=None)
    assert len(single.axes) == 3
    plt.close(single)


def test_table_without_evaluation() -> None:
    assert "no evaluation" in before_after_table([], None, "forward_kl")


def table_rows(table: str) -> dict[str, list[str]]:
    """The table's rows by label: {label: [first, last]} (labels are the 28-character column)."""
    return {line[:28].strip(): line[28:].split() for line in table.splitlines()[1:]}


def test_table_shows_the_objectives_own_held_out_figure() -> None:
    # The sampled objective with teacher.top_k=0: no teacher KL is measured, its own figure is.
    evals = [
        {"step": 0, "eval_reward": 0.30, "eval_teacher_kl": None, "eval_divergence": 8.54},
        {"step": 16, "eval_reward": 0.41, "eval_teacher_kl": None, "eval_divergence": 2.49},
    ]
    rows = table_rows(before_after_table(evals, None, "sampled_reverse_kl"))
    assert rows["log s - log t, greedy tokens"] == ["8.5400", "2.4900"]
    assert "divergence to the teacher" not in rows, "a row of '-' for a figure never measured"
    # With a top-k both are measured: the teacher KL and the trained divergence, each named.
    for row, kl in zip(evals, (0.9, 0.4), strict=True):
        row["eval_teacher_kl"] = kl
    rows = table_rows(before_after_table(evals, None, "reverse_kl"))
    assert rows["divergence to the teacher"] == ["0.9000", "0.4000"]
    assert rows["reverse KL to the teacher"] == ["8.5400", "2.4900"]
    # Forward KL: its own figure is the teacher KL, shown once.
    assert len(table_rows(before_after_table(evals, None, "forward_kl"))) == 3


def wandb_records(run_file: Path) -> list[Any]:
    """The records of a W&B run file (`run-<id>.wandb`), read without wandb's own reader.

    The file is a 7-byte header (':W&B', magic, version) and then LevelDB's log format: 32 KiB blocks of
    records `crc32 (4) | length (2) | type (1) | payload`, a payload split over blocks as FIRST/MIDDLE/LAST;
    each payload is one protobuf `Record`.
    """
    from wandb.proto import wandb_internal_pb2

    data, block, position = run_file.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    payloads, partial = [], b""
    while position + 7 <= len(data):
        room = block - position % block
        if room < 7:  # a block's tail too short for a header is zero padding
            position += room
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0:
            position += room
            continue
        payload = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 1:  # FULL
            payloads.append(payload)
        elif kind == 2:  # FIRST
            partial = payload
        elif kind == 3:  # MIDDLE
            partial += payload
        else:  # LAST
            payloads.append(partial + payload)
    records = []
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def test_wandb_offline_run_has_the_config_and_the_jsonl_columns(tmp_path: Path, monkeypatch) -> None:
    """WANDB_MODE=offline, no network: the W&B run is named from the config, carries the resolved config, and
    logs every scalar column of metrics.jsonl and eval.jsonl at its step."""
    from recipe_gkd.config import load_config, to_dict

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, [f"trainer.run_dir={tmp_path}", "trainer.loggers=[jsonl,wandb]", "trainer.wandb.name=r29"])
    run_config = to_dict(cfg)
    logger = MetricsLogger(tmp_path, cfg.trainer.loggers, 2, wandb=cfg.trainer.wandb, run_config=run_config)
    logger.log_eval({"step": 0, "eval_reward": 0.25, "eval_teacher_kl": 0.8})
    steps = [
        {"step": s, "loss": 1.0 / s, "divergence": "forward_kl", "teacher_kl": None, "sample_ids": [s]} for s in (1, 2)
    ]
    for row in steps:
        logger.log_step(row)
    logger.close()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "recipe_gkd" and run.display_name == "r29"
    assert run.run_id == (tmp_path / "wandb_run_id").read_text().strip()
    logged_config = {u.key: json.loads(u.value_json) for u in run.config.update if u.key != "_wandb"}
    assert logged_config == json.loads(json.dumps(run_config))
    history = [
        {
            name: json.loads(i.value_json)
            for i in r.history.item
            if not (name := i.key or "/".join(i.nested_key)).startswith("_")
        }
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    jsonl = read_metrics(tmp_path)
    assert history == [
        {"step": 0, "eval_reward": 0.25, "eval_teacher_kl": 0.8},
        *({k: v for k, v in row.items() if k not in ("teacher_kl", "sample_ids")} for row in jsonl),
    ]


def test_wandb_dir_holds_the_wandb_files_when_set(tmp_path: Path, monkeypatch) -> None:
    """wandb's own convention: WANDB_DIR, where set, takes the W&B files instead of the run directory."""
    from recipe_gkd.config import load_config, to_dict

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb_dir = tmp_path / "wandb_home"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = load_config(None, [f"trainer.run_dir={run_dir}", "trainer.loggers=[jsonl,wandb]"])
    logger = MetricsLogger(run_dir, cfg.trainer.loggers, 1, wandb=cfg.trainer.wandb, run_config=to_dict(cfg))
    logger.log_step({"step": 1, "loss": 0.5})
    logger.close()
    assert len(list((wandb_dir / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    assert not (run_dir / "wandb").exists()


def test_a_privileged_teachers_accuracy_from_the_students_prompt_is_said_to_be_so() -> None:
    evals = [{"step": 0, "eval_reward": 0.1}, {"step": 20, "eval_reward": 0.4}]
    plain = before_after_table(evals, 0.0, "forward_kl")
    marked = before_after_table(evals, 0.0, "forward_kl", privileged=True)
    assert "*" not in plain and "teacher held-out accuracy*" in marked
    assert marked.splitlines()[-1].startswith("* from the student's prompt: the teacher answers from its own")
