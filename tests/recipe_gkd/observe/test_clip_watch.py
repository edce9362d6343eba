"""The line for responses the length limit cuts: once, after PATIENCE steps above the share, naming the key and the
stop ids; a step back under the share starts the count again."""

from __future__ import annotations

from recipe_gkd.observe.clip_watch import CLIPPED_FRAC, PATIENCE, ClipWatch
from recipe_gkd.rollout.samples import samples_due

STOPS = "'<|endoftext|>' (0: the tokenizer's EOS), '<|im_end|>' (2: the chat template's turn end)"


def rows(fracs: list[float | None]) -> list[dict[str, object]]:
    return [{"step": i + 1, "response_clipped_frac": f} for i, f in enumerate(fracs)]


def test_the_line_fires_once_after_patience_steps_above_the_share() -> None:
    watch = ClipWatch(max_new_tokens=256)
    lines = [watch.observe(r, STOPS) for r in rows([0.9] * (PATIENCE + 5))]
    fired = [(i, line) for i, line in enumerate(lines) if line is not None]
    assert [i for i, _ in fired] == [PATIENCE - 1], "once, on the PATIENCE-th step in a row"
    line = fired[0][1]
    assert line is not None and f"at step {PATIENCE}:" in line
    assert "rollout.sampling.max_new_tokens (now 256)" in line and STOPS in line


def test_a_step_under_the_share_starts_the_count_again() -> None:
    watch = ClipWatch(max_new_tokens=16)
    pattern = [0.9] * (PATIENCE - 1) + [CLIPPED_FRAC] + [0.9] * (PATIENCE - 1) + [None]
    assert all(watch.observe(r, STOPS) is None for r in rows(pattern))
    assert not watch.fired


def test_samples_are_logged_on_the_first_step_and_every_period() -> None:
    due = [s for s in range(12) if samples_due(4, 0, 5, s)]
    assert due == [0, 4, 9], "batch 0, then the steps eval_every ends on"
    assert [s for s in range(12) if samples_due(4, 3, 5, s)] == [0, 2, 5, 8, 11]
    assert [s for s in range(12) if samples_due(4, 0, 0, s)] == [0]
    assert not any(samples_due(0, 3, 5, s) for s in range(12))
