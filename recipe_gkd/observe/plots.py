"""PNG plots of a run (loss, teacher KL, held-out accuracy vs step) and the before/after table."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from recipe_gkd.observe.metrics import EVAL_FILE, METRICS_FILE, read_metrics

PLOT_FILE = "training.png"


def plot_run(run_dir: str | Path, teacher_accuracy: float | None = None) -> Path:
    """Write <run_dir>/training.png from the run's metrics files; returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to a file
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    steps = read_metrics(run, METRICS_FILE)
    evals = read_metrics(run, EVAL_FILE) if (run / EVAL_FILE).is_file() else []
    fig = training_figure(steps, evals, teacher_accuracy)
    out = run / PLOT_FILE
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def training_figure(steps: list[dict[str, Any]], evals: list[dict[str, Any]], teacher_accuracy: float | None) -> Any:
    """The three panels (training loss, held-out divergence, held-out accuracy), a line per teacher where several;
    a fourth, the tool use of the training trajectories, for a multi-turn run (rows with `turns`)."""
    import matplotlib.pyplot as plt

    episodes = episode_rows(steps)
    fig, axes = plt.subplots(1, 4 if episodes else 3, figsize=(20 if episodes else 15, 4))
    panels = [
        (axes[0], steps, "loss", "training loss (GKD divergence)", "divergence (nats per token)"),
        (axes[1], evals, "eval_teacher_kl", "held-out divergence to the teacher", "KL(teacher || student), nats"),
        (axes[2], evals, "eval_reward", "held-out exact-match accuracy (greedy)", "accuracy"),
    ]
    for ax, rows, key, title, unit in panels:
        # Several teachers (docs/teachers.md): one more line per teacher, over its own records.
        teachers = per_teacher_keys(rows, key)
        _line(ax, rows, key, title, label="all teachers" if teachers else None)
        for name, teacher_key in teachers:
            _line(ax, rows, teacher_key, title, label=f"teacher {name}")
        ax.set_ylabel(unit)
    for key, label in EPISODE_LINES if episodes else ():
        _line(axes[3], episodes, key, "tool use per training trajectory", label=label)
    if episodes:
        axes[3].set_ylabel("per trajectory (fraction: of its tokens)")
    if teacher_accuracy is not None:
        axes[2].axhline(teacher_accuracy, color="gray", linestyle="--", label="teacher's own accuracy")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    return fig


# The tool-use panel's lines (episode_rows' columns) and their labels.
EPISODE_LINES = (
    ("turns", "turns"),
    ("tool_calls", "tool calls"),
    ("tool_failures", "tool failures"),
    ("tool_token_frac", "tool-token fraction"),
)


def episode_rows(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per multi-turn step: mean turns, tool calls and tool failures per trajectory (metrics.jsonl has the step's
    totals and its `sequences`), the tool-token fraction; [] for a single-turn run."""
    rows = []
    for row in steps:
        if isinstance(row.get("turns"), int | float) and row.get("sequences"):
            per = 1.0 / row["sequences"]
            rows.append(
                {
                    "step": row["step"],
                    "turns": row["turns"],
                    "tool_calls": row["tool_calls"] * per,
                    "tool_failures": row["tool_failures"] * per,
                    "tool_token_frac": row["tool_token_frac"],
                }
            )
    return rows


# The per-teacher column of each plotted figure: metrics.jsonl's teacher_<name>_loss, eval.jsonl's
# eval_teacher_<name>_kl and eval_teacher_<name>_reward.
PER_TEACHER_COLUMNS = {
    "loss": re.compile(r"teacher_(.+)_loss"),
    "eval_teacher_kl": re.compile(r"eval_teacher_(.+)_kl"),
    "eval_reward": re.compile(r"eval_teacher_(.+)_reward"),
}


def per_teacher_keys(rows: list[dict[str, Any]], key: str) -> list[tuple[str, str]]:
    """(teacher name, column) of each teacher's version of figure `key` in `rows`, sorted by name."""
    pattern = PER_TEACHER_COLUMNS.get(key)
    if pattern is None:
        return []
    found = {m.group(1): column for row in rows for column in row if (m := pattern.fullmatch(column))}
    return sorted(found.items())


def _line(ax: Any, rows: list[dict[str, Any]], key: str, title: str, label: str | None = None) -> None:
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
    if points:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o" if len(points) < 30 else None, label=label)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


PER_TEACHER_REWARD = re.compile(r"eval_teacher_.+_reward")
# The summary's name of each objective's held-out figure (eval.jsonl's eval_divergence, on the greedy responses).
OBJECTIVE_ROWS = {
    "reverse_kl": "reverse KL to the teacher",
    "jsd": "JSD to the teacher",
    # Greedy tokens are no samples: the mean of log s - log t over them, not a KL estimate.
    "sampled_reverse_kl": "log s - log t, greedy tokens",
}


def before_after_table(
    evals: list[dict[str, Any]], teacher_accuracy: float | None, divergence: str, privileged: bool = False
) -> str:
    """The demo's summary, first vs last evaluation: student accuracy, the teacher KL where measured (a top-k),
    the trained objective's own held-out figure (`divergence`: algorithm.divergence) and the teacher's accuracy
    (`privileged`: from the student's prompt, which a teacher with a prompt of its own was never meant to answer)."""
    if not evals:
        return "no evaluation was run (trainer.eval_every=0)"
    first, last = evals[0], evals[-1]
    rows = [("student held-out accuracy", _pct(first.get("eval_reward")), _pct(last.get("eval_reward")))]
    kl = (first.get("eval_teacher_kl"), last.get("eval_teacher_kl"))
    if kl != (None, None):
        # KL(teacher || student) over the K + 1 outcomes: null with teacher.top_k=0, then left out.
        rows.append(("divergence to the teacher", _num(kl[0]), _num(kl[1])))
    if divergence in OBJECTIVE_ROWS:
        label = OBJECTIVE_ROWS[divergence]
        rows.append((label, _num(first.get("eval_divergence")), _num(last.get("eval_divergence"))))
    teacher = "teacher held-out accuracy*" if privileged else "teacher held-out accuracy"
    rows.append((teacher, _pct(teacher_accuracy), _pct(teacher_accuracy)))
    # Several teachers (docs/teachers.md): each teacher's held-out records, its accuracy and divergence.
    for name in [k[len("eval_teacher_") : -len("_reward")] for k in first if PER_TEACHER_REWARD.fullmatch(k)]:
        reward, kl = f"eval_teacher_{name}_reward", f"eval_teacher_{name}_kl"
        rows.append((f"  {name}: student accuracy", _pct(first.get(reward)), _pct(last.get(reward))))
        rows.append((f"  {name}: divergence", _num(first.get(kl)), _num(last.get(kl))))
    header = f"{'':28}{'step ' + str(first['step']):>14}{'step ' + str(last['step']):>14}"
    table = [header] + [f"{name:28}{a:>14}{b:>14}" for name, a, b in rows]
    if privileged:
        table.append(
            "* from the student's prompt: the teacher answers from its own (privileged context), below; it was never "
            "meant to answer from this one"
        )
    return "\n".join(table)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
