"""`gkd.train` in-process (recipe_gkd/runtime/local_pools.py): the demo's real models, no Ray, no subprocess.

- golden trajectory: the demo's first losses pinned, as torchtune pins its recipes' losses;
- every schedule trains every batch once, in order, with its staleness, on the same data as sync;
- a deliberately broken schedule is caught by the same checks;
- a resumed run equals the uninterrupted one;
- students of each supported family go through the whole loop and come out as HF models;
- the sampled objective at a learning rate it diverges at says so, and stops when asked.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from demo_loop import PROMPTS, demo_config, small_config

from recipe_gkd import gkd
from recipe_gkd.config import GKDConfig
from recipe_gkd.observe.metrics import MetricsLogger, read_metrics
from recipe_gkd.runtime import checkpoint
from recipe_gkd.runtime.local_pools import local_pools

# The demo's first 6 losses as the CLI logged them (Ray, teacher server over ZeroMQ; default seed,
# batch 64, forward KL, lr 3e-4 since issue 40; `python -m recipe_gkd.main trainer.total_steps=6
# algorithm.schedule=sync`). The in-process loop gives the same within 1.1e-5 relative (the wire's rounding).
GOLDEN_LOSSES = [0.49173688, 0.47018682, 0.43015476, 0.47592264, 0.38262646, 0.4043198]
STALENESS = {"sync": [0, 0, 0, 0, 0, 0], "one_step_off": [0, 1, 1, 1, 1, 1], "two_step_off": [0, 1, 2, 2, 2, 2]}


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    """The pinned values were taken on 2 intra-op threads; reductions depend on the thread count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def train_in_process(cfg: GKDConfig, resume: Path | None = None) -> list[dict[str, Any]]:
    """gkd.train on local pools; returns the metrics rows."""
    metrics = MetricsLogger(cfg.trainer.run_dir, cfg.trainer.loggers, cfg.trainer.total_steps)
    try:
        with local_pools(cfg) as pools:
            gkd.train(cfg, pools, metrics, resume)
    finally:
        metrics.close()
    return read_metrics(Path(cfg.trainer.run_dir))


def small_run(repo_root: Path, data: Path, run_dir: Path, schedule: str, *overrides: str) -> list[dict[str, Any]]:
    return train_in_process(small_config(repo_root, data, run_dir, f"algorithm.schedule={schedule}", *overrides))


def check_schedule(rows: list[dict[str, Any]], schedule: str, sync_rows: list[dict[str, Any]]) -> None:
    """What every schedule must keep: each batch once and in order, its staleness, the same data as sync."""
    steps = len(STALENESS[schedule])
    assert [r["batch"] for r in rows] == list(range(steps)), "each batch trained exactly once, in order"
    assert [r["weight_version"] for r in rows] == list(range(1, steps + 1))
    assert [r["staleness"] for r in rows] == STALENESS[schedule]
    assert [r["sample_ids"] for r in rows] == [r["sample_ids"] for r in sync_rows], "the schedule changed the data"
    seen = Counter(i for r in rows for i in r["sample_ids"])
    assert set(seen) == set(range(PROMPTS)) and set(seen.values()) == {2}, "two epochs: every prompt exactly twice"
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in rows)


@pytest.mark.slow
def test_golden_trajectory_of_the_demo(repo_root: Path, tmp_path: Path) -> None:
    # Pinned from `make demo` when the demo ran the sync schedule (its default is two_step_off now).
    rows = train_in_process(
        demo_config(repo_root, tmp_path / "run", "trainer.total_steps=6", "algorithm.schedule=sync")
    )
    np.testing.assert_allclose([r["loss"] for r in rows], GOLDEN_LOSSES, rtol=1e-4)


@pytest.fixture(scope="module")
def sync_rows(repo_root: Path, small_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return small_run(repo_root, small_data, tmp_path_factory.mktemp("sync") / "run", "sync")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["sync", "one_step_off", "two_step_off"])
def test_every_schedule_trains_every_batch_once_with_its_staleness(
    repo_root: Path, small_data: Path, tmp_path: Path, sync_rows: list[dict[str, Any]], schedule: str
) -> None:
    rows = sync_rows if schedule == "sync" else small_run(repo_root, small_data, tmp_path / "run", schedule)
    check_schedule(rows, schedule, sync_rows)
    if schedule != "sync":
        assert [r["loss"] for r in rows][1:] != [r["loss"] for r in sync_rows][1:], "stale batches train differently"


@pytest.mark.parametrize(("schedule", "steps"), [("one_step_off", 1), ("two_step_off", 1), ("two_step_off", 2)])
def test_a_run_shorter_than_its_pipeline_trains_each_of_its_batches_once(
    repo_root: Path, small_data: Path, tmp_path: Path, sync_rows: list[dict[str, Any]], schedule: str, steps: int
) -> None:
    """total_steps below the schedule's read-ahead: each of its batches trained once, in order, on sync's data."""
    rows = small_run(repo_root, small_data, tmp_path / "run", schedule, f"trainer.total_steps={steps}")
    assert [r["batch"] for r in rows] == list(range(steps))
    assert [r["weight_version"] for r in rows] == list(range(1, steps + 1))
    assert [r["staleness"] for r in rows] == STALENESS[schedule][:steps]
    assert [r["sample_ids"] for r in rows] == [r["sample_ids"] for r in sync_rows[:steps]]


@pytest.mark.slow
def test_sampled_reverse_kl_at_top_k_zero_through_the_loop(repo_root: Path, small_data: Path, tmp_path: Path) -> None:
    """The policy-gradient objective on two_step_off batches, with only the sampled tokens' teacher logprobs."""
    cfg = small_config(
        repo_root,
        small_data,
        tmp_path / "run",
        "algorithm.schedule=two_step_off",
        "algorithm.divergence=sampled_reverse_kl",
        "algorithm.ratio_clip=0.1",
        "teacher.top_k=0",
        f"data.eval_files=[{small_data}]",
        "data.eval_batch_size=8",
        "trainer.eval_every=3",
    )
    rows = train_in_process(cfg)
    assert [r["staleness"] for r in rows] == STALENESS["two_step_off"]
    for row in rows:
        assert row["divergence"] == "sampled_reverse_kl" and row["teacher_topk_mass"] is None
        # The actor's token means and the rollout workers' sums are over the same tokens and logprobs.
        assert row["advantage_mean"] == pytest.approx(-row["sampled_reverse_kl"], abs=1e-5)
        assert 0 <= row["ratio_clipped_frac"] < 1 and row["ratio_min"] <= row["ratio_mean"] <= row["ratio_max"]
    # Batch 0 was sampled with the weights it is trained on: ratio 1 (the actor's logprobs equal the engine's),
    # so the loss is the sampled estimate of KL(student || teacher).
    assert rows[0]["ratio_min"] == pytest.approx(1.0, abs=1e-4) and rows[0]["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert rows[0]["loss"] == pytest.approx(rows[0]["sampled_reverse_kl"], abs=1e-4)
    # Two syncs old: the importance ratios are no longer 1.
    assert max(r["ratio_max"] for r in rows[2:]) > 1.01 and min(r["ratio_min"] for r in rows[2:]) < 0.99
    evals = read_metrics(Path(cfg.trainer.run_dir), "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 3, 6]
    assert all(e["eval_teacher_kl"] is None and np.isfinite(e["eval_divergence"]) for e in evals)


@pytest.mark.slow
def test_a_diverging_sampled_objective_says_so_and_stops(
    repo_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo with the sampled objective at lr 3e-3 and no ratio clip diverges (docs/divergence.md: the
    estimate goes from ~1.1 to 7-10 nats, accuracy to 0%): the line comes within 50 steps, and
    trainer.stop_on_divergence stops the run there after a checkpoint."""
    cfg = demo_config(
        repo_root,
        tmp_path / "run",
        "algorithm.divergence=sampled_reverse_kl",
        "teacher.top_k=0",
        "actor.optim.lr=3e-3",
        "algorithm.ratio_clip=0",
        "trainer.total_steps=50",
        "trainer.stop_on_divergence=true",
    )
    with pytest.raises(gkd.RunDiverged, match="stopped after checkpoint") as stopped:
        train_in_process(cfg)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("diverging at step")]
    assert len(lines) == 1 and lines[0] in str(stopped.value)
    assert "actor.optim.lr (now 0.003)" in lines[0] and "algorithm.ratio_clip (now 0" in lines[0]
    rows = read_metrics(Path(cfg.trainer.run_dir))
    step = rows[-1]["step"]
    assert lines[0].startswith(f"diverging at step {step}:") and step <= 50
    assert checkpoint.find_resume(cfg, print) == checkpoint.step_dir(cfg.trainer.run_dir, step)
    assert (tmp_path / "run" / "divergence.txt").read_text().strip() == lines[0], "kept for the summary"


class ProducesAfterTraining(gkd.RolloutPipeline):
    """Broken one_step_off: batch t+1 is produced only when asked for (it degenerates to sync)."""

    def next_batch(self, step: int) -> gkd.Rollout:
        if step not in self.producing:
            self._produce(step)
        results = self.rollout.wait(self.producing.pop(step), f"rollout of step {step}")
        return gkd.Rollout([s for s, _ in results], gkd.by_rank(results, self.dp_size), 0.0)


class ProducesTwice(gkd.RolloutPipeline):
    """Broken one_step_off: one batch is produced twice, so the data stream runs ahead of the steps."""

    def _produce(self, step: int) -> None:
        if step == 2:
            self.rollout.wait(self.rollout.produce(step), "a lost batch")
        super()._produce(step)


@pytest.mark.slow
@pytest.mark.parametrize("broken", [ProducesAfterTraining, ProducesTwice])
def test_a_broken_schedule_is_caught(
    repo_root: Path,
    small_data: Path,
    tmp_path: Path,
    sync_rows: list[dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
    broken: type,
) -> None:
    monkeypatch.setattr(gkd, "RolloutPipeline", broken)
    rows = small_run(repo_root, small_data, tmp_path / "run", "one_step_off")
    with pytest.raises(AssertionError):
        check_schedule(rows, "one_step_off", sync_rows)


# With a checkpoint every 3 steps the pipeline starts afresh at batch 3: its batch is sampled with the checkpoint's
# weights in the uninterrupted run too.
STALENESS_SAVING_EVERY_3 = {"sync": [0] * 6, "one_step_off": [0, 1, 1, 0, 1, 1], "two_step_off": [0, 1, 2, 0, 1, 2]}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["sync", "one_step_off", "two_step_off"])
def test_a_resumed_run_equals_the_uninterrupted_one(
    repo_root: Path, small_data: Path, tmp_path: Path, schedule: str
) -> None:
    """A run stopped after its checkpoint at step 3 and resumed from it logs what the uninterrupted run logs: the
    same batches, sampled with the same weights (staleness), the same sampled responses (lengths, rewards,
    the sampled tokens' log-ratio to the teacher) and the same losses; on every schedule, read-ahead ones included."""
    common = ("trainer.save_every=3",)
    whole = small_run(repo_root, small_data, tmp_path / "whole", schedule, *common)
    assert [r["staleness"] for r in whole] == STALENESS_SAVING_EVERY_3[schedule]
    run_dir = tmp_path / "halves"
    small_run(repo_root, small_data, run_dir, schedule, *common, "trainer.total_steps=3")
    cfg = small_config(repo_root, small_data, run_dir, f"algorithm.schedule={schedule}", *common)
    resumed = train_in_process(cfg, resume=checkpoint.prepare_resume(cfg))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6], "the first half's rows are kept, the rest appended"
    for key in ("batch", "sample_ids", "weight_version", "staleness", "response_tokens", "reward"):
        assert [r[key] for r in resumed] == [r[key] for r in whole], key
    for key in ("loss", "sampled_reverse_kl", "teacher_topk_mass"):
        np.testing.assert_allclose([r[key] for r in resumed], [r[key] for r in whole], rtol=1e-5, err_msg=key)


def test_more_than_one_actor_rank_is_refused(repo_root: Path, tmp_path: Path) -> None:
    from recipe_gkd.config import ConfigError

    cfg = demo_config(repo_root, tmp_path / "run", "cluster.gpus_per_node=4", "actor.gpus_per_node=2")
    with pytest.raises(ConfigError, match=r"actor\.gpus_per_node"), local_pools(cfg):
        pass


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "llama3", "mistral"])
def test_students_of_each_family_through_the_loop(repo_root: Path, tmp_path: Path, family: str) -> None:
    """Student and teacher of one family (Qwen3 q/k norm, Llama 3.x llama3 RoPE, Mistral-style Llama):
    actor, HF rollout, teacher scoring, weight sync, export."""
    import torch
    from transformers import AutoModelForCausalLM

    from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm

    student = build_tiny_causal_lm(tmp_path / "student", seed=5, family=family)
    teacher = build_tiny_causal_lm(tmp_path / "teacher", seed=6, spec=TinyModelSpec(hidden_size=96), family=family)
    words = ["abcde", "hello", "qwert", "zyxwv", "mnopq", "lkjhg", "asdfg", "poiuy"]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"rev:{w}", "answer": w[::-1]}) + "\n" for w in words))
    run_dir = tmp_path / "run"
    cfg = demo_config(
        repo_root,
        run_dir,
        f"model.student_path={student}",
        f"teacher.model_path={teacher}",
        f"data.train_files=[{data}]",
        "data.train_batch_size=8",
        "actor.micro_batch_size=4",
        "rollout.sampling.max_new_tokens=6",
        "trainer.total_steps=3",
    )
    rows = train_in_process(cfg)
    assert [r["weight_version"] for r in rows] == [1, 2, 3] and all(r["loss"] > 0 for r in rows)
    exported = AutoModelForCausalLM.from_pretrained(run_dir / gkd.FINAL_EXPORT_DIR)
    initial = AutoModelForCausalLM.from_pretrained(student)
    assert type(exported) is type(initial) and exported.config.model_type == initial.config.model_type
    assert exported.config.to_dict().get("rope_parameters") == initial.config.to_dict().get("rope_parameters")
    trained, before = dict(exported.named_parameters()), dict(initial.named_parameters())
    assert trained.keys() == before.keys() and any(not torch.equal(trained[n], before[n]) for n in before)


def test_the_sync_check_is_logged_on_the_first_steps_then_every_check_every(
    repo_root: Path, small_data: Path, tmp_path: Path
) -> None:
    cfg = small_config(repo_root, small_data, tmp_path / "run", "weight_sync.check_every=3")
    rows = train_in_process(cfg)
    checked = [r["step"] for r in rows if r["sync_logprob_diff"] is not None]
    assert checked == [1, 2, 3, 6]  # the first two syncs, then versions 3 and 6
    # fp32 actor and fp32 HF engine: the same weights give the same logprobs to float rounding.
    assert all(0 <= r["sync_logprob_diff"] < 1e-5 for r in rows if r["step"] in checked)


def test_without_held_out_prompts_the_sync_probe_takes_training_ones(
    repo_root: Path, small_data: Path, tmp_path: Path
) -> None:
    cfg = small_config(repo_root, small_data, tmp_path / "run", "data.eval_files=[]", "trainer.total_steps=2")
    rows = train_in_process(cfg)
    assert [r["step"] for r in rows if r["sync_logprob_diff"] is not None] == [1, 2]


def test_an_engine_with_one_wrong_tensor_stops_the_run_naming_it(
    repo_root: Path, small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollout engine loads every tensor but perturbs one (as a wrong name map or a dtype slip would):
    the first sync's check stops the run with one line naming the setting and the tensor."""
    from recipe_gkd.rollout import hf, worker
    from recipe_gkd.weight_sync import WeightSyncError

    wrong = "model.layers.1.mlp.down_proj.weight"

    class MisloadingEngine(hf.HFEngine):
        def update_weights(self, named: Any) -> set[str]:
            return super().update_weights((n, v * 1.05 if n == wrong else v) for n, v in named)

    monkeypatch.setattr(worker, "make_engine", MisloadingEngine)
    cfg = small_config(repo_root, small_data, tmp_path / "run")
    with pytest.raises(WeightSyncError) as err:
        train_in_process(cfg)
    message = str(err.value)
    assert "weight sync check after weight version 1" in message and "weight_sync.transport=object_store" in message
    assert f"1 of {len(checked_names(cfg))} tensors: {wrong} differs from the actor's {wrong}" in message
    assert "\n" not in message
    assert read_metrics(tmp_path / "run") == []  # stopped before logging the step trained on other weights


def checked_names(cfg: Any) -> list[str]:
    """The HF tensors the actor exports for the small config's student (tied: no lm_head.weight)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model.student_path)
    return [name for name, _ in model.named_parameters()]


class StaleEngine:
    """An HF engine whose weight loads land nowhere (a reload that misses the engine's real storage): it reports every
    tensor loaded and keeps sampling with version 0."""

    def __new__(cls, cfg: Any) -> Any:
        from recipe_gkd.rollout import hf

        class Stale(hf.HFEngine):
            def update_weights(self, named: Any) -> set[str]:
                return {name for name, _ in named}

        return Stale(cfg)


@pytest.mark.slow
def test_a_stale_engine_fails_the_first_check_at_a_gpu_learning_rate_in_bf16(
    repo_root: Path, small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 at lr 1e-6 (the GPU presets' rate): one Adam step moves the probe's logprobs far less than the bf16
    tolerance, so the probe alone passes a stale engine (shown below with the weight comparison switched off);
    the checksums in the training dtype see it at the first check."""
    from recipe_gkd import weight_sync
    from recipe_gkd.rollout import worker
    from recipe_gkd.weight_sync import WeightSyncError

    monkeypatch.setattr(worker, "make_engine", StaleEngine)
    overrides = ("actor.precision=bf16", "actor.optim.lr=1e-6", "trainer.total_steps=3")
    cfg = small_config(repo_root, small_data, tmp_path / "run", *overrides)
    with pytest.raises(WeightSyncError) as err:
        train_in_process(cfg)
    message = str(err.value)
    assert "after weight version 1: rollout engine 0's weights are not the actor's" in message
    # The probe alone (today's check) passes the same stale engine at every check of the run.
    monkeypatch.setattr(weight_sync.check, "weight_mismatches", lambda actor, engine: [])
    blind = small_config(repo_root, small_data, tmp_path / "blind", *overrides)
    rows = train_in_process(blind)
    checked = [r for r in rows if r["sync_logprob_diff"] is not None]
    assert [r["step"] for r in checked] == [1, 2], "the first two syncs are checked"
    assert all(r["sync_logprob_diff"] < weight_sync.SYNC_TOLERANCE["bf16"] for r in checked), checked
    # The probe's power: it moved less between the two checks than the tolerance it is held to.
    assert checked[0]["sync_probe_shift"] is None
    assert 0 < checked[1]["sync_probe_shift"] < weight_sync.SYNC_TOLERANCE["bf16"]
    assert all(r["sync_tensors_checked"] == len(checked_names(blind)) for r in checked)


def test_a_run_ending_between_evaluations_evaluates_and_reports_its_last_step(
    repo_root: Path, small_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """4 steps with trainer.eval_every=3: evaluated before the first step, after step 3 and after the last; the
    report's table compares step 0 with step 4 and names the run above it."""
    from recipe_gkd.observe.report import report

    cfg = small_config(
        repo_root,
        small_data,
        tmp_path / "run",
        f"data.eval_files=[{small_data}]",
        "data.eval_batch_size=8",
        "trainer.total_steps=4",
        "trainer.eval_every=3",
    )
    train_in_process(cfg)
    evals = read_metrics(tmp_path / "run", "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 3, 4]
    report(cfg)
    summary = (tmp_path / "run" / "summary.txt").read_text()
    header = next(line for line in summary.splitlines() if line.strip().startswith("step 0"))
    assert header.split() == ["step", "0", "step", "4"]
    run_line = next(line for line in summary.splitlines() if line.startswith("run run:"))
    assert "forward_kl on support teacher_topk; 4 of 4 steps, lr" in run_line and " s in training steps" in run_line
