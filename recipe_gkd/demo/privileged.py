"""Build the privileged-teacher CPU demo's data offline (configs/presets/cpu_privileged.yaml).

    python -m recipe_gkd.demo.privileged [--out assets/privileged]

The demo's reversal task with the instruction taken out of the student's prompt: the student sees the letters
alone (`uzrxc`), the teacher sees them with the instruction the demo teacher was trained on (`rev:uzrxc`,
through `data.teacher_prompt_template: "rev:{prompt}"`). From the letters alone neither the demo student nor the
demo teacher answers (0% held-out); with the instruction the teacher does. The records are the demo's own
(assets/demo/data, same order, same answers), so the figures compare with the demo's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEMO_DATA = Path("assets/demo/data")
DEFAULT_OUT = Path("assets/privileged")
INSTRUCTION = "rev:"


def without_instruction(record: dict[str, str]) -> dict[str, str]:
    """The demo record with its prompt's instruction removed (the letters alone)."""
    prompt = record["prompt"]
    if not prompt.startswith(INSTRUCTION):
        raise ValueError(f"a demo record whose prompt does not start with {INSTRUCTION!r}: {prompt!r}")
    return {**record, "prompt": prompt.removeprefix(INSTRUCTION)}


def build(out: Path, demo_data: Path = DEMO_DATA) -> list[Path]:
    """Write out/data/{train,eval}.jsonl from the demo's files; returns the paths written."""
    written = []
    (out / "data").mkdir(parents=True, exist_ok=True)
    for name in ("train.jsonl", "eval.jsonl"):
        source = demo_data / name
        if not source.is_file():
            raise FileNotFoundError(f"{source}: build the demo's assets first (python -m recipe_gkd.demo.build_assets)")
        lines = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
        target = out / "data" / name
        target.write_text("".join(json.dumps(without_instruction(r)) + "\n" for r in lines))
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for path in build(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
