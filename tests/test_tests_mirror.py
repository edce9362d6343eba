"""tests/ mirrors the tree: a test file lives under the path of what it tests, helpers in tests/support only.

- a test file's folder under tests/ is a folder of the repository (a package under recipe_gkd/ or teacher_server/,
  or another folder such as launch/), tests/ itself (repository-wide checks), tests/e2e (the whole program through
  the CLI) or tests/support (the helpers' own tests);
- any other module under tests/ is a helper and lives in tests/support (conftest.py files excepted): no __init__.py,
  since pytest's rootdir import mode puts each test file's folder on sys.path;
- test basenames are unique (that same import mode imports each test file by its basename);
- a test file imports no other test file: what tests share lives in tests/support.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT

TESTS = REPO_ROOT / "tests"
PACKAGES = ("recipe_gkd", "teacher_server")
OWN_FOLDERS = ("e2e", "support")


def is_test_file(path: Path) -> bool:
    """pytest's default python_files: test_*.py and *_test.py."""
    return path.name.startswith("test_") or path.name.endswith("_test.py")


def mirrors_the_tree(folder: Path, repo_root: Path) -> bool:
    """Whether `folder` (relative to tests/) may hold test files."""
    parts = folder.parts
    if not parts or (len(parts) == 1 and parts[0] in OWN_FOLDERS):
        return True
    if parts[0] in ("tests", *OWN_FOLDERS) or any(part.startswith((".", "__")) for part in parts):
        return False
    source = repo_root.joinpath(*parts)
    if parts[0] in PACKAGES:
        return (source / "__init__.py").is_file()
    return source.is_dir()


def misplaced(tests: Path, repo_root: Path) -> list[str]:
    """Each python file under `tests` that breaks the mirror, with why."""
    found = []
    for path in sorted(tests.rglob("*.py")):
        rel = path.relative_to(tests)
        if "__pycache__" in rel.parts:
            continue
        if is_test_file(path):
            if not mirrors_the_tree(rel.parent, repo_root):
                found.append(f"tests/{rel}: tests/{rel.parent} mirrors no folder of the repository")
        elif path.name != "conftest.py" and rel.parent != Path("support"):
            found.append(f"tests/{rel}: a helper outside tests/support")
    return found


def test_every_test_file_lives_where_what_it_tests_lives() -> None:
    assert misplaced(TESTS, REPO_ROOT) == []


def test_test_basenames_are_unique() -> None:
    seen: dict[str, list[str]] = {}
    for path in TESTS.rglob("*.py"):
        if is_test_file(path):
            seen.setdefault(path.name, []).append(str(path.relative_to(TESTS)))
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}


def test_no_test_file_imports_another() -> None:
    importers = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if any(name.split(".")[0].startswith("test_") for name in names):
                importers.append(str(path.relative_to(TESTS)))
    assert importers == [], "what tests share lives in tests/support"


@pytest.mark.parametrize(
    ("dropped", "why"),
    [
        ("recipe_gkd/nosuchpkg/test_x.py", "mirrors no folder"),
        ("recipe_gkd/demo/data/test_x.py", "mirrors no folder"),  # a folder, not a package
        ("unit/test_x.py", "mirrors no folder"),
        ("e2e/deeper/test_x.py", "mirrors no folder"),
        ("tests/test_x.py", "mirrors no folder"),
        ("recipe_gkd/rollout/helpers.py", "a helper outside tests/support"),
        ("recipe_gkd/__init__.py", "a helper outside tests/support"),
    ],
)
def test_a_file_dropped_in_the_wrong_place_is_named(tmp_path: Path, dropped: str, why: str) -> None:
    repo = tmp_path / "repo"
    for package in ("recipe_gkd/rollout", "recipe_gkd/demo/data", "teacher_server/wire", "launch"):
        (repo / package).mkdir(parents=True)
        if not package.endswith("data") and package != "launch":
            (repo / package / "__init__.py").write_text("")
    (repo / "recipe_gkd" / "__init__.py").write_text("")
    tests = repo / "tests"
    fine = ["test_root.py", "conftest.py", "recipe_gkd/rollout/test_a.py", "teacher_server/wire/test_b.py"]
    fine += ["launch/test_c.py", "e2e/test_d.py", "e2e/conftest.py", "support/helper.py", "support/test_e.py"]
    for rel in fine:
        (tests / rel).parent.mkdir(parents=True, exist_ok=True)
        (tests / rel).write_text("")
    assert misplaced(tests, repo) == []
    (tests / dropped).parent.mkdir(parents=True, exist_ok=True)
    (tests / dropped).write_text("")
    found = misplaced(tests, repo)
    assert len(found) == 1 and found[0].startswith(f"tests/{dropped}: ") and why in found[0], found
