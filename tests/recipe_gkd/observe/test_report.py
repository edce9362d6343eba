"""The run's report after training: accuracies over the records that have an answer, and nothing in it fails a
run that trained (a teacher-accuracy pass that raises is reported, not raised)."""

from __future__ import annotations

import json
from pathlib import Path

from recipe_gkd.config import load_config
from recipe_gkd.observe import report
from recipe_gkd.rollout.answer_accuracy import AnswerAccuracy


class TeacherAccuracyPool:
    """The one RolloutPool call the report makes, answering `result` or raising it."""

    def __init__(self, result: AnswerAccuracy | Exception) -> None:
        self.result = result

    def teacher_accuracy(self) -> AnswerAccuracy:
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def _run_dir_with_evals(tmp_path: Path, answered: int, sequences: int) -> Path:
    rows = [
        {
            "step": s,
            "eval_reward": 0.5 if answered else None,
            "eval_teacher_kl": 1.0 / (s + 1),
            "eval_answered": answered,
        }
        | {"eval_sequences": sequences}
        for s in (0, 4)
    ]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    return tmp_path


def test_the_report_counts_the_records_with_an_answer(tmp_path: Path) -> None:
    cfg = load_config(None, [f"trainer.run_dir={_run_dir_with_evals(tmp_path, 3, 12)}"])
    teacher, line = report.teacher_accuracy(cfg, TeacherAccuracyPool(AnswerAccuracy(correct=2, answered=3, records=12)))  # type: ignore[arg-type]
    assert teacher is not None and teacher.accuracy == 2 / 3
    report.report(cfg, teacher, line)
    summary = (tmp_path / "summary.txt").read_text()
    assert "teacher held-out accuracy: 66.7% over the 3 of 12 held-out records that have an answer" in summary
    assert (
        "student held-out accuracy (greedy, table above): over the 3 of 12 held-out records that have an answer"
        in summary
    )


def test_open_ended_records_only_and_a_failing_teacher_pass_still_report(tmp_path: Path) -> None:
    cfg = load_config(None, [f"trainer.run_dir={_run_dir_with_evals(tmp_path, 0, 12)}"])
    teacher, line = report.teacher_accuracy(cfg, TeacherAccuracyPool(KeyError("answer")))  # type: ignore[arg-type]
    assert teacher is None and line == "teacher held-out accuracy: not measured (KeyError: 'answer')"
    report.report(cfg, teacher, line)
    summary = (tmp_path / "summary.txt").read_text()
    assert "student held-out accuracy: none of the 12 held-out records has an answer" in summary
    assert line in summary and (tmp_path / "training.png").is_file()
    none = AnswerAccuracy(correct=0, answered=0, records=12)
    assert none.accuracy is None and "none of the 12 held-out records has an answer" in none.describe("t", "answer")


class TwoPromptPool:
    """The teacher's accuracy from the student's prompt and from its own (privileged context)."""

    def __init__(self) -> None:
        self.asked: list[bool] = []

    def teacher_accuracy(self, own_prompt: bool = False) -> AnswerAccuracy:
        self.asked.append(own_prompt)
        return AnswerAccuracy(correct=9 if own_prompt else 1, answered=10, records=12)


def test_a_teacher_with_its_own_prompt_is_reported_from_both_prompts(tmp_path: Path) -> None:
    run_dir = _run_dir_with_evals(tmp_path, 10, 12)
    plain = TwoPromptPool()
    report.teacher_accuracy(load_config(None, [f"trainer.run_dir={run_dir}"]), plain)  # type: ignore[arg-type]
    assert plain.asked == [False], "no prompt of its own: measured once"
    cfg = load_config(None, [f"trainer.run_dir={run_dir}", "data.teacher_prompt_key=hint"])
    pool = TwoPromptPool()
    teacher, line = report.teacher_accuracy(cfg, pool)  # type: ignore[arg-type]
    assert pool.asked == [False, True] and teacher is not None and teacher.accuracy == 0.1
    report.report(cfg, teacher, line)
    summary = (tmp_path / "summary.txt").read_text()
    assert "teacher held-out accuracy: 10.0% over the 10 of 12" in summary
    assert "teacher held-out accuracy from its own prompt (privileged context): 90.0% over the 10 of 12" in summary
