"""Golden trajectories of every target kind, in-process (recipe_gkd/runtime/local_pools.py), for a refactor that must not
change behaviour: a few steps of the demo per kind, each step's loss, grad norm and eval figures.

    python benchmarks/golden_targets.py record runs/golden/before.json
    python benchmarks/golden_targets.py compare runs/golden/before.json runs/golden/after.json
    python benchmarks/golden_targets.py dry-runs runs/golden/dry_before   # every preset's --dry-run output

`record` runs every case (or the ones named with --only) on 2 intra-op threads; `compare` prints the largest
difference per case and exits 1 when a figure differs by more than --rtol (default 0: bit-identical).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "assets" / "demo"
XTOK_TEACHER = REPO / "assets" / "demo_xtok" / "teacher"
TWO = REPO / "assets" / "two_teachers"
PROMPTS = 16
STEPS = 3
# Figures of each metrics row compared; the rest (timings, memory) change run to run.
KEYS_EXCLUDED = ("_s", "_mb", "_per_s", "time", "timestamp", "elapsed", "throughput", "tokens_per")

CASES: dict[str, list[str]] = {
    "topk_forward_kl": [],
    "topk_jsd_one_step_off": ["algorithm.divergence=jsd", "algorithm.schedule=one_step_off"],
    "union_reverse_kl": ["algorithm.support=union", "rollout.student_top_k=8", "algorithm.divergence=reverse_kl"],
    "hidden_forward_kl": ["teacher.output=hidden"],
    "sampled_reverse_kl": ["algorithm.divergence=sampled_reverse_kl", "teacher.top_k=0"],
    "sampled_reverse_kl_topk": ["algorithm.divergence=sampled_reverse_kl"],
    "xtok_span": ["algorithm.cross_tokenizer=span"],
    "xtok_uld": ["algorithm.cross_tokenizer=uld", "algorithm.divergence=reverse_kl"],
    "xtok_sampled": ["algorithm.cross_tokenizer=span", "algorithm.divergence=sampled_reverse_kl", "teacher.top_k=0"],
    "two_teachers": [],
}


def _small(path: Path, out: Path, n: int) -> Path:
    out.write_text("\n".join(path.read_text().splitlines()[:n]) + "\n")
    return out


def _config(name: str, scratch: Path) -> Any:
    from recipe_gkd.config import load_config

    common = [
        "data.train_batch_size=8",
        "data.eval_batch_size=8",
        "actor.micro_batch_size=4",
        "rollout.sampling.max_new_tokens=8",
        f"trainer.total_steps={STEPS}",
        "trainer.eval_every=1",
        f"trainer.run_dir={scratch / name}",
    ]
    if name == "two_teachers":
        data = TWO / "data"
        return load_config(
            str(REPO / "configs" / "presets" / "cpu_two_teachers.yaml"),
            [
                f"model.student_path={TWO / 'student'}",
                f"teachers.reverse.model_path={DEMO / 'teacher'}",
                f"teachers.sum.model_path={REPO / 'assets' / 'paper' / 'teacher'}",
                f"data.train_files=[{_small(data / 'train.jsonl', scratch / 'two_train.jsonl', PROMPTS)}]",
                f"data.eval_files=[{_small(data / 'eval.jsonl', scratch / 'two_eval.jsonl', 8)}]",
                "algorithm.schedule=sync",
                *common,
            ],
        )
    teacher = XTOK_TEACHER if name.startswith("xtok") else DEMO / "teacher"
    return load_config(
        None,
        [
            f"model.student_path={DEMO / 'student'}",
            f"teacher.model_path={teacher}",
            f"data.train_files=[{_small(DEMO / 'data' / 'train.jsonl', scratch / 'train.jsonl', PROMPTS)}]",
            f"data.eval_files=[{_small(DEMO / 'data' / 'eval.jsonl', scratch / 'eval.jsonl', 8)}]",
            "algorithm.schedule=sync",
            *common,
            *CASES[name],
        ],
    )


class _TextRoute:
    """The ZeroMQ hf route's replica path in this process (the server's text requests): render, then the hf backend."""

    def __init__(self, cfg: Any) -> None:
        from transformers import AutoTokenizer

        from teacher_server.server.backends import BackendOptions, load_backend
        from teacher_server.wire.conversation import Renderer

        t = cfg.teacher
        self.tokenizer = AutoTokenizer.from_pretrained(t.model_path)
        self.renderer = Renderer(self.tokenizer)
        self.backend = load_backend("hf", BackendOptions(t.model_path, max_top_k=t.max_top_k, dtype=t.dtype))
        self.top_k, self.temperature = t.top_k, t.temperature

    def score_conversations(self, conversations: list[Any]) -> list[Any]:
        from teacher_server.server.backends import parsed_request

        out = []
        for c in conversations:
            r = self.renderer.render(c)
            request = parsed_request([r.ids], [r.score_from], top_k=self.top_k, temperature=self.temperature)
            scored = self.backend.score(request).split()[0]
            out.append(dataclasses.replace(scored, token_ids=r.ids[r.score_from :], byte_offsets=r.byte_offsets))
        return out


def _scorer(cfg: Any) -> Any:
    """The in-process teacher: the pools' default, or for a teacher of another tokenizer its text route."""
    if cfg.algorithm.cross_tokenizer.value == "none":
        return None
    from transformers import AutoTokenizer

    from recipe_gkd.cross_tokenizer.route import CrossTokenizerScorer

    route = _TextRoute(cfg)
    student = AutoTokenizer.from_pretrained(cfg.model.student_path)
    return CrossTokenizerScorer(route, student, route.tokenizer, cfg.teacher.top_k, cfg.data)


def _figures(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sorted(row.items()) if not any(x in k for x in KEYS_EXCLUDED)}


def run_case(name: str, scratch: Path) -> list[dict[str, Any]]:
    import torch

    from recipe_gkd import gkd
    from recipe_gkd.observe.metrics import MetricsLogger, read_metrics
    from recipe_gkd.runtime.local_pools import local_pools

    torch.set_num_threads(2)
    cfg = _config(name, scratch)
    metrics = MetricsLogger(cfg.trainer.run_dir, cfg.trainer.loggers, cfg.trainer.total_steps)
    try:
        with local_pools(cfg, _scorer(cfg)) as pools:
            gkd.train(cfg, pools, metrics, None)
    finally:
        metrics.close()
    rows = [_figures(r) for r in read_metrics(Path(cfg.trainer.run_dir))]
    evals = Path(cfg.trainer.run_dir) / "eval.jsonl"
    if evals.exists():
        rows += [{"eval": _figures(json.loads(line))} for line in evals.read_text().splitlines()]
    return rows


def record(out: Path, only: list[str]) -> None:
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() and only else {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in only or list(CASES):
            start = time.perf_counter()
            results[name] = run_case(name, Path(tmp))
            print(f"{name}: {len(results[name])} rows in {time.perf_counter() - start:.0f} s", flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1, sort_keys=True))


def _diff(a: Any, b: Any, path: str, out: list[tuple[float, str]]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                out.append((math.inf, f"{path}.{key}: only in {'after' if key not in a else 'before'}"))
            else:
                _diff(a[key], b[key], f"{path}.{key}", out)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append((math.inf, f"{path}: {len(a)} rows before, {len(b)} after"))
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _diff(x, y, f"{path}[{i}]", out)
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if a != b and not (math.isnan(a) and math.isnan(b)):
            rel = abs(a - b) / max(abs(a), abs(b), 1e-30)
            out.append((rel, f"{path}: {a!r} -> {b!r}"))
    elif a != b:
        out.append((math.inf, f"{path}: {a!r} -> {b!r}"))


def compare(before: Path, after: Path, rtol: float) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    worst = 0.0
    for name in sorted(set(a) | set(b)):
        diffs: list[tuple[float, str]] = []
        _diff(a.get(name), b.get(name), name, diffs)
        top = max(diffs, default=(0.0, "identical"))
        worst = max(worst, top[0])
        print(f"{name}: {len(diffs)} figures differ; largest {top[1]}")
    return 0 if worst <= rtol else 1


def dry_runs(out: Path) -> None:
    """Every preset's `python -m recipe_gkd.main --config PRESET --dry-run` output and exit code, one file each
    (compare two directories with `diff -r`)."""
    import os
    import subprocess

    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for preset in sorted((REPO / "configs" / "presets").glob("*.yaml")):
        cmd = [sys.executable, "-m", "recipe_gkd.main", "--config", str(preset), "--dry-run"]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        (out / f"{preset.stem}.out").write_text(f"{proc.stdout}{proc.stderr}rc={proc.returncode}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("out", type=Path)
    rec.add_argument("--only", nargs="*", default=[], choices=list(CASES))
    cmp = sub.add_parser("compare")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    cmp.add_argument("--rtol", type=float, default=0.0)
    dry = sub.add_parser("dry-runs")
    dry.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.cmd == "record":
        record(args.out, args.only)
        return 0
    if args.cmd == "dry-runs":
        dry_runs(args.out)
        return 0
    return compare(args.before, args.after, args.rtol)


if __name__ == "__main__":
    sys.exit(main())
