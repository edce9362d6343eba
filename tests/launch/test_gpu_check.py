"""The GPU check's network-free part (launch/gpu_check.sh, recipe_gkd/selfcheck/stage0.py): the recorded wheel list,
the size rule, and stage 0 at tiny sizes in an interpreter that can import only what a bare GPU image has
(torch, transformers and their own dependencies) plus the recorded wheels.

The download itself needs the registry: `launch/gpu_check.sh prepare` is rehearsed by hand (docs/gpu_validation.md).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

MIB = 1024**2
LIMIT_MIB = 60
RECORD = "launch/gpu_check_wheels.json"


def record(repo_root: Path) -> dict:
    return json.loads((repo_root / RECORD).read_text())


def tracked_bytes(repo_root: Path) -> int:
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo_root,
        capture_output=True,
        check=True,
        timeout=60,
    )
    files = [repo_root / n for n in names.stdout.decode().split("\0") if n]
    return sum(f.stat().st_size for f in files if f.is_file())


def test_the_recorded_wheels_are_python_3_12_manylinux_x86_64_and_fit_with_the_tree(repo_root: Path) -> None:
    wheels = record(repo_root)["wheels"]
    assert record(repo_root)["python"] == "3.12"
    for w in wheels:
        stem = w["name"].replace("-", "_")
        # name-version-pythontag-abitag-platform.whl: CPython 3.12 (or the stable ABI of an older CPython 3, or pure
        # Python), manylinux x86_64 (or any).
        match = re.fullmatch(rf"{stem}-{re.escape(w['version'])}-(cp3\d+|py3)-(cp312|abi3|none)-(.+)\.whl", w["file"])
        assert match, w["file"]
        assert match.group(1) in ("cp312", "py3") or match.group(2) == "abi3", w["file"]
        assert match.group(3) == "any" or ("manylinux" in match.group(3) and match.group(3).endswith("x86_64"))
        assert w["bytes"] > 0 and re.fullmatch(r"[0-9a-f]{64}", w["sha256"])
    names = {w["name"] for w in wheels}
    # Never the image's own packages (torch, transformers) nor the stage-1 stack.
    assert names.isdisjoint({"torch", "transformers", "ray", "vllm", "triton"}), names
    carried = sum(w["bytes"] for w in wheels)
    assert carried + tracked_bytes(repo_root) <= LIMIT_MIB * MIB, f"carry {carried / MIB:.1f} MiB + tree"


def size_rule(repo_root: Path, carry: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(repo_root / "launch" / "gpu_check.sh"), "check", str(carry)],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )


def test_the_size_rule_refuses_a_carry_over_60_mib_naming_the_largest_file(repo_root: Path, tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    room = LIMIT_MIB * MIB - tracked_bytes(repo_root)
    with (wheels / "small.whl").open("wb") as handle:
        handle.truncate(room)  # sparse: its size counts, nothing is written
    done = size_rule(repo_root, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    with (wheels / "big_one.whl").open("wb") as handle:
        handle.truncate(1)  # one byte over
    done = size_rule(repo_root, tmp_path)
    assert done.returncode == 1 and "refused" in done.stderr
    assert done.stderr.splitlines()[1].strip().endswith("small.whl"), done.stderr  # the largest first


def verify(repo_root: Path, carry: Path, python: str) -> subprocess.CompletedProcess[str]:
    script = repo_root / "launch" / "gpu_check_size.py"
    cmd = [sys.executable, str(script), "--verify", str(repo_root / RECORD), "--carry", str(carry), "--python", python]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_a_download_that_is_not_the_recorded_file_is_refused(repo_root: Path, tmp_path: Path) -> None:
    """At the recorded Python each wheel must be the recorded file (sha256); nothing else may lie in the carry."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for w in record(repo_root)["wheels"]:
        (wheels / w["file"]).write_bytes(b"not the wheel")
    done = verify(repo_root, tmp_path, "3.12")
    assert done.returncode == 1 and "is not the recorded" in done.stderr
    # Another Python (the CPU rehearsal's): names and versions only.
    assert verify(repo_root, tmp_path, "3.11").returncode == 0
    (wheels / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl").write_bytes(b"")
    done = verify(repo_root, tmp_path, "3.11")
    assert done.returncode == 1 and "ray-2.60.0" in done.stderr


# An interpreter that sees a bare GPU image: the standard library, the project, torch's and transformers' own
# dependencies, and the recorded wheels; any other import fails as it would there. Runs stage 0 at tiny sizes and
# prints the top-level modules it imported.
BARE_IMAGE = r"""
import importlib.abc, importlib.machinery, importlib.metadata, json, sys
allowed = set(json.loads(sys.argv[1]))
class BareImage(importlib.abc.MetaPathFinder):
    # In place of the path finder: a package outside the image is not found (import raises ModuleNotFoundError,
    # importlib.util.find_spec returns None), exactly as where it is not installed.
    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top in allowed or top.startswith("_"):
            return importlib.machinery.PathFinder.find_spec(name, path, target)
        return None
    def find_distributions(self, context=None):  # metadata as before: the spec decides what can be imported
        return importlib.machinery.PathFinder.find_distributions(context or importlib.metadata.DistributionFinder.Context())
sys.meta_path[:] = [BareImage() if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
from recipe_gkd.selfcheck import main
rc = main(sys.argv[3:])
with open(sys.argv[2], "w") as handle:
    json.dump(sorted({m.split(".")[0] for m in sys.modules}), handle)
sys.exit(rc)
"""


def requirement_closure(roots: list[str]) -> set[str]:
    """The distributions `roots` need (Requires-Dist without extras, recursively), as installed here."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        todo += [re.split(r"[<>=!~;\[ (]", r, maxsplit=1)[0] for r in requires if "extra ==" not in r]
    return seen


def image_modules(distributions: set[str]) -> set[str]:
    """Top-level import names of `distributions` (those installed here)."""
    return {
        module
        for module, dists in metadata.packages_distributions().items()
        if any(re.sub(r"[-_.]+", "-", d).lower() in distributions for d in dists)
    }


def setuptools_vendored() -> set[str]:
    """What setuptools (torch's dependency on Python 3.12) puts on the path from its _vendor folder (jaraco, ...)."""
    import importlib.util

    spec = importlib.util.find_spec("setuptools")
    vendor = Path(spec.origin).parent / "_vendor" if spec and spec.origin else None
    return {p.name.split(".")[0] for p in vendor.iterdir()} if vendor and vendor.is_dir() else set()


@pytest.mark.slow
def test_stage0_runs_with_the_image_and_the_recorded_wheels_alone(repo_root: Path, tmp_path: Path) -> None:
    """Every check of stage 0 passes in CPU mode at tiny sizes where only the image's packages and the carry can be
    imported, and each carried wheel is imported (none is carried for nothing). Fails if a wheel goes missing
    from the record or the project's stage-0 path starts importing something the GPU image lacks."""
    wheels = record(repo_root)["wheels"]
    carried = {m for w in wheels for m in w["imports"]}
    allowed = image_modules(requirement_closure(["torch", "transformers"])) | carried
    allowed |= {"recipe_gkd", "teacher_server"} | setuptools_vendored()
    imported_file = tmp_path / "imported.json"
    cmd = [sys.executable, "-c", BARE_IMAGE, json.dumps(sorted(allowed)), str(imported_file)]
    # The budget is no subject here (each check's import set is): generous, so a loaded machine runs every check.
    cmd += ["--stage", "0", "--sizes", "tiny", "--out", str(tmp_path / "out"), "--budget-s", "480"]
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo_root), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=repo_root, env=env)
    record_file = tmp_path / "out" / "selfcheck.json"
    assert record_file.is_file(), done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(record_file.read_text())
    failed = {c["name"]: c["detail"][-800:] for c in result["checks"] if c["status"] != "passed"}
    assert done.returncode == 0 and not failed, f"{failed}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    names = [c["name"] for c in result["checks"]]
    assert names[0] == "device" and len(names) == 12 and not result["skipped"], names
    figures = {c["name"]: c["figures"] for c in result["checks"]}
    assert figures["loop"]["steps"] == 2 and all(d is not None for d in figures["loop"]["sync_logprob_diff_per_step"])
    # The learning checks: the CPU presets (the tool one's environment and multi-turn rollout) at 2 steps.
    assert figures["learn_demo"]["steps"] == figures["learn_tools"]["steps"] == 2
    assert set(figures["learn_tools"]["accuracy_per_eval"]) == {"0", "2"}
    assert "tool_calls" in figures["learn_tools"]["trend"] and "tool_calls" not in figures["learn_demo"]["trend"]
    imported = set(json.loads(imported_file.read_text()))
    unused = {w["name"] for w in wheels if not set(w["imports"]) & imported}
    assert not unused, f"carried but never imported by stage 0: {unused}"


def gpu_check(repo_root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = str(repo_root / "launch" / "gpu_check.sh")
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}
    return subprocess.run(["bash", script, *args], capture_output=True, text=True, timeout=60, env=env)


def test_stage1_parts_split_and_join_back_and_a_missing_or_damaged_part_is_refused(
    repo_root: Path, tmp_path: Path
) -> None:
    """Stage 1's transfer in parts of at most --part-mib, each checked on the machine before anything installs."""
    import os
    import random

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    rng = random.Random(0)
    files = {"ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl": 300_000, "sub/b.whl": 12_345}
    for name, size in files.items():
        (src / name).write_bytes(rng.randbytes(size))
    parts = tmp_path / "parts"
    done = gpu_check(repo_root, "split", str(src), str(parts), "--part-mib", "0.1")
    assert done.returncode == 0, done.stderr
    cut = sorted(p for p in parts.iterdir() if p.name.startswith("part."))
    assert len(cut) == 4 and all(p.stat().st_size <= 0.1 * MIB for p in cut)
    done = gpu_check(repo_root, "join", str(parts), str(tmp_path / "dest"))
    assert done.returncode == 0, done.stderr
    assert all((tmp_path / "dest" / n).read_bytes() == (src / n).read_bytes() for n in files)
    # A part one byte off, then a part that never arrived: refused, naming it, nothing unpacked.
    damaged = bytearray(cut[1].read_bytes())
    damaged[10] ^= 1
    cut[1].write_bytes(bytes(damaged))
    done = gpu_check(repo_root, "join", str(parts), str(tmp_path / "dest2"))
    assert done.returncode == 1 and "part.001: FAILED" in done.stdout and not (tmp_path / "dest2").exists()
    os.remove(cut[2])
    done = gpu_check(repo_root, "join", str(parts), str(tmp_path / "dest3"))
    assert done.returncode == 1 and "missing part.002" in done.stderr
