"""Run metrics: `<run_dir>/metrics.jsonl` (one object per step), TensorBoard, W&B, console, progress bar.

The progress bar lives on the driver only and is created by `start_progress` after every
worker has reported ready (a bar created between barriers has deadlocked DDP jobs).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recipe_gkd.batch import TEACHER_SUMS
from recipe_gkd.config import ConfigError, WandbConfig
from recipe_gkd.rollout.samples import SAMPLES_FILE

if TYPE_CHECKING:
    from recipe_gkd.config.teachers import TeacherHandle

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
# A resumed run continues the same W&B run: its id is kept in the run directory.
WANDB_ID_FILE = "wandb_run_id"
# Keys shown on the console line and the progress bar, in this order, when present.
CONSOLE_KEYS = ("loss", "teacher_kl", "reward", "eval_reward", "eval_teacher_kl", "step_s")
# How the console names a column where its metrics.jsonl name says less: the step's reward is the mean over the
# student's sampled responses, the evaluation's the greedy held-out accuracy.
CONSOLE_NAMES = {"reward": "sampled_reward", "eval_reward": "heldout_accuracy_greedy"}


class MetricsLogger:
    """Writes each step's metrics to the configured sinks; flushes every line (nothing lost on a crash)."""

    def __init__(
        self,
        run_dir: str | Path,
        loggers: list[str],
        total_steps: int,
        wandb: WandbConfig | None = None,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        """`wandb` and `run_config` (the resolved config, the W&B run's config) are needed with the wandb logger."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.loggers = set(loggers)
        self.total_steps = total_steps
        self._jsonl = (self.run_dir / METRICS_FILE).open("a") if "jsonl" in self.loggers else None
        self._eval = (self.run_dir / EVAL_FILE).open("a")
        self._samples = (self.run_dir / SAMPLES_FILE).open("a")
        self._tb: Any = None
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self._wandb: Any = None
        if "wandb" in self.loggers:
            if wandb is None or run_config is None:
                raise ValueError("trainer.loggers includes wandb: give MetricsLogger the trainer.wandb settings")
            self._wandb = start_wandb_run(self.run_dir, wandb, run_config)
        self._bar: Any = None

    def start_progress(self, initial_step: int) -> None:
        """Create the driver's progress bar (call once every worker is ready)."""
        from tqdm import tqdm

        disable = not sys.stderr.isatty() and os.environ.get("RECIPE_GKD_PROGRESS") != "1"
        self._bar = tqdm(total=self.total_steps, initial=initial_step, desc="gkd", unit="step", disable=disable)

    def log_step(self, row: dict[str, Any]) -> None:
        clean = {k: _jsonable(v) for k, v in row.items()}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(clean) + "\n")
            self._jsonl.flush()
        self._tensorboard(clean, "train")
        self._log_wandb(clean)
        self._console(clean, "step")

    def log_eval(self, row: dict[str, Any]) -> None:
        clean = {k: _jsonable(v) for k, v in row.items()}
        self._eval.write(json.dumps(clean) + "\n")
        self._eval.flush()
        self._tensorboard(clean, "eval")
        self._log_wandb(clean)
        self._console(clean, "eval")

    def log_samples(self, step: int, batch: int, samples: Iterable[dict[str, Any]]) -> None:
        """trainer.log_samples: the decoded responses of batch `batch`, trained at `step`, one row each."""
        for sample in samples:
            row = {"step": step, "batch": batch, **{k: _jsonable(v) for k, v in sample.items()}}
            self._samples.write(json.dumps(row) + "\n")
        self._samples.flush()

    def _tensorboard(self, row: dict[str, Any], prefix: str) -> None:
        if self._tb is None:
            return
        for key, value in row.items():
            if isinstance(value, int | float) and key != "step":
                self._tb.add_scalar(f"{prefix}/{key}", value, row["step"])
        self._tb.flush()

    def _log_wandb(self, row: dict[str, Any]) -> None:
        """The row's columns as they are in metrics.jsonl / eval.jsonl, at its step (lists, i.e. sample_ids, left out)."""
        if self._wandb is None:
            return
        self._wandb.log({k: v for k, v in row.items() if isinstance(v, int | float | str)}, step=row["step"])

    def _console(self, row: dict[str, Any], kind: str) -> None:
        shown = {k: row[k] for k in CONSOLE_KEYS if row.get(k) is not None}
        named = {CONSOLE_NAMES.get(k, k): v for k, v in shown.items()}
        text = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in named.items())
        if self._bar is not None and kind == "step":
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(1)
        if "console" in self.loggers and (self._bar is None or self._bar.disable or kind == "eval"):
            self.write(f"[{kind} {row['step']}] {text}")

    def write(self, line: str) -> None:
        """A console line; above the progress bar while one is drawn."""
        if self._bar is not None and not self._bar.disable:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def end_progress(self) -> None:
        """Close the progress bar (the run's last lines print below it)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        for f in (self._jsonl, self._eval, self._samples):
            if f is not None:
                f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            wandb.teardown()  # stops the wandb-core process this run started
            self._wandb = None


def start_wandb_run(run_dir: Path, settings: WandbConfig, run_config: dict[str, Any]) -> Any:
    """A W&B run under `run_dir`/wandb (or $WANDB_DIR/wandb): project and name from trainer.wandb, the resolved config as its config.

    WANDB_MODE=offline writes it locally (`wandb sync` uploads it later). A resumed run (same
    run_dir) continues the W&B run whose id is kept in `run_dir`/wandb_run_id.
    """
    try:
        import wandb
    except ImportError:
        raise ConfigError("trainer.loggers", "includes wandb, which is not installed: pip install wandb") from None

    id_file = run_dir / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
    id_file.write_text(run_id + "\n")
    return wandb.init(
        project=settings.project,
        name=settings.name or run_dir.resolve().name,
        id=run_id,
        resume="allow",
        config=run_config,
        # wandb's own convention: WANDB_DIR, where a user set it, holds the W&B files; else the run directory.
        dir=os.environ.get("WANDB_DIR") or str(run_dir),
        # Metrics are logged explicitly; W&B neither captures the console nor prints its banners on it.
        settings=wandb.Settings(console="off", silent=True),
    )


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    return value


def read_metrics(run_dir: str | Path, name: str = METRICS_FILE) -> list[dict[str, Any]]:
    """The rows of a run's metrics file."""
    path = Path(run_dir) / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def teacher_columns(stats: list[Any], handles: Iterable[TeacherHandle], prefix: str) -> dict[str, float | None]:
    """Per-teacher columns of a step's (or an evaluation's) RolloutStats for the teachers that have them (several
    teachers, `metric_prefix`): `{prefix}teacher_<name>_sequences`, `_response_tokens`, `_topk_mass` and `_reward`
    (docs/teachers.md); a teacher that scored none of them has 0 sequences and None ratios. {} with one teacher."""
    sums: dict[str, dict[str, float]] = {}
    for s in stats:
        for name, figures in s.per_teacher.items():
            into = sums.setdefault(name, dict.fromkeys(figures, 0.0))
            for key, value in figures.items():
                into[key] += value
    columns: dict[str, float | None] = {}
    for handle in sorted(handles, key=lambda h: h.name):
        if handle.metric_prefix is None:
            continue
        f = sums.get(handle.name, dict.fromkeys(TEACHER_SUMS, 0.0))
        head = f"{prefix}{handle.metric_prefix}"
        columns[head + "sequences"] = f["sequences"]
        columns[head + "response_tokens"] = f["response_tokens"]
        columns[head + "topk_mass"] = (
            f["teacher_topk_mass_sum"] / f["response_tokens"] if f["response_tokens"] else None
        )
        columns[head + "reward"] = f["reward_sum"] / f["rewarded"] if f["rewarded"] else None
    return columns


def alignment_columns(stats: list[Any]) -> dict[str, float | None]:
    """algorithm.cross_tokenizer: the share of response tokens aligned one-to-one, of spans with shared pieces,
    and the mean span length in student tokens (docs/cross_tokenizer.md); {} for a run without it."""
    sums: dict[str, float] = {}
    for s in stats:
        for key, value in s.alignment.items():
            sums[key] = sums.get(key, 0.0) + value
    if not sums:
        return {}
    spans = sums.get("spans", 0.0)
    tokens = sums.get("response_tokens", 0.0)
    return {
        "align_one_to_one_frac": sums["one_to_one_tokens"] / tokens if tokens else None,
        "align_shared_span_frac": sums["shared_spans"] / spans if spans else None,
        "align_span_len": sums["aligned_tokens"] / spans if spans else None,
        "align_unaligned_frac": 1.0 - sums["aligned_tokens"] / tokens if tokens else None,
    }


def episode_columns(stats: list[Any], prefix: str) -> dict[str, float | None]:
    """rollout.env (multi-turn): per step (or evaluation) the mean turns per conversation, the tool calls, tool
    failures and tool tokens (response tokens the student did not sample) in all, their share of the response
    tokens, the conversations cut by max_turns / max_total_tokens, and the slowest worker's seconds in tools;
    {} for single-turn rollouts."""
    sums: dict[str, float] = {}
    for s in stats:
        for key, value in s.episodes.items():
            sums[key] = sums.get(key, 0.0) + value
    if not sums:
        return {}
    # num_response_tokens counts the sampled tokens only: the response holds those and the tool tokens.
    tokens = sum(s.num_response_tokens for s in stats) + sums["tool_tokens"]
    return {
        f"{prefix}turns": sums["turns"] / sums["conversations"] if sums["conversations"] else None,
        f"{prefix}tool_calls": sums["tool_calls"],
        f"{prefix}tool_failures": sums["tool_failures"],
        f"{prefix}tool_tokens": sums["tool_tokens"],
        f"{prefix}tool_token_frac": sums["tool_tokens"] / tokens if tokens else None,
        f"{prefix}ended_max_turns": sums["ended_max_turns"],
        f"{prefix}ended_max_total_tokens": sums["ended_max_total_tokens"],
        f"{prefix}tool_s": max(s.episodes.get("tool_s", 0.0) for s in stats),
    }
