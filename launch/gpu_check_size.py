"""launch/gpu_check.sh's helpers: the size rule, the downloaded wheels against the record, the record itself.

    python launch/gpu_check_size.py --root REPO --carry DIR [--limit-mib 60]    # exit 1 over the limit
    python launch/gpu_check_size.py --verify launch/gpu_check_wheels.json --carry DIR --python 3.12
    python launch/gpu_check_size.py --record launch/gpu_check_wheels.json --carry DIR --python 3.12
    python launch/gpu_check_size.py --pins launch/gpu_check_wheels.json            # "name==version ..."
    python launch/gpu_check_size.py --recorded-python launch/gpu_check_wheels.json
    python launch/gpu_check_size.py --root REPO --tree-mib                          # the tracked files' MiB

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

MIB = 1024**2
SHOWN = 8  # the largest files named when the rule refuses


def tracked_files(root: Path) -> list[tuple[int, str]]:
    """(bytes, path) of every file of the working tree that travels: tracked, or untracked and not ignored."""
    listing = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    out = subprocess.run(listing, cwd=root, capture_output=True, check=True, timeout=60)
    files = [root / name for name in out.stdout.decode().split("\0") if name]
    return [(f.stat().st_size, str(f.relative_to(root))) for f in files if f.is_file()]


def carry_files(carry: Path) -> list[tuple[int, str]]:
    """(bytes, path) of the wheels that travel (DIR/wheels; DIR/site and DIR/models are built on the machine)."""
    wheels = carry / "wheels"
    return [(f.stat().st_size, str(f)) for f in sorted(wheels.glob("*")) if f.is_file()] if wheels.is_dir() else []


def size_rule(root: Path, carry: Path, limit_mib: float) -> int:
    tree, wheels = tracked_files(root), carry_files(carry)
    tree_b, wheels_b = sum(b for b, _ in tree), sum(b for b, _ in wheels)
    total = tree_b + wheels_b
    print(f"working tree {tree_b / MIB:.1f} MiB + carry {wheels_b / MIB:.1f} MiB = {total / MIB:.1f} MiB (limit {limit_mib} MiB)")
    if total <= limit_mib * MIB:
        return 0
    print(f"refused: {total / MIB:.1f} MiB > {limit_mib} MiB; the largest files:", file=sys.stderr)
    for size, name in sorted(tree + wheels, reverse=True)[:SHOWN]:
        print(f"  {size / MIB:8.2f} MiB  {name}", file=sys.stderr)
    return 1


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_of(wheels: Path, name: str, version: str) -> Path:
    stem = name.replace("-", "_").lower()
    found = [f for f in wheels.glob("*.whl") if f.name.lower().startswith(f"{stem}-{version}-")]
    if len(found) != 1:
        raise SystemExit(f"{wheels}: expected one wheel of {name}=={version}, found {[f.name for f in found]}")
    return found[0]


def verify(record_path: Path, carry: Path, python: str) -> int:
    """Every pinned wheel once and nothing else in DIR/wheels; at the recorded Python, each file as recorded."""
    record = json.loads(record_path.read_text())
    wheels = carry / "wheels"
    expected = {wheel_of(wheels, w["name"], w["version"]): w for w in record["wheels"]}
    extra = sorted(f.name for f in wheels.glob("*") if f not in expected)
    if extra:
        print(f"refused: {wheels} holds files the record does not name: {extra}", file=sys.stderr)
        return 1
    same_python = python == record["python"]
    for path, w in expected.items():
        if same_python and (path.name != w["file"] or path.stat().st_size != w["bytes"] or sha256(path) != w["sha256"]):
            print(f"refused: {path.name} is not the recorded {w['file']} ({w['bytes']} bytes, {w['sha256']})", file=sys.stderr)
            return 1
        print(f"  {path.stat().st_size / MIB:6.2f} MiB  {path.name}")
    if not same_python:
        print(f"Python {python} is not the recorded {record['python']}: names and versions checked, not the files")
    return 0


def write_record(record_path: Path, carry: Path, python: str) -> int:
    """Rewrite the record's files, sizes and hashes from DIR/wheels (after a `prepare` at its Python)."""
    record = json.loads(record_path.read_text())
    if python != record["python"]:
        raise SystemExit(f"the record is for Python {record['python']}, not {python}")
    for w in record["wheels"]:
        path = wheel_of(carry / "wheels", w["name"], w["version"])
        w |= {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256(path)}
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path)
    parser.add_argument("--carry", type=Path)
    parser.add_argument("--pins", type=Path)
    parser.add_argument("--recorded-python", type=Path)
    parser.add_argument("--limit-mib", type=float, default=60.0)
    parser.add_argument("--verify", type=Path)
    parser.add_argument("--record", type=Path)
    parser.add_argument("--python", default="")
    parser.add_argument("--tree-mib", action="store_true")
    args = parser.parse_args()
    if args.pins:
        print(" ".join(f"{w['name']}=={w['version']}" for w in json.loads(args.pins.read_text())["wheels"]))
        return 0
    if args.recorded_python:
        print(json.loads(args.recorded_python.read_text())["python"])
        return 0
    if args.tree_mib and args.root:
        print(f"{sum(b for b, _ in tracked_files(args.root)) / MIB:.2f}")
        return 0
    if args.carry is None:
        parser.error("--carry DIR is needed")
    if args.verify:
        return verify(args.verify, args.carry, args.python)
    if args.record:
        return write_record(args.record, args.carry, args.python)
    if args.root is None:
        parser.error("--root is needed for the size rule")
    return size_rule(args.root, args.carry, args.limit_mib)


if __name__ == "__main__":
    sys.exit(main())
