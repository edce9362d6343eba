"""The memory plan's actor estimate against the measured peak of a real megatron step (CPU, one rank).

    .venv/bin/python benchmarks/bench_actor_memory.py [--hidden 256 --layers 4 --vocab 8192]

Builds a random Llama-family student offline, runs MegatronActor (TP=1, gloo, in this process)
for two steps per setting and measures the second step (Adam's state exists by then) with
a dispatch-mode tracker of live tensor storages (the step's activations, logits and
temporaries) on top of what lives between steps (weights, gradient buffer, optimizer state). The plan's estimate for the same config
(recipe_gkd.plan.memory_plan.actor_memory, minus its fixed CUDA reserve, which a CPU has not) is
printed beside it. Writes benchmarks/results/bench_actor_memory.json.

On CPU the activations of the compute dtype are what a GPU holds too; CUDA adds its context,
kernels' workspaces and allocator fragmentation, which the plan's fixed reserve covers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recipe_gkd.config import load_config  # noqa: E402
from recipe_gkd.plan.memory_plan import ACTOR_RESERVE_GIB, GIB, actor_memory, read_shape  # noqa: E402
from recipe_gkd.plan.ports import reserve_ports  # noqa: E402
from recipe_gkd.targets import actor_kinds  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_actor_memory.json"
MIB = 1024 * 1024
# (label, overrides): the settings whose memory differs.
SETTINGS = [
    ("fp32, sdpa, no recompute", ["actor.precision=fp32"]),
    ("fp32, unfused attention", ["actor.precision=fp32", "actor.megatron.attention=unfused"]),
    ("fp32, selective recompute", ["actor.precision=fp32", "actor.megatron.recompute=selective"]),
    ("fp32, full recompute", ["actor.precision=fp32", "actor.megatron.recompute=full"]),
    ("bf16, sdpa, no recompute", ["actor.precision=bf16"]),
    ("bf16, full recompute", ["actor.precision=bf16", "actor.megatron.recompute=full"]),
]


def build_student(root: Path, hidden: int, layers: int, vocab: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 64,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    LlamaForCausalLM(config).save_pretrained(root / "student")
    return root / "student"


def measure(student: Path, overrides: list[str], seq_len: int, micro_batch: int) -> dict[str, Any]:
    from recipe_gkd.actor.megatron_actor import MegatronActor
    from recipe_gkd.batch import TrainShard

    prompt = 16
    cfg = load_config(
        None,
        [
            f"model.student_path={student}",
            f"actor.micro_batch_size={micro_batch}",
            f"data.train_batch_size={micro_batch}",
            f"data.max_prompt_length={prompt}",
            f"rollout.sampling.max_new_tokens={seq_len - prompt}",
            "actor.megatron.distributed_optimizer=false",
            *overrides,
        ],
    )
    actor = MegatronActor(cfg, 0, 1, "127.0.0.1", reserve_ports(1)[0], actor_kinds(cfg))
    actor.setup()
    vocab = actor.arch.vocab_size
    # Every sequence at the configured full length (the plan's worst case).
    sequences = [full_length_sequence(i, seq_len, prompt, vocab, cfg.teacher.top_k) for i in range(micro_batch)]
    shard = [TrainShard(step=0, weight_version=0, sequences=sequences)]
    actor.train_step(shard)  # Adam's moments exist from here on
    static = static_bytes(actor)
    with LiveTensorBytes() as tracker:  # tensors created during the step: activations, logits, temporaries
        actor.train_step(shard)
    step_peak = tracker.peak
    actor.shutdown()
    plan = actor_memory(cfg, read_shape(str(student), "model.student_path", []))  # type: ignore[arg-type]
    estimate = plan.total - ACTOR_RESERVE_GIB * GIB
    measured = sum(static.values()) + step_peak
    return {
        "measured_mib": measured / MIB,
        "measured_parts_mib": {**{k: v / MIB for k, v in static.items()}, "step peak above that": step_peak / MIB},
        "estimate_mib": estimate / MIB,
        "estimate_parts_mib": {name: b / MIB for name, b in plan.parts[:-1]},
        "ratio": estimate / measured,
    }


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages created under it and still alive, and their peak (CPU tensors).

    Every op's outputs are seen at the dispatcher (forward and backward); a storage is counted
    once, from its creation until it is freed (a weakref finalizer on the storage).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._ptrs: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._ptrs.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        import torch
        from torch.utils._pytree import tree_leaves

        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                storage = tensor.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self._ptrs:
                    self._ptrs.add(key)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, nbytes)
        return out


def static_bytes(actor: Any) -> dict[str, float]:
    """Bytes held between steps, by kind, each storage counted once: params, grad buffers, optimizer state."""
    import torch

    seen: set[int] = set()

    def total(tensors: list[Any]) -> float:
        count = 0
        for t in tensors:
            if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                count += t.untyped_storage().nbytes()
        return float(count)

    params = list(actor.gpt.parameters())
    leaves = list(getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]))
    state = [t for leaf in leaves for s in leaf.optimizer.state.values() for t in s.values()]
    masters = [p for leaf in leaves for g in leaf.optimizer.param_groups for p in g["params"]]
    return {
        "weights": total(params),
        "gradient buffer": total([getattr(p, "main_grad", None) for p in params]),
        "optimizer state": total(state) + total(masters),
    }


def full_length_sequence(sample_id: int, length: int, prompt: int, vocab: int, top_k: int) -> Any:
    """A prompt + response of `length` tokens with a random teacher's top-k (sorted) and tail."""
    import numpy as np

    from recipe_gkd.batch import ScoredSequence

    rng = np.random.default_rng(sample_id)
    responses = length - prompt
    probs = rng.dirichlet(np.ones(top_k) * 0.3, size=responses) * 0.9
    return ScoredSequence(
        sample_id=sample_id,
        input_ids=rng.integers(0, vocab, length).astype(np.int32),
        response_start=prompt,
        on_policy=True,
        teacher_topk_logprobs=np.log(np.sort(probs, axis=1)[:, ::-1] + 1e-9).astype(np.float32),
        teacher_topk_ids=np.stack([rng.choice(vocab, top_k, replace=False) for _ in range(responses)]).astype(np.int32),
        teacher_tail_logmass=np.full(responses, np.log(0.1), dtype=np.float32),
        teacher_sampled_logprob=np.full(responses, -1.0, dtype=np.float32),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        student = build_student(Path(tmp), args.hidden, args.layers, args.vocab)
        for label, overrides in SETTINGS:
            result = measure(student, overrides, args.seq_len, args.micro_batch)
            rows.append({"setting": label, **result})
            print(
                f"{label:<28} measured {result['measured_mib']:8.1f} MiB  estimate {result['estimate_mib']:8.1f} MiB"
                f"  estimate/measured {result['ratio']:.2f}",
                flush=True,
            )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
