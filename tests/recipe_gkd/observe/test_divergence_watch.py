"""The divergence watch on synthetic series: it fires once on a run-away objective, never on a healthy one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from recipe_gkd.config import GKDConfig, load_config
from recipe_gkd.observe.divergence_watch import DIVERGENCE_FILE, FLOOR, PATIENCE, RISE, DivergenceWatch


def forward_rows(losses: list[float]) -> list[dict[str, float]]:
    return [{"step": i + 1, "loss": v, "teacher_kl": v} for i, v in enumerate(losses)]


def sampled_rows(estimates: list[float]) -> list[dict[str, float]]:
    # The loss of the sampled objective is the surrogate -ratio * A; the watch reads -advantage_mean.
    return [{"step": i + 1, "loss": -0.5, "advantage_mean": -v} for i, v in enumerate(estimates)]


def lines_of(watch: DivergenceWatch, rows: list[dict[str, float]]) -> list[tuple[int, str]]:
    return [(int(row["step"]), line) for row in rows if (line := watch.observe(row)) is not None]


def watch_for(*overrides: str) -> DivergenceWatch:
    return DivergenceWatch.for_config(load_config(None, list(overrides)))


def healthy_series(start: float, end: float, steps: int, noise: float, seed: int) -> list[float]:
    """A loss that falls from `start` to `end` with multiplicative noise (the demo's shape)."""
    rng = np.random.default_rng(seed)
    trend = start * (end / start) ** (np.arange(steps) / (steps - 1))
    return list(trend * np.exp(rng.normal(0.0, noise, steps)))


def test_fires_once_on_a_sampled_objective_that_runs_away() -> None:
    # The demo's sampled objective at lr 3e-3, no clip, in shape: ~1.1 nats, then up to 6-10.
    estimates = [1.1, 1.0, 1.2, 1.3, 2.0, 3.5, 3.4, 4.0, 5.5, 6.0, 7.2, 8.0, 9.5, 6.1, 7.0, 8.8]
    watch = watch_for("algorithm.divergence=sampled_reverse_kl", "teacher.top_k=0", "actor.optim.lr=3e-3")
    fired = lines_of(watch, sampled_rows(estimates))
    # Threshold 3 x 1.1 = 3.3: steps 6-10 are the first 5 above it (step 7's 3.4 too).
    assert [step for step, _ in fired] == [10], fired
    line = fired[0][1]
    assert "actor.optim.lr (now 0.003)" in line and "algorithm.ratio_clip (now 0" in line
    assert "sampled reverse KL" in line and "6" in line and "1.1" in line


def test_the_line_names_only_the_lr_for_a_top_k_objective_and_the_clip_when_set() -> None:
    losses = [0.5, 0.5, 0.5] + [2.0] * PATIENCE
    fired = lines_of(watch_for("actor.optim.lr=3e-3"), forward_rows(losses))
    assert len(fired) == 1 and "actor.optim.lr" in fired[0][1] and "ratio_clip" not in fired[0][1]
    clipped = watch_for("algorithm.divergence=sampled_reverse_kl", "teacher.top_k=0", "algorithm.ratio_clip=0.2")
    fired = lines_of(clipped, sampled_rows(losses))
    assert len(fired) == 1 and "lower algorithm.ratio_clip (now 0.2)" in fired[0][1]


def test_a_short_spike_is_no_divergence() -> None:
    # PATIENCE - 1 bad steps, back down, again: never PATIENCE in a row.
    spike = [1.0] * (PATIENCE - 1)
    losses = [0.3, 0.3, 0.3] + spike + [0.3] + spike + [0.2] * 20
    assert lines_of(watch_for(), forward_rows(losses)) == []
    # One more bad step makes it one.
    assert len(lines_of(watch_for(), forward_rows([0.3, 0.3, 0.3] + [1.0] * PATIENCE))) == 1


def test_the_floor_keeps_noise_on_a_tiny_start_quiet() -> None:
    start = 0.01
    losses = [start] * 3 + [FLOOR * 0.9] * 30  # 9x the start, under the floor
    assert RISE * start < FLOOR * 0.9
    assert lines_of(watch_for(), forward_rows(losses)) == []
    assert len(lines_of(watch_for(), forward_rows([start] * 3 + [FLOOR * 1.1] * PATIENCE))) == 1


def test_never_fires_on_healthy_series() -> None:
    # The demo's healthy runs: the loss falls, with per-batch noise and an early bump (the golden
    # losses at lr 3e-3 go 0.49 -> 1.31 at step 2; it is inside the start's mean).
    golden = [0.49173688, 1.30580463, 1.09991954, 0.99210944, 1.02116274, 0.83850252]
    for seed in range(20):
        tail = healthy_series(0.8, 0.1, 150, noise=0.3, seed=seed)
        assert lines_of(watch_for(), forward_rows(golden + tail)) == []
        sampled = healthy_series(1.1, 0.5, 150, noise=0.3, seed=seed)
        srkl = watch_for("algorithm.divergence=sampled_reverse_kl", "teacher.top_k=0")
        assert lines_of(srkl, sampled_rows(sampled)) == []


def test_a_resumed_run_keeps_its_start_and_what_it_said(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(None, [f"trainer.run_dir={run}"])
    rows = forward_rows([0.2, 0.2, 0.2, 0.7, 0.7])  # 2 steps above 3 x 0.2 before the checkpoint
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / DIVERGENCE_FILE).write_text("an earlier run's line\n")
    watch = DivergenceWatch.for_run(cfg, first_step=5)
    assert math.isclose(watch.threshold or 0.0, 0.6) and watch.above == 2 and not watch.fired
    assert not (run / DIVERGENCE_FILE).exists(), "a line from steps this run redoes is dropped"
    fired = lines_of(watch, forward_rows([0.2] * 5 + [0.7] * 3)[5:])
    assert [step for step, _ in fired] == [8] and "steps 1-3" in fired[0][1]
    # A fresh start (no checkpoint) takes its start from its own first steps.
    assert DivergenceWatch.for_run(cfg, first_step=0).threshold is None


def test_a_run_stopped_for_divergence_exits_5(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """main's exit code for gkd.RunDiverged (raised by the loop: tests/recipe_gkd/test_gkd_loop.py)."""
    from recipe_gkd import gkd, main

    def diverges(cfg: GKDConfig, plan: object) -> Path:
        raise gkd.RunDiverged("diverging at step 9: ...; stopped after checkpoint X (trainer.stop_on_divergence=true)")

    monkeypatch.setattr(gkd, "run", diverges)
    code = main.main([f"trainer.run_dir={tmp_path / 'run'}", "trainer.stop_on_divergence=true"])
    assert code == main.EXIT_DIVERGED == 5
    assert "error: diverging at step 9" in capsys.readouterr().err
