"""Checkpoint files without any worker: atomic commit, verification, resume choice, keep-N, config checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipe_gkd.config import ConfigError, GKDConfig, load_config
from recipe_gkd.exit_codes import EXIT_BAD_CONFIG
from recipe_gkd.main import main
from recipe_gkd.runtime import checkpoint as ck


def make_cfg(run_dir: Path, *overrides: str) -> GKDConfig:
    return load_config(None, [f"trainer.run_dir={run_dir}", *overrides])


def write_checkpoint(cfg: GKDConfig, step: int, payload: bytes = b"weights" * 100) -> Path:
    """A checkpoint as `checkpoint.save` lays it out, with a stand-in actor file."""
    tmp = ck.staging_dir(cfg.trainer.run_dir, step)
    (tmp / ck.ACTOR_DIR).mkdir()
    (tmp / ck.ACTOR_DIR / "__0_0.distcp").write_bytes(payload + bytes([step]))
    semantic = ck.semantic_config(cfg)
    state = ck.TrainerState(step, step, [step * 8], ck.config_hash(semantic), semantic)
    return ck.commit(tmp, state)


def test_commit_is_complete_and_leaves_no_staging(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    path = write_checkpoint(cfg, 12)
    assert path == tmp_path / "checkpoints" / "step_000012"
    assert ck.verify(path) is None
    assert not list((tmp_path / "checkpoints").glob(".tmp_*"))
    manifest = json.loads((path / ck.COMPLETE_FILE).read_text())
    assert set(manifest["files"]) == {"actor/__0_0.distcp", ck.TRAINER_STATE_FILE}
    state = ck.read_state(path)
    assert (state.step, state.weight_version, state.data_positions) == (12, 12, [96])


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_marker", "delete"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_log_line(tmp_path: Path, damage: str) -> None:
    cfg = make_cfg(tmp_path)
    older = write_checkpoint(cfg, 2)
    newest = write_checkpoint(cfg, 4)
    weights = newest / ck.ACTOR_DIR / "__0_0.distcp"
    data = weights.read_bytes()
    if damage == "truncate":
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        weights.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    elif damage == "no_marker":
        (newest / ck.COMPLETE_FILE).unlink()
    else:
        weights.unlink()
    lines: list[str] = []
    assert ck.find_resume(cfg, log=lines.append) == older
    assert len(lines) == 1 and str(newest) in lines[0] and "skipped" in lines[0]


def test_resume_none_and_explicit_path(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    first = write_checkpoint(cfg, 2)
    write_checkpoint(cfg, 4)
    assert ck.find_resume(make_cfg(tmp_path, f"trainer.resume={first}")) == first
    assert ck.find_resume(make_cfg(tmp_path, "trainer.resume=none")) is None
    (first / ck.TRAINER_STATE_FILE).write_text("{}")
    with pytest.raises(ck.CheckpointError, match="not a usable checkpoint"):
        ck.find_resume(make_cfg(tmp_path, f"trainer.resume={first}"))


def test_resume_none_sets_earlier_checkpoints_aside(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    write_checkpoint(cfg, 6)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    lines: list[str] = []
    assert ck.prepare_resume(make_cfg(tmp_path, "trainer.resume=none"), log=lines.append) is None
    assert ck.list_checkpoints(tmp_path) == []
    assert any("moved to" in line for line in lines)
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_prune_keeps_the_newest_by_step_number(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    for step in (9, 10, 100, 11):
        write_checkpoint(cfg, step)
    ck.staging_dir(tmp_path, 101)  # an interrupted save
    ck.prune(tmp_path, keep_last=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_000011", "step_000100"]
    assert not list((tmp_path / "checkpoints").glob(".tmp_*"))


def test_a_different_algorithm_or_data_is_refused_naming_the_keys(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    path = write_checkpoint(cfg, 2)
    state = ck.read_state(path)
    changed = make_cfg(tmp_path, "algorithm.divergence=reverse_kl", "data.train_files=[other.jsonl]")
    with pytest.raises(ConfigError) as err:
        ck.check_config(state, changed, path)
    message = str(err.value)
    assert "algorithm.divergence" in message and "data.train_files" in message and str(path) in message
    assert "trainer.total_steps" not in message


def test_allowed_changes_resume(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    path = write_checkpoint(cfg, 2)
    allowed = make_cfg(
        tmp_path,
        "trainer.total_steps=500",
        "trainer.loggers=[jsonl]",
        "teacher.timeout_s=5",
        "debug.hang_timeout_s=10",
        "weight_sync.timeout_s=7",
        "trainer.save_every=3",
        "trainer.eval_every=0",
        "cluster.gpus_per_node=4",
        "actor.gpus_per_node=2",
        "actor.megatron.tp=2",
        "actor.micro_batch_size=8",
    )
    ck.check_config(ck.read_state(path), allowed, path)


def test_config_mismatch_exits_2_before_starting_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_checkpoint(make_cfg(tmp_path), 2)
    assert main([f"trainer.run_dir={tmp_path}", "algorithm.lmbda=0.5"]) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert "algorithm.lmbda" in err and "Traceback" not in err


def test_metrics_rows_after_the_checkpoint_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    assert ck.truncate_rows(path, 3) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert ck.truncate_rows(path, 3) == 0


def test_data_positions_follow_a_new_rollout_worker_count(tmp_path: Path) -> None:
    assert ck.redistribute_positions([12, 12], 2, tmp_path) == [12, 12]
    assert ck.redistribute_positions([12, 12], 4, tmp_path) == [6, 6, 6, 6]
    with pytest.raises(ck.CheckpointError, match="rollout workers"):
        ck.redistribute_positions([12, 12], 5, tmp_path)
