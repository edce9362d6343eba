"""Model references: local directories, and hub ids read offline from a cache laid out as huggingface_hub lays it out."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recipe_gkd.config import ConfigError
from recipe_gkd.targets import actor_kinds, build_target
from teacher_server.config.model_refs import resolve_model_ref

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


def lay_out_cache(hub_cache: Path, repo: str, model_dir: Path, commit: str, refs: tuple[str, ...]) -> Path:
    """models--org--name/{refs/<ref> -> commit, snapshots/<commit>/<files>}: huggingface_hub's cache layout."""
    root = hub_cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture()
def offline_cache(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    hub = tmp_path / "hub"
    lay_out_cache(hub, "tiny-org/Tiny-LM", tiny_model_dir, COMMIT, ("main",))
    lay_out_cache(hub, "tiny-org/Tiny-LM", tiny_model_dir, OTHER_COMMIT, ("v2",))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub


def test_a_local_directory_is_itself(tiny_model_dir: Path) -> None:
    assert resolve_model_ref(str(tiny_model_dir), "model.student_path") == str(tiny_model_dir)
    assert resolve_model_ref("", "model.tokenizer_path") == ""


def test_hub_ids_resolve_to_their_cached_snapshot(offline_cache: Path) -> None:
    root = offline_cache / "models--tiny-org--Tiny-LM" / "snapshots"
    assert Path(resolve_model_ref("tiny-org/Tiny-LM", "model.student_path")) == root / COMMIT
    assert Path(resolve_model_ref("tiny-org/Tiny-LM@v2", "model.student_path")) == root / OTHER_COMMIT
    assert Path(resolve_model_ref(f"tiny-org/Tiny-LM@{COMMIT}", "teacher.model_path")) == root / COMMIT
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(resolve_model_ref("tiny-org/Tiny-LM", "model.student_path")).model_type


@pytest.mark.parametrize(
    ("ref", "match"),
    [
        ("tiny-org/Not-Cached", r"tiny-org/Not-Cached is not in the Hugging Face cache .* HF_HUB_OFFLINE=1"),
        ("tiny-org/Tiny-LM@no-such-branch", r"tiny-org/Tiny-LM@no-such-branch is not in the Hugging Face cache"),
        ("/no/such/dir", "neither a local directory nor a hub id"),
    ],
)
def test_what_cannot_be_resolved_names_the_key_and_the_id(offline_cache: Path, ref: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        resolve_model_ref(ref, "model.student_path")
    assert info.value.key == "model.student_path"


def test_cli_offline_without_the_model_exits_2_naming_key_and_id(tmp_path: Path) -> None:
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "recipe_gkd.main", "model.student_path=Qwen/Qwen3-1.7B"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "model.student_path" in last and "Qwen/Qwen3-1.7B is not in the Hugging Face cache" in last, last
    assert "Traceback" not in proc.stderr


def test_an_openai_teachers_model_name_is_never_resolved(offline_cache: Path) -> None:
    """teacher.backend=openai: teacher.model_path names the served model; the trainer downloads nothing for it."""
    from recipe_gkd.config import load_config
    from recipe_gkd.main import resolve_config_models

    openai = ["teacher.backend=openai", "teacher.autostart=false", "teacher.address=http://127.0.0.1:8000/v1"]
    cfg = load_config(None, [*openai, "teacher.model_path=tiny-org/Not-Cached"])
    resolve_config_models(cfg)
    assert cfg.teacher.model_path == "tiny-org/Not-Cached"
    with pytest.raises(ConfigError) as info:
        resolve_config_models(load_config(None, ["teacher.model_path=tiny-org/Not-Cached"]))
    assert info.value.key == "teacher.model_path"


# ----------------------------------------------------------------------------- several nodes: pin, resolve per node


def use_cache(monkeypatch: pytest.MonkeyPatch, hub: Path) -> None:
    """This process now reads `hub` as its node's cache (another node's, for the test)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))


def test_the_driver_ships_a_pin_and_each_node_resolves_it_in_its_own_cache(
    offline_cache: Path, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from recipe_gkd.config import load_config
    from recipe_gkd.main import resolve_config_models
    from recipe_gkd.runtime.model_pins import Reader, on_this_node

    cfg = load_config(None, ["model.student_path=tiny-org/Tiny-LM", "model.tokenizer_path=tiny-org/Tiny-LM@v2"])
    resolve_config_models(cfg)
    assert cfg.model.student_path == f"tiny-org/Tiny-LM@{COMMIT}", "pinned to the commit `main` names here"
    assert cfg.model.tokenizer_path == f"tiny-org/Tiny-LM@{OTHER_COMMIT}"
    # Node 1: its own cache, elsewhere, holding the same commits (and `main` moved on there: the pin still holds).
    node1 = tmp_path / "node1_hub"
    lay_out_cache(node1, "tiny-org/Tiny-LM", tiny_model_dir, COMMIT, ())
    lay_out_cache(node1, "tiny-org/Tiny-LM", tiny_model_dir, OTHER_COMMIT, ("main",))
    use_cache(monkeypatch, node1)
    for reader in (Reader.actor, Reader.rollout):
        local = on_this_node(cfg, reader)
        assert Path(local.model.student_path) == node1 / "models--tiny-org--Tiny-LM" / "snapshots" / COMMIT
        assert Path(local.model.tokenizer_path) == node1 / "models--tiny-org--Tiny-LM" / "snapshots" / OTHER_COMMIT
    assert cfg.model.student_path == f"tiny-org/Tiny-LM@{COMMIT}", "the shipped config keeps the pin"


def test_a_node_without_the_model_refuses_naming_key_node_and_the_download(
    offline_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    from recipe_gkd.config import load_config
    from recipe_gkd.main import resolve_config_models
    from recipe_gkd.runtime.model_pins import Reader, on_this_node

    cfg = load_config(None, ["model.student_path=tiny-org/Tiny-LM"])
    resolve_config_models(cfg)
    use_cache(monkeypatch, tmp_path / "empty_hub")
    with pytest.raises(ConfigError) as info:
        on_this_node(cfg, Reader.rollout)
    message = str(info.value)
    assert info.value.key == "model.student_path" and "\n" not in message
    assert f"tiny-org/Tiny-LM@{COMMIT} is not in the Hugging Face cache of node {socket.gethostname()}" in message
    assert f"hf download tiny-org/Tiny-LM --revision {COMMIT}" in message and "HF_HOME" in message


def test_the_ray_rollout_worker_resolves_the_pins_before_it_loads_anything(
    offline_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from recipe_gkd.config import load_config
    from recipe_gkd.main import resolve_config_models
    from recipe_gkd.runtime.ray_pools import RayRolloutWorker

    cfg = load_config(None, ["model.student_path=tiny-org/Tiny-LM"])
    resolve_config_models(cfg)
    use_cache(monkeypatch, tmp_path / "empty_hub")  # the worker's node has no copy
    worker = RayRolloutWorker(cfg, 0, 1, build_target(cfg))
    with pytest.raises(ConfigError) as info:
        worker.setup(None, {})
    assert info.value.key == "model.student_path"
    assert "hf download tiny-org/Tiny-LM" in str(info.value)
    assert worker.engine is None, "nothing loaded"


def test_only_the_processes_that_read_a_teacher_need_its_files(offline_cache: Path) -> None:
    """A teacher served by its own server on another node is resolved there; the actor reads its head only with
    teacher.output=hidden, the rollout its tokenizer only across tokenizers."""
    from recipe_gkd.config import CONFIG_DIR, load_config
    from recipe_gkd.runtime.model_pins import Reader, model_refs

    two_nodes = load_config(CONFIG_DIR / "presets" / "2x8_a8_r4_t4.yaml")
    for reader in Reader:
        assert [r.key for r in model_refs(two_nodes, reader)] == ["model.student_path", "model.tokenizer_path"]
    hidden = load_config(CONFIG_DIR / "presets" / "2x8_a8_r4_t4.yaml", ["teacher.output=hidden"])
    assert "teacher.model_path" in [r.key for r in model_refs(hidden, Reader.actor)]
    assert "teacher.model_path" not in [r.key for r in model_refs(hidden, Reader.rollout)]
    demo = load_config(None)  # autostarted on the driver's node, and read for the CPU teacher accuracy
    assert "teacher.model_path" in [r.key for r in model_refs(demo, Reader.driver)]


def test_the_ray_actor_worker_resolves_the_pins_before_it_loads_anything(
    offline_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from recipe_gkd.config import load_config
    from recipe_gkd.main import resolve_config_models
    from recipe_gkd.runtime.ray_pools import ray_actor_worker_class

    cfg = load_config(None, ["model.student_path=tiny-org/Tiny-LM"])
    resolve_config_models(cfg)
    use_cache(monkeypatch, tmp_path / "empty_hub")
    actor = ray_actor_worker_class()(
        cfg, 0, 1, "127.0.0.1", 1, actor_kinds(cfg)
    )  # port 1: nothing may connect before the check
    with pytest.raises(ConfigError) as info:
        actor.setup()
    assert info.value.key == "model.student_path" and "hf download tiny-org/Tiny-LM" in str(info.value)
