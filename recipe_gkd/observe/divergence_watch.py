"""One line when the trained objective runs away from where it started (docs/divergence.md).

The watched figure is the objective's own, per step: the sampled estimate of KL(student || teacher)
(mean log s_old - log t over the sampled tokens) for algorithm.divergence=sampled_reverse_kl, the
loss otherwise (the divergence over the teacher's top-k + tail; teacher_kl for forward KL). Its start
is the mean of the first START_STEPS steps; once it stays above max(RISE x start, FLOOR) for PATIENCE
steps in a row the run prints one line naming the settings to change (once per run). Thresholds
measured on the CPU demo: docs/divergence.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recipe_gkd.config import GKDConfig
from recipe_gkd.observe.metrics import METRICS_FILE, read_metrics
from recipe_gkd.targets import Objective, build_objective

# The start: the mean of the first steps (one step alone is one batch's noise).
START_STEPS = 3
# Diverging: above RISE x the start ...
RISE = 3.0
# ... and above FLOOR nats (a start near 0 would otherwise make noise a divergence) ...
FLOOR = 0.1
# ... for this many consecutive steps (a single bad batch is not a divergence).
PATIENCE = 5
# Kept in the run directory for the summary (and a resumed run).
DIVERGENCE_FILE = "divergence.txt"


@dataclass
class DivergenceWatch:
    """Fed one metrics.jsonl row per step; `observe` returns the divergence line the first time it fires."""

    objective: Objective
    """The trained objective: which figure is watched, and what its line names to change beside the lr."""
    lr: float
    starts: list[float] = field(default_factory=list)
    start_steps: list[int] = field(default_factory=list)
    above: int = 0
    fired: bool = False

    @classmethod
    def for_config(cls, cfg: GKDConfig) -> DivergenceWatch:
        return cls(objective=build_objective(cfg), lr=cfg.actor.optim.lr)

    @classmethod
    def for_run(cls, cfg: GKDConfig, first_step: int) -> DivergenceWatch:
        """A watch for a run starting after `first_step` trained steps: a resumed run takes its start (and
        whether it already fired) from the metrics.jsonl rows its checkpoint kept (checkpoint.prepare_resume
        cut the later ones). A line kept from steps this run redoes, or from an earlier run, is removed."""
        watch = cls.for_config(cfg)
        run_dir = Path(cfg.trainer.run_dir)
        if first_step and (run_dir / METRICS_FILE).is_file():
            for row in read_metrics(run_dir):
                watch.observe(row)
        if not watch.fired:
            (run_dir / DIVERGENCE_FILE).unlink(missing_ok=True)
        return watch

    @property
    def figure_name(self) -> str:
        return self.objective.watched

    def figure(self, row: dict[str, Any]) -> float:
        """The objective's own figure in a metrics.jsonl row."""
        return self.objective.watched_figure(row)

    @property
    def threshold(self) -> float | None:
        """The figure above which a step counts as diverging; None until the start is known."""
        if len(self.starts) < START_STEPS:
            return None
        return max(RISE * sum(self.starts) / len(self.starts), FLOOR)

    def observe(self, row: dict[str, Any]) -> str | None:
        """Take one step's row; the divergence line on the step it is first seen, else None."""
        value = self.figure(row)
        threshold = self.threshold
        if threshold is None:
            self.starts.append(value)
            self.start_steps.append(int(row["step"]))
            return None
        self.above = self.above + 1 if value > threshold else 0
        if self.fired or self.above < PATIENCE:
            return None
        self.fired = True
        return self.line(int(row["step"]), value)

    def line(self, step: int, value: float) -> str:
        start = sum(self.starts) / len(self.starts)
        change = f"lower actor.optim.lr (now {self.lr:g})"
        more = self.objective.settings_to_change()
        change += f" or {more}" if more else ""
        steps = f"steps {self.start_steps[0]}-{self.start_steps[-1]}"
        return (
            f"diverging at step {step}: {self.figure_name} is {value:.3g}, above {RISE:g}x its start "
            f"({start:.3g}, {steps}) for {PATIENCE} steps in a row; {change} (docs/divergence.md)"
        )
