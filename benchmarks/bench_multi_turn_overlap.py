"""Does two_step_off hide a tool's latency? The real schedule (gkd.RolloutPipeline) and the real rollout worker
holding multi-turn conversations, with tools that sleep and an actor step that sleeps, in one process.

    .venv/bin/python benchmarks/bench_multi_turn_overlap.py [--tool-s 0.5] [--train-s 1.5] [--steps 9] [--new-tokens 4]

The rollout worker is a real `RolloutWorker` on the HF engine (a random tiny model with a Qwen-style tool template),
its conversations held with an environment that answers every turn with a tool result after `--tool-s` seconds
(a remote tool: no CPU), for `TOOL_TURNS` tool turns. The pool runs each call on a thread, two at a time, as the Ray
pool's `max_concurrency=2` does (score t+1 beside generate t+2); the actor's step is a sleep of `--train-s` (the
question is the schedule's, not the actor's speed, and a sleep leaves the 2 cores to generation). Reports, per
schedule, the median step time after the first two steps (and before the last two) and the rollout worker's generate_s and tool_s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from tool_chat import with_tool_template  # noqa: E402

from recipe_gkd.config import load_config  # noqa: E402
from recipe_gkd.envs import Message, StepResult  # noqa: E402
from recipe_gkd.gkd import RolloutPipeline  # noqa: E402
from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm  # noqa: E402
from recipe_gkd.rollout.producers import Conversations  # noqa: E402
from recipe_gkd.rollout.worker import RolloutWorker  # noqa: E402
from recipe_gkd.targets import build_target  # noqa: E402
from teacher_server.wire.scores import TeacherScores, scores_from_logprobs  # noqa: E402

TOOL_TURNS = 2
WARMUP_STEPS = 2
TOP_K = 4


class SlowToolEnv:
    """Answers each assistant turn with one tool result after `latency` seconds; ends after TOOL_TURNS of them."""

    name: ClassVar[str] = "slow_tool"

    def __init__(self, latency: float) -> None:
        self.latency, self.turns = latency, 0

    def reset(self, record: Mapping[str, Any], seed: int = 0) -> list[Message]:
        self.turns = 0
        return [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": str(record["prompt"])}]

    def step(self, assistant_message: Message) -> StepResult:
        self.turns += 1
        if self.turns > TOOL_TURNS:
            return StepResult([], done=True, reward=1.0)
        time.sleep(self.latency)
        return StepResult([{"role": "tool", "content": "42"}], done=False, tool_calls=1)

    def tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": "lookup", "description": "Looks up.", "parameters": {}}}]


class UniformTeacher:
    """A Scorer that costs nothing: the uniform distribution over the vocabulary."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def score(self, sequences: list[np.ndarray], score_from: list[int], named_ids: Any = None) -> list[TeacherScores]:
        rows = [
            np.full((len(s) - f, self.vocab), -np.log(self.vocab)) for s, f in zip(sequences, score_from, strict=True)
        ]
        return [scores_from_logprobs(r, s[f:], TOP_K) for r, s, f in zip(rows, sequences, score_from, strict=True)]


class ThreadedRolloutPool:
    """The RolloutPool calls the pipeline makes, each on a thread (two at a time, as the Ray actor's)."""

    def __init__(self, worker: RolloutWorker) -> None:
        self.worker, self.size = worker, 1
        self.threads = ThreadPoolExecutor(max_workers=2)

    def _launch(self, fn: Callable[[], Any]) -> Future:
        return self.threads.submit(fn)

    def produce(self, step: int) -> Future:
        return self._launch(lambda: self.worker.produce(step, 1))

    def generate(self, step: int) -> Future:
        return self._launch(lambda: self.worker.generate(step))

    def score(self, step: int) -> Future:
        return self._launch(lambda: self.worker.score(step, 1))

    def wait(self, pending: Future, phase: str) -> list[Any]:
        return [pending.result(timeout=600)]

    def wait_done(self, pending: Future, phase: str) -> None:
        pending.exception(timeout=600)


def run(schedule: str, args: argparse.Namespace, model: Path, data: Path) -> dict[str, float]:
    cfg = load_config(
        None,
        [
            f"model.student_path={model}",
            "rollout.backend=hf",
            f"data.train_files=[{data}]",
            "data.train_batch_size=4",
            "actor.micro_batch_size=1",
            "data.max_prompt_length=448",
            "rollout.env=calculator",
            "rollout.max_total_tokens=1024",
            f"rollout.sampling.max_new_tokens={args.new_tokens}",
            f"algorithm.schedule={schedule}",
            f"trainer.total_steps={args.steps}",
        ],
    )
    worker = RolloutWorker(cfg, rank=0, world=1, target=build_target(cfg))
    worker.setup(scorer=UniformTeacher(len(worker_tokenizer(model))))
    assert isinstance(worker.producer, Conversations)
    worker.producer.loop.new_env = lambda: SlowToolEnv(args.tool_s)
    pool = ThreadedRolloutPool(worker)
    pipeline = RolloutPipeline(cfg, SimpleNamespace(rollout=pool, actor=SimpleNamespace(dp_size=1)), 0)
    step_s, generate_s, tool_s = [], [], []
    for step in range(args.steps):
        start = time.perf_counter()
        batch = pipeline.next_batch(step)
        time.sleep(args.train_s)  # the actor's step
        pipeline.wait_for_generation()  # the weight sync waits for the engines
        step_s.append(time.perf_counter() - start)
        generate_s.append(batch.stats[0].timings["generate_s"])
        tool_s.append(batch.stats[0].episodes["tool_s"])
    pool.threads.shutdown()
    # After warm-up, and before the last two steps (two_step_off launches no generation there: nothing to hide).
    kept = slice(WARMUP_STEPS, args.steps - 2)
    return {
        "steps_s": [round(x, 3) for x in step_s],
        "generates_s": [round(x, 3) for x in generate_s],
        "step_s": statistics.median(step_s[kept]),
        "generate_s": statistics.median(generate_s[kept]),
        "tool_s": statistics.median(tool_s[kept]),
    }


def worker_tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool-s", type=float, default=0.5, help="seconds of one tool call")
    parser.add_argument("--train-s", type=float, default=1.5, help="seconds of one actor step")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--new-tokens", type=int, default=4, help="tokens per turn (few: tool latency dominates)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_causal_lm(
            Path(tmp) / "m", seed=0, spec=TinyModelSpec(max_position_embeddings=1024), tokenizer_kind="chatml_bpe"
        )
        with_tool_template(model)
        data = Path(tmp) / "train.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "1"}) + "\n" for i in range(64)))
        results = {s: run(s, args, model, data) for s in ("two_step_off", "sync")}
    print(json.dumps({"tool_s_per_call": args.tool_s, "train_s": args.train_s, **results}))


if __name__ == "__main__":
    main()
