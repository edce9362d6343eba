"""The two-teacher demo's student (recipe_gkd.demo.mixed_student): its manifest cache, its inputs, the
committed student's accuracies, and the command a missing student's error names (no full build: minutes)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT as REPO

from recipe_gkd.config import CONFIG_DIR, ConfigError, load_config
from recipe_gkd.config.rules import check_local_paths
from recipe_gkd.demo import mixed_student
from recipe_gkd.demo.build_assets import sha256_file
from recipe_gkd.main import resolve_config_models

REPO_ASSETS = REPO / "assets" / "two_teachers"
TWO = CONFIG_DIR / "presets" / "cpu_two_teachers.yaml"


def _fake_student(root: Path) -> None:
    """The layout with placeholder files and a manifest of the current recipe and training file."""
    (root / "data").mkdir(parents=True)
    (root / mixed_student.TRAIN_FILE).write_text('{"prompt": "rev:abcde", "response": "edcba", "answer": "edcba"}\n')
    (root / "student").mkdir()
    (root / "student/model.safetensors").write_text("placeholder\n")
    files = {"student/model.safetensors": {"bytes": 12, "sha256": sha256_file(root / "student/model.safetensors")}}
    manifest = {
        "recipe": mixed_student.recipe(),
        "train_file_sha256": sha256_file(root / mixed_student.TRAIN_FILE),
        "files": files,
    }
    (root / mixed_student.MANIFEST).write_text(json.dumps(manifest))


def test_manifest_check_accepts_a_complete_student_and_names_what_changed(tmp_path: Path) -> None:
    assert "no " in mixed_student.manifest_problem(tmp_path)
    _fake_student(tmp_path)
    assert mixed_student.manifest_problem(tmp_path) is None
    (tmp_path / "student/model.safetensors").write_text("changed\n")
    assert "differs" in mixed_student.manifest_problem(tmp_path)
    (tmp_path / "student/model.safetensors").write_text("placeholder\n")
    with (tmp_path / mixed_student.TRAIN_FILE).open("a") as f:
        f.write('{"prompt": "sum:1234", "response": "+1=1+2=3+3=6+4=10", "answer": "=10"}\n')
    assert "train.jsonl changed" in mixed_student.manifest_problem(tmp_path)


def test_manifest_check_rejects_another_recipe(tmp_path: Path) -> None:
    _fake_student(tmp_path)
    manifest = json.loads((tmp_path / mixed_student.MANIFEST).read_text())
    manifest["recipe"]["stop"]["targets"]["sum"] = 0.9
    (tmp_path / mixed_student.MANIFEST).write_text(json.dumps(manifest))
    assert "recipe" in mixed_student.manifest_problem(tmp_path)


def test_build_skips_when_the_manifest_matches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fake_student(tmp_path)
    manifest = mixed_student.build(tmp_path)
    assert manifest["recipe"] == mixed_student.recipe()
    assert "nothing to do" in capsys.readouterr().out


def test_build_without_the_mixed_data_names_its_command(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"python -m recipe_gkd\.demo\.two_teachers"):
        mixed_student.build(tmp_path)


def test_training_examples_take_each_tasks_share_per_round(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    reversals = [{"prompt": f"rev:{w}", "response": w[::-1], "answer": w[::-1]} for w in ("abcde", "fghij")]
    sums = [{"prompt": f"sum:{d}111", "response": "-", "answer": "-"} for d in range(1, 10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in [*reversals, *sums]))
    shares = {name: t.share for name, t in mixed_student.TASKS.items()}
    rounds = min(len(reversals) // shares["reverse"], len(sums) // shares["sum"])
    prompts = [e.prompt for e in mixed_student.read_train(path)]
    assert len(prompts) == rounds * (shares["reverse"] + shares["sum"])
    assert sum(p.startswith("rev:") for p in prompts) == rounds * shares["reverse"]
    assert prompts[: shares["reverse"]] == [r["prompt"] for r in reversals[: shares["reverse"]]]


def test_training_records_of_no_known_task_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "mul:23", "response": "6", "answer": "6"}\n')
    with pytest.raises(ValueError, match="no known task"):
        mixed_student.read_train(path)


def test_a_missing_demo_student_names_the_command_that_builds_it(tmp_path: Path) -> None:
    cfg = load_config(TWO)
    assert cfg.model.student_path == "assets/two_teachers/student"
    for name in ("demo", "paper"):  # the teachers' models are there; only the student is missing
        shutil.copytree(REPO / "assets" / name, tmp_path / "assets" / name)
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(ConfigError) as err:
            check_local_paths(cfg)
        # The CLI resolves hub ids first: a missing repo-built directory is not looked up on the hub.
        with pytest.raises(ConfigError) as resolving:
            resolve_config_models(load_config(TWO))
    finally:
        os.chdir(cwd)
    assert err.value.key == resolving.value.key == "model.student_path"
    assert "build it with `python -m recipe_gkd.demo.mixed_student`" in str(err.value)
    assert "build it with `python -m recipe_gkd.demo.mixed_student`" in str(resolving.value)
    # The student there, the `sum` teacher's model missing: its own command.
    shutil.copytree(REPO_ASSETS / "student", tmp_path / "assets/two_teachers/student")
    shutil.rmtree(tmp_path / "assets/paper/teacher")
    os.chdir(tmp_path)
    try:
        with pytest.raises(ConfigError) as err:
            check_local_paths(cfg)
    finally:
        os.chdir(cwd)
    assert err.value.key == "teachers.sum.model_path"
    assert "build it with `python -m recipe_gkd.demo.build_assets --task paper`" in str(err.value)


@pytest.mark.slow
def test_committed_student_matches_its_manifest_and_starts_below_both_teachers() -> None:
    """The student in the checkout: intact, some of each task on the preset's held-out records, far from the teachers."""
    cwd = Path.cwd()
    os.chdir(REPO)  # the recipe names its starting model by its repository path
    try:
        assert mixed_student.manifest_problem(REPO_ASSETS) is None
        manifest = json.loads((REPO_ASSETS / mixed_student.MANIFEST).read_text())
        accuracy = mixed_student.heldout_accuracy(
            REPO_ASSETS / "student", REPO_ASSETS / "data/eval.jsonl", mixed_student.EVAL_RECORDS
        )
    finally:
        os.chdir(cwd)
    assert accuracy == pytest.approx(manifest["student"]["eval_accuracy"], abs=0.02)
    for name, figure in accuracy.items():
        assert 0.1 <= figure <= 0.6, (name, figure)  # the teachers: 100% and 95% on these records
