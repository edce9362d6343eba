"""The GPU plan (pure arithmetic) and the checks against what Ray reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipe_gkd.config import CONFIG_DIR, ConfigError, load_config
from recipe_gkd.config.teachers import teacher_sections
from recipe_gkd.plan.placement import build_plan, check_ray_gpus, format_plan, node_resource
from recipe_gkd.plan.placement import main as placement_cli
from recipe_gkd.runtime.check_placement import compare
from recipe_gkd.runtime.ray_cluster import Observed

PRESETS = sorted((CONFIG_DIR / "presets").glob("*.yaml"))


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_plan_is_disjoint_and_covers_every_gpu(path: Path) -> None:
    cfg = load_config(path)
    plan = build_plan(cfg)
    for node in range(plan.nnodes):
        used = [g for s in plan.all_slots() if s.node == node for g in s.gpu_ids]
        if cfg.cluster.colocate:  # every role once on every GPU
            for role in ("actor", "rollout", "teacher"):
                held = [g for s in plan.all_slots() if s.node == node and s.role == role for g in s.gpu_ids]
                assert sorted(held) == list(range(cfg.cluster.gpus_per_node)), role
            used = sorted(set(used))
        assert len(used) == len(set(used)), f"node {node} GPUs shared: {used}"
        if cfg.teacher.location.value == "local":
            assert sorted(used) == list(range(cfg.cluster.gpus_per_node))
    # Every teacher's replicas (one teacher, `default`, unless the preset has `teachers:`).
    sections = teacher_sections(cfg).values()
    assert len(plan.teacher) == sum(t.replicas for t in sections if t.location.value == "local")


def test_1x8_a1_r3_t4_split() -> None:
    plan = build_plan(load_config(CONFIG_DIR / "presets" / "1x8_a1_r3_t4.yaml"))
    assert [s.gpu_ids for s in plan.role("actor")] == [(0,)]
    assert [s.gpu_ids for s in plan.role("rollout")] == [(1,), (2,), (3,)]
    assert [s.gpu_ids for s in plan.teacher] == [(4, 5), (6, 7)]
    assert plan.ray_gpus(0) == 4 and plan.teacher_gpu_ids(0) == (4, 5, 6, 7)
    assert "teacher GPUs 4,5,6,7" in format_plan(plan)


def test_two_nodes_pools_on_their_nodes() -> None:
    plan = build_plan(load_config(CONFIG_DIR / "presets" / "2x8_a8_r4_t4.yaml"))
    assert {s.node for s in plan.role("actor")} == {0} and len(plan.role("actor")) == 8
    assert [(s.node, s.gpu_ids) for s in plan.role("rollout")] == [(1, (0,)), (1, (1,)), (1, (2,)), (1, (3,))]
    assert [(s.node, s.gpu_ids) for s in plan.teacher] == [(1, (4, 5, 6, 7))]
    assert (plan.ray_gpus(0), plan.ray_gpus(1)) == (8, 4)


def test_rollout_tp_gives_multi_gpu_bundles() -> None:
    cfg = load_config(
        CONFIG_DIR / "presets" / "1x8_a2_r2_t4.yaml",
        ["rollout.tp=2", "data.train_batch_size=64", "weight_sync.transport=nccl"],
    )
    assert [s.gpu_ids for s in build_plan(cfg).role("rollout")] == [(2, 3)]


def _ray_node(gpus: int, *extra: str, alive: bool = True) -> dict:
    return {"Alive": alive, "NodeID": "n", "Resources": {"GPU": float(gpus), **{k: 1.0 for k in extra}}}


def test_ray_seeing_teacher_gpus_is_refused() -> None:
    plan = build_plan(load_config(CONFIG_DIR / "presets" / "1x8_a1_r3_t4.yaml"))
    check_ray_gpus(plan, [_ray_node(4)])
    with pytest.raises(ConfigError, match="teacher") as info:
        check_ray_gpus(plan, [_ray_node(8)])
    assert info.value.key == "cluster.gpus_per_node"
    with pytest.raises(ConfigError, match="need 4"):
        check_ray_gpus(plan, [_ray_node(3)])


def test_multi_node_needs_node_labels() -> None:
    plan = build_plan(load_config(CONFIG_DIR / "presets" / "2x8_a8_r4_t4.yaml"))
    check_ray_gpus(plan, [_ray_node(8, node_resource(0)), _ray_node(4, node_resource(1)), _ray_node(0)])
    with pytest.raises(ConfigError, match=r"ray_start\.sh"):
        check_ray_gpus(plan, [_ray_node(8), _ray_node(4)])
    with pytest.raises(ConfigError, match="teacher"):
        check_ray_gpus(plan, [_ray_node(8, node_resource(0)), _ray_node(8, node_resource(1))])


def test_compare_reports_every_mismatch() -> None:
    plan = build_plan(load_config(CONFIG_DIR / "presets" / "1x4_a1_r1_t2.yaml"))
    good = [Observed("actor", 0, 0, "0", ("0",)), Observed("rollout", 0, 0, "1", ("1",))]
    assert compare(plan, good, env={}) == []
    swapped = [Observed("actor", 0, 0, "1", ("1",)), Observed("rollout", 0, 0, "1", ("1",))]
    problems = compare(plan, swapped, env={})
    assert any("shared" in p for p in problems) and any("planned node 0 GPUs 0" in p for p in problems)
    on_teacher = [Observed("actor", 0, 0, "0", ("0",)), Observed("rollout", 0, 0, "2", ("2",))]
    assert any("belongs to the teacher" in p for p in compare(plan, on_teacher, env={}))
    # A preset mask: Ray maps slot i to its i-th entry, and so does the plan.
    mask = {"CUDA_VISIBLE_DEVICES": "3,5,6,7"}
    assert compare(plan, [Observed("actor", 0, 0, "3", ("3",)), Observed("rollout", 0, 0, "5", ("5",))], mask) == []
    assert compare(plan, good, mask)


def test_placement_cli_for_launch_scripts(capsys: pytest.CaptureFixture[str]) -> None:
    preset = str(CONFIG_DIR / "presets" / "2x8_a8_r4_t4.yaml")
    assert placement_cli(["--config", preset, "--node-rank", "1", "--print", "ray-gpus"]) == 0
    assert placement_cli(["--config", preset, "--node-rank", "1", "--print", "teacher-gpus"]) == 0
    assert capsys.readouterr().out.split() == ["0,1,2,3", "4,5,6,7"]
    assert placement_cli(["--config", preset, "--node-rank", "2", "--print", "ray-gpus"]) == 2


def test_plan_ids_are_read_through_a_preset_mask(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A shared node gives the job CUDA_VISIBLE_DEVICES=3,5,6,7: every consumer names those devices."""
    from recipe_gkd.plan.placement import physical_gpu_ids
    from recipe_gkd.plan.placement import teacher_argv as teacher_argv_cli

    assert physical_gpu_ids((0, 2), {}) == ("0", "2")
    assert physical_gpu_ids((0, 2), {"CUDA_VISIBLE_DEVICES": "3,5,6,7"}) == ("3", "6")
    assert physical_gpu_ids((1,), {"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b"}) == ("GPU-b",)
    with pytest.raises(ConfigError) as err:
        physical_gpu_ids((0, 1), {"CUDA_VISIBLE_DEVICES": "3"})
    assert err.value.key == "cluster.gpus_per_node"
    preset = str(CONFIG_DIR / "presets" / "1x4_a1_r1_t2.yaml")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    assert placement_cli(["--config", preset, "--print", "ray-gpus"]) == 0
    assert placement_cli(["--config", preset, "--print", "teacher-gpus"]) == 0
    assert teacher_argv_cli(["--config", preset]) == 0
    out = capsys.readouterr().out.split()
    assert out[:2] == ["3,5", "6,7"] and out[out.index("--gpu-ids") + 1] == "6,7"
    plan = build_plan(load_config(preset))
    assert "CUDA_VISIBLE_DEVICES=3,5,6,7 is set here: plan GPU i is its i-th device" in format_plan(plan)
    assert "is set here" not in format_plan(plan, env={})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert placement_cli(["--config", preset, "--print", "ray-gpus"]) == 2
    assert "cluster.gpus_per_node" in capsys.readouterr().err


def _report_rows(text: str) -> dict[tuple[str, str, str], str]:
    """(role, rank, node) -> the CUDA_VISIBLE_DEVICES column of the placement report."""
    rows = {}
    for line in text.splitlines()[1:]:
        cells = line.split()
        if cells and cells[0] in ("actor", "rollout", "teacher"):
            rows[(cells[0], cells[1], cells[2])] = cells[-1]
    return rows


def test_the_report_shows_the_device_each_worker_is_given(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """CUDA_VISIBLE_DEVICES=3 before a colocated run: Ray gives the actor and the rollout GPU 3 and the teacher
    gets --gpu-ids 3, so every row says 3 (the plan's own id is 0)."""
    from recipe_gkd.main import main as run_cli
    from recipe_gkd.plan.placement import gpu_list

    preset = CONFIG_DIR / "presets" / "cpu_colocated.yaml"
    plan = build_plan(load_config(preset))
    mask = {"CUDA_VISIBLE_DEVICES": "3"}
    rows = _report_rows(format_plan(plan, env=mask))
    assert rows == {("actor", "0", "0"): "3", ("rollout", "0", "0"): "3", ("teacher", "0", "0"): "3"}
    assert gpu_list(plan.teacher_gpu_ids(0), mask) == "3"  # what the autostarted teacher is given
    assert "node 0: Ray sees 1 GPUs; teacher GPUs 3\nGPU 3 of node 0 is shared (colocated)" in format_plan(
        plan, env=mask
    )
    assert set(_report_rows(format_plan(plan, env={})).values()) == {"0"}
    # The dry run prints the same report; a mask narrower than the plan is a bad config, not a crash.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5a1c")
    assert run_cli(["--config", str(preset), "--dry-run"]) == 0
    assert set(_report_rows(capsys.readouterr().out).values()) == {"GPU-5a1c"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert run_cli(["--config", str(preset), "--dry-run"]) == 2
    assert "cluster.gpus_per_node" in capsys.readouterr().err


def test_the_report_maps_the_drivers_node_only() -> None:
    """Two nodes, a mask on the driver's: node 0's rows are its entries, node 1's rows its plan ids."""
    plan = build_plan(load_config(CONFIG_DIR / "presets" / "2x8_a8_r4_t4.yaml"))
    mask = "10,11,12,13,14,15,16,17"
    text = format_plan(plan, env={"CUDA_VISIBLE_DEVICES": mask})
    rows = _report_rows(text)
    for s in plan.all_slots():
        want = ",".join(mask.split(",")[g] for g in s.gpu_ids) if s.node == 0 else s.cuda_visible_devices
        assert rows[(s.role, str(s.rank), str(s.node))] == want
    assert {s.node for s in plan.all_slots()} == {0, 1}
    assert "node 1: Ray sees 4 GPUs; teacher GPUs 4,5,6,7" in text
    assert "other nodes' rows show plan ids" in text
