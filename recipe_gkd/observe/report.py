"""The run's report after training: plots, the before/after table (summary.txt), where the student went.

Nothing here may fail a run that trained: a teacher-accuracy pass or a plot that raises is said so in the report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recipe_gkd.config import GKDConfig
from recipe_gkd.config.teachers import teacher_handles
from recipe_gkd.observe import console
from recipe_gkd.observe.divergence_watch import DIVERGENCE_FILE
from recipe_gkd.observe.metrics import EVAL_FILE, METRICS_FILE, read_metrics
from recipe_gkd.observe.plots import before_after_table, plot_run
from recipe_gkd.pools import RolloutPool
from recipe_gkd.rollout.answer_accuracy import AnswerAccuracy

# The exported student, under the run directory.
FINAL_EXPORT_DIR = "final_student"
# A LoRA student's adapter as a PEFT directory, beside the merged final_student/.
FINAL_ADAPTER_DIR = "final_adapter"


def teacher_accuracy(cfg: GKDConfig, rollout: RolloutPool) -> tuple[AnswerAccuracy | None, str]:
    """The teacher's held-out accuracy for the report, and the line saying what it counts (or why it is missing).

    CPU runs with an HF teacher only: on GPU clusters the teacher's GPUs belong to the server.
    After training: a failure here is reported in that line and never fails a run that trained.
    """
    if not (cfg.trainer.eval_every and cfg.cluster.device.value == "cpu" and cfg.teacher.backend.value == "hf"):
        return None, ""
    # A teacher with a prompt of its own (privileged context) is measured from both prompts: what the student can
    # reach from its own prompt, and what the teacher's context adds (docs/privileged_teacher.md).
    privileged = any(h.prompt.privileged for h in teacher_handles(cfg).values())
    try:
        measured = rollout.teacher_accuracy()
        own = rollout.teacher_accuracy(own_prompt=True) if privileged else None
    except Exception as err:  # noqa: BLE001 -- the student is trained and exported; the report says what failed
        return None, f"teacher held-out accuracy: not measured ({one_line(err)})"
    line = measured.describe("teacher held-out accuracy", cfg.data.answer_key)
    if own is not None:
        line += "\n" + own.describe(
            "teacher held-out accuracy from its own prompt (privileged context)", cfg.data.answer_key
        )
    return measured, line


def report(cfg: GKDConfig, teacher: AnswerAccuracy | None = None, teacher_line: str = "") -> None:
    """Plots, the before/after table (also saved as summary.txt) and where the student went.

    Runs after the export: nothing here may fail a run that trained (a plot that cannot be drawn is
    said so in the summary).
    """
    run_dir = Path(cfg.trainer.run_dir)
    lines = [
        f"run directory: {run_dir.resolve()}",
        f"exported student: {run_dir.resolve() / FINAL_EXPORT_DIR}",
        f"third-party warnings and banners: {console.log_path(run_dir).resolve()}",
    ]
    if cfg.trainer.eval_every:
        evals = read_metrics(run_dir, EVAL_FILE)
        accuracy = None if teacher is None else teacher.accuracy
        try:
            lines.append(f"plots: {plot_run(run_dir, accuracy)}")
        except Exception as err:  # noqa: BLE001 -- a plot is not worth failing a trained run for
            lines.append(f"plots: not drawn ({one_line(err)})")
        privileged = any(h.prompt.privileged for h in teacher_handles(cfg).values())
        table = before_after_table(evals, accuracy, cfg.algorithm.divergence.value, privileged)
        lines += ["", run_line(cfg, run_dir), table, student_answers_line(cfg, evals)]
        lines += [teacher_line] if teacher_line else []
    diverged = run_dir / DIVERGENCE_FILE
    lines += ["", diverged.read_text().strip()] if diverged.is_file() else []
    text = "\n".join(lines)
    (run_dir / "summary.txt").write_text(text + "\n")
    print("\n" + text, flush=True)


def student_answers_line(cfg: GKDConfig, evals: list[dict[str, Any]]) -> str:
    """What the student's held-out accuracy counts: the evaluated records that have an answer."""
    if not evals:
        return ""
    last = evals[-1]
    answered, records = last.get("eval_answered"), last.get("eval_sequences")
    key = f"data.answer_key={cfg.data.answer_key}"
    if not answered:
        return f"student held-out accuracy: none of the {records} held-out records has an answer ({key})"
    return (
        f"student held-out accuracy (greedy, table above): over the {answered} of {records} held-out records that "
        f"have an answer ({key})"
    )


def run_line(cfg: GKDConfig, run_dir: Path) -> str:
    """What was run, for the table below it: the run's name, its objective and target, its steps, lr, wall time."""
    steps = read_metrics(run_dir) if (run_dir / METRICS_FILE).is_file() else []
    seconds = sum(float(r.get("step_s") or 0.0) for r in steps)
    a = cfg.algorithm
    target = "the teacher's hidden states" if cfg.teacher.output.value == "hidden" else f"support {a.support.value}"
    across = f", across tokenizers ({a.cross_tokenizer.value})" if a.cross_tokenizer.value != "none" else ""
    env = f", conversations with {cfg.rollout.env}" if cfg.rollout.env else ""
    last = int(steps[-1]["step"]) if steps else 0
    return (
        f"run {run_dir.name}: {a.divergence.value} on {target}{across}{env}; {last} of {cfg.trainer.total_steps} "
        f"steps, lr {cfg.actor.optim.lr:g}, schedule {a.schedule.value}, {seconds:.1f} s in training steps"
    )


def one_line(err: BaseException) -> str:
    """`Type: first line` of an error (a Ray task error's own cause when it wraps one)."""
    cause = getattr(err, "cause", None) or err
    first = (str(cause).strip().splitlines() or [""])[0]
    return f"{type(cause).__name__}: {first}"
