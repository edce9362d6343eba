"""The real CLI for a few steps on tiny random models: metrics rows, versions, no orphan process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from cli_runs import THIRD_PARTY_NOISE, WORDS, run_cli

from recipe_gkd.observe.metrics import read_metrics
from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm
from recipe_gkd.runtime.checkpoint import list_checkpoints


def test_bad_override_exits_2_before_starting_anything(inputs: dict[str, Path], tmp_path: Path) -> None:
    proc = run_cli(inputs, tmp_path / "run", "algorithm.divergence=kl", timeout=60)
    assert proc.returncode == 2
    assert "algorithm.divergence" in proc.stderr and "Traceback" not in proc.stderr


MISSING_INPUTS = [
    ("model.student_path=/no/such/model", "model.student_path"),
    ("teacher.model_path=/no/such/teacher", "teacher.model_path"),
    ("data.train_files=[/no/such/data.jsonl]", "data.train_files"),
    ("data.prompt_key=question", "data.prompt_key"),
]


@pytest.mark.parametrize(("override", "key"), MISSING_INPUTS, ids=[k for _, k in MISSING_INPUTS])
def test_missing_inputs_exit_2_before_starting_anything(
    inputs: dict[str, Path], tmp_path: Path, override: str, key: str
) -> None:
    start = time.monotonic()
    proc = run_cli(inputs, tmp_path / "run", override, timeout=60)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: config error at `{key}`")
    assert "Traceback" not in proc.stderr and "Started a local Ray" not in proc.stderr
    assert time.monotonic() - start < 30


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # The tiny student has 2 layers: 4 pipeline stages cannot split them.
        (
            ["cluster.gpus_per_node=6", "actor.gpus_per_node=4", "actor.megatron.pp=4"],
            "actor.megatron.pp=4 must divide",
        ),
        # ... and 4 attention heads: TP=3 cannot split them.
        (
            ["cluster.gpus_per_node=5", "actor.gpus_per_node=3", "actor.megatron.tp=3"],
            "actor.megatron.tp=3 must divide",
        ),
    ],
)
def test_a_split_the_student_cannot_take_exits_2_before_ray(
    inputs: dict[str, Path], tmp_path: Path, overrides: list[str], message: str
) -> None:
    proc = run_cli(inputs, tmp_path / "run", *overrides, "data.train_batch_size=12", timeout=60)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, last
    assert "Traceback" not in proc.stderr and "Started a local Ray" not in proc.stderr


def run_in_terminal(cmd: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    """Run `cmd` with a pseudo-terminal (120 columns) as its stdin, stdout and stderr; its exit code and screen."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(cmd, cwd=cwd, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal has exited
                break
            if not data:
                break
            chunks.append(data)
        returncode = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return returncode, b"".join(chunks).decode(errors="replace")


def _offline_hub(inputs: dict[str, Path], hub: Path) -> dict[str, Path | str]:
    """The tiny student and teacher in a huggingface_hub cache under `hub`, named as hub ids (one @revision)."""
    import shutil

    for repo, source, ref in (("tiny/student", "student", "main"), ("tiny/teacher", "teacher", "v1")):
        root = hub / ("models--" + repo.replace("/", "--"))
        shutil.copytree(inputs[source], root / "snapshots" / ("a" * 40))
        (root / "refs").mkdir()
        (root / "refs" / ref).write_text("a" * 40)
    return {**inputs, "student": "tiny/student", "teacher": "tiny/teacher@v1"}


# One CLI run shared by the tests below, each asserting its own facet (a CLI run costs ~30-60 s of the suite):
# 4 actor ranks (TP=2 x DP=2) on fake GPUs 0-3 and 2 rollout workers, the collective transport end to end, the
# models given as hub ids from an offline cache, algorithm.support=union with reverse KL, one_step_off, memory in the
# metrics, a checkpoint of the last step, the export. (The driver's memory against the dataset's size: test_data.py; a
# run shorter than its pipeline: test_gkd_loop.py.)
TP_DP = [
    "cluster.gpus_per_node=7",
    "actor.gpus_per_node=4",
    "actor.megatron.tp=2",
    "rollout.gpus_per_node=2",
    "weight_sync.transport=gloo",
    "algorithm.schedule=one_step_off",
    "algorithm.divergence=reverse_kl",
    "algorithm.support=union",
    "rollout.student_top_k=8",
    "trainer.total_steps=3",
    "trainer.eval_every=0",
    # At the last step: a checkpoint is a pipeline boundary, one every step would make one_step_off sync.
    "trainer.save_every=3",
    "debug.log_memory=true",
]


@dataclass(frozen=True)
class SharedRun:
    run_dir: Path
    hub: Path
    stdout: str


@pytest.fixture(scope="module")
def tp_dp_run(inputs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> SharedRun:
    """The run of TP_DP; it exited 0."""
    root = tmp_path_factory.mktemp("tp_dp")
    inputs = _offline_hub(inputs, root / "hf" / "hub")
    env = {"HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1"}
    proc = run_cli(inputs, root / "run", *TP_DP, extra_env=env)  # type: ignore[arg-type]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return SharedRun(root / "run", root / "hf" / "hub", proc.stdout)


@pytest.mark.slow
def test_models_given_as_hub_ids_from_an_offline_cache(tp_dp_run: SharedRun) -> None:
    """Student and teacher as hub ids (one @revision), read from a huggingface_hub cache with HF_HUB_OFFLINE=1. The
    driver pins each to its commit and ships the pin, never its own cache's path: the workers resolved the pins."""
    resolved = (tp_dp_run.run_dir / "resolved_config.yaml").read_text()
    assert f"student_path: tiny/student@{'a' * 40}" in resolved
    assert f"model_path: tiny/teacher@{'a' * 40}" in resolved
    assert str(tp_dp_run.hub) not in resolved


@pytest.mark.slow
def test_export_of_a_run_with_pinned_hub_ids(
    tp_dp_run: SharedRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """recipe_gkd.runtime.export reads the run's pins from this machine's cache: the export equals the run's own."""
    from huggingface_hub import constants
    from safetensors.numpy import load_file

    from recipe_gkd.runtime.export import main as export_main

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tp_dp_run.hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert export_main(["--run-dir", str(tp_dp_run.run_dir), "--out", str(tmp_path / "out")]) == 0
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    final = load_file(str(tp_dp_run.run_dir / "final_student" / "model.safetensors"))
    assert exported.keys() == final.keys() and all(np.array_equal(exported[k], final[k]) for k in final)


@pytest.mark.slow
def test_union_support_reverse_kl_runs_through_the_cli(tp_dp_run: SharedRun) -> None:
    """algorithm.support=union: the student's top-8 ids travel with the score request; the loss trains on them."""
    rows = read_metrics(tp_dp_run.run_dir)
    # The columns' teacher mass (its top-8 and the student's top-8) is the server's exact 1 - rest.
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 and 0 < r["teacher_topk_mass"] <= 1 for r in rows)


# Every schedule's order, staleness and exactly-once, runs shorter than their pipeline included, are checked
# in-process (tests/recipe_gkd/test_gkd_loop.py); on Ray: two_step_off, whose rollout worker scores batch t+1 in one thread while
# generating t+2 in another (the default demo's schedule, test_the_default_demo_for_a_few_steps), one_step_off in the
# TP x DP run; across epochs, the kill -9 resume (test_crash_resume.py).


def assert_every_batch_trained_once(
    rows: list[dict], steps: int, staleness: list[int], batch: int = 8, records: int = len(WORDS)
) -> None:
    """Batches in order, each once, at the schedule's staleness; no record more often than the epochs allow."""
    assert [r["batch"] for r in rows] == list(range(steps)), "each batch trained exactly once, in order"
    assert [r["weight_version"] for r in rows] == list(range(1, steps + 1))
    assert [r["staleness"] for r in rows] == staleness
    stream_order = Counter(i for r in rows for i in r["sample_ids"])
    assert sum(stream_order.values()) == batch * steps and max(stream_order.values()) <= -(-batch * steps // records)


@pytest.mark.slow
def test_tensor_and_data_parallel_actor_with_gloo_sync_to_two_rollouts(tp_dp_run: SharedRun) -> None:
    """4 actor ranks (TP=2 x DP=2) on fake GPUs 0-3, 2 rollout workers: placement, TP-aware data routing,
    the collective transport end to end (TP ranks gather, rank 0 broadcasts to both rollouts), export."""
    rows = read_metrics(tp_dp_run.run_dir)
    assert [r["weight_version"] for r in rows] == [1, 2, 3] and [r["staleness"] for r in rows] == [0, 1, 1]
    assert_every_batch_trained_once(rows, 3, [0, 1, 1])
    assert all(r["loss"] > 0 and r["sync_s"] > 0 for r in rows)
    assert all(rows[-1][f"actor{rank}_rss_mb"] > 100 for rank in range(4)), "each actor rank reports its own memory"
    assert rows[-1]["driver_rss_mb"] > 100 and rows[-1]["rollout1_rss_mb"] > 100, "every process reports its memory"
    plan_rows = [
        line.split() for line in tp_dp_run.stdout.splitlines() if line.startswith(("actor ", "rollout ", "teacher "))
    ]
    assert plan_rows[:7] == [
        ["actor", "0", "0", "0", "0"],
        ["actor", "1", "0", "1", "1"],
        ["actor", "2", "0", "2", "2"],
        ["actor", "3", "0", "3", "3"],
        ["rollout", "0", "0", "0", "4"],
        ["rollout", "1", "0", "1", "5"],
        ["teacher", "0", "0", "-", "6"],
    ]
    assert (tp_dp_run.run_dir / "final_student" / "config.json").is_file()
    assert [p.name for p in list_checkpoints(tp_dp_run.run_dir)][-1] == "step_000003", "a checkpoint of the last step"


@pytest.mark.slow
def test_the_default_demo_for_a_few_steps(tmp_path: Path, repo_root: Path) -> None:
    """`python -m recipe_gkd.main` with no --config, on the committed demo assets, in a terminal (a pseudo-tty):
    the project's lines and one progress bar on the screen, no third-party warning; report, plots, export."""
    if not (repo_root / "assets" / "demo" / "manifest.json").is_file():
        pytest.skip("demo assets missing: python -m recipe_gkd.demo.build_assets")
    run_dir = tmp_path / "demo"
    overrides = [
        "trainer.total_steps=4",
        "trainer.eval_every=2",
        "data.eval_batch_size=16",
        f"trainer.run_dir={run_dir}",
    ]
    returncode, screen = run_in_terminal([sys.executable, "-m", "recipe_gkd.main", *overrides], repo_root, 600)
    assert returncode == 0, screen[-6000:]
    assert re.search(r"gkd: +100%\|.*\| 4/4 \[", screen), "the progress bar is drawn"
    assert "workers ready in" in screen and "[eval 0]" in screen
    for noise in THIRD_PARTY_NOISE:
        assert noise not in screen, f"{noise!r} reached the console:\n{screen[-6000:]}"
    known = (run_dir / "logs" / "third_party.log").read_text()
    assert "Apex is not installed" in known, "the known warnings went to the run's log"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # The demo's schedule is two_step_off (the fastest on 2 cores: benchmarks/bench_vs_inprocess.py).
    train_records = len((repo_root / "assets" / "demo" / "data" / "train.jsonl").read_text().splitlines())
    assert_every_batch_trained_once(rows, 4, [0, 1, 2, 2], batch=64, records=train_records)
    for row in rows:
        assert row["loss"] > 0 and row["teacher_kl"] > 0 and len(row["sample_ids"]) == 64
        assert all(row[key] >= 0 for key in ("generate_s", "teacher_s", "train_s", "sync_s", "step_s"))
    assert [e["step"] for e in read_metrics(run_dir, "eval.jsonl")] == [0, 2, 4]
    assert (run_dir / "training.png").stat().st_size > 10_000 and (run_dir / "resolved_config.yaml").is_file()
    assert "teacher held-out accuracy" in screen and "student held-out accuracy" in screen
    summary = (run_dir / "summary.txt").read_text()
    assert "student held-out accuracy" in summary and "teacher held-out accuracy" in summary
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(run_dir / "final_student")
    AutoTokenizer.from_pretrained(run_dir / "final_student")


def test_union_support_with_an_openai_teacher_exits_2(inputs: dict[str, Path], tmp_path: Path) -> None:
    overrides = ["teacher.backend=openai", "teacher.address=http://127.0.0.1:9/v1", "teacher.autostart=false"]
    union = ["algorithm.support=union", "rollout.student_top_k=8"]
    proc = run_cli(inputs, tmp_path / "run", *overrides, *union, timeout=60)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: config error at `algorithm.support`")


# Builds the rollout's vLLM engine with the fake vllm package first on the path; prints the refusal.
UNSUPPORTED_VLLM_SCENARIO = """
import sys
from recipe_gkd.config import load_config
from recipe_gkd.rollout.vllm import VLLMEngine
from teacher_server.vllm_version import UnsupportedVLLMError
try:
    VLLMEngine(load_config(None, ["rollout.backend=vllm", "model.student_path=" + sys.argv[1]]))
except UnsupportedVLLMError as err:
    print(err)
    sys.exit(3)
"""


def test_an_unsupported_vllm_is_refused_naming_the_key(inputs: dict[str, Path], tmp_path: Path) -> None:
    """A vllm package of a release outside the supported range (faked on PYTHONPATH) stops the rollout engine before
    it starts; the driver reports it in one line, exit 1 (a worker's error through Ray: the config-error run above and
    tests/recipe_gkd/test_exit_codes.py)."""
    fake = tmp_path / "fake_site"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text('__version__ = "0.11.0"\n')
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": f"{fake}:{repo}"}
    cmd = [sys.executable, "-c", UNSUPPORTED_VLLM_SCENARIO, str(inputs["student"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith("vLLM 0.11.0 is installed but rollout.backend=vllm supports vllm>=0.24.0,<0.34"), (
        proc.stdout
    )


@pytest.mark.slow
def test_a_chatml_tokenizer_and_eval_records_mostly_without_answers(
    chatml_models: dict[str, Path], tmp_path: Path
) -> None:
    """The tokenizer real instruct models ship (byte-level BPE, ChatML with a default system prompt, eos == pad,
    no BOS), chat datasets saved with `datasets` (`messages` with roles) and a held-out split where most records
    are open-ended: train -> eval -> export -> report, exit 0, with W&B offline; the summary gives the teacher's
    accuracy over the records that have an answer (the teacher answers "ok" to everything). The teacher sends its
    hidden states (teacher.output=hidden): the actor applies the teacher's head and trains on the exact
    full-vocabulary forward KL."""
    import datasets
    from chatml import CHATML_PROMPTS, TEACHER_ANSWER

    def chat(prompt: str, reply: str | None = None) -> list[dict[str, str]]:
        return [{"role": "user", "content": prompt}] + ([{"role": "assistant", "content": reply}] if reply else [])

    # Training records hold the reference reply as their last turn: the prompt is the conversation before it.
    train = tmp_path / "train_ds"
    datasets.Dataset.from_list([{"messages": chat(p, "ok")} for p in CHATML_PROMPTS]).save_to_disk(str(train))
    answers = {0: TEACHER_ANSWER, 3: TEACHER_ANSWER, 7: "no"}  # 2 of the 3 answers are the teacher's
    records = [{"messages": chat(p), "answer": answers.get(i)} for i, p in enumerate(CHATML_PROMPTS)]
    splits = tmp_path / "eval_ds"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(records)}).save_to_disk(str(splits))
    held_out = f"{splits}:test"
    inputs = {"student": chatml_models["student"], "teacher": chatml_models["teacher"], "data": train}
    run_dir = tmp_path / "run"
    overrides = [
        f"data.eval_files=[{held_out}]",
        "data.prompt_key=messages",
        f"data.eval_batch_size={len(records)}",
        "data.max_prompt_length=64",
        "trainer.total_steps=2",
        "trainer.eval_every=2",
        "trainer.loggers=[console,jsonl,wandb]",
        "teacher.output=hidden",
    ]
    offline = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = run_cli(inputs, run_dir, *overrides, extra_env=offline)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    rows = read_metrics(run_dir)
    assert [r["weight_version"] for r in rows] == [1, 2]
    # forward_kl (the default divergence) over the whole vocabulary: the objective is the teacher KL itself.
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 and r["loss"] == pytest.approx(r["teacher_kl"]) for r in rows)
    assert all(r["teacher_topk_mass"] is None for r in rows)  # no top-k travels
    assert len(list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))) == 1, "the W&B run, written offline"
    evals = read_metrics(run_dir, "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2]
    assert all(e["eval_answered"] == 3 and e["eval_sequences"] == len(records) and e["eval_s"] > 0 for e in evals)
    summary = (run_dir / "summary.txt").read_text()
    expected = (
        f"teacher held-out accuracy: 66.7% over the 3 of {len(records)} held-out records that have an answer "
        "(data.answer_key=answer)"
    )
    assert expected in summary, summary
    assert "student held-out accuracy (greedy, table above): over the 3 of 12 held-out records" in summary, summary
    assert (run_dir / "final_student" / "model.safetensors").is_file() and (run_dir / "training.png").is_file()
    from transformers import AutoTokenizer

    exported = AutoTokenizer.from_pretrained(run_dir / "final_student")
    assert exported.eos_token_id == exported.pad_token_id and exported.bos_token is None


def test_teacher_output_hidden_with_another_vocabulary_exits_2(inputs: dict[str, Path], tmp_path: Path) -> None:
    """A teacher whose head lacks rows for ids the tokenizer produces is refused before anything starts (a head
    padded past the student's, as Qwen2.5's larger models pad theirs, is not: tests/recipe_gkd/actor/test_teacher_head.py)."""
    spec = TinyModelSpec(vocab_size=64)  # the char tokenizer has 102 ids
    teacher = build_tiny_causal_lm(tmp_path / "teacher", seed=1, spec=spec)
    inputs = {**inputs, "teacher": teacher}
    proc = run_cli(inputs, tmp_path / "run", "teacher.output=hidden", "teacher.backend=hf", timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: config error at `teacher.output`") and "64 rows" in last, last
