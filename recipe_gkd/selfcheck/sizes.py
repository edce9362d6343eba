"""Stage 0's sizes: the real ones on a GPU (Qwen3-0.6B's shape, V=151936), a CPU rehearsal, a tiny case for the suite."""

from __future__ import annotations

from dataclasses import dataclass

from recipe_gkd.offline_models import TinyModelSpec

# Qwen3-0.6B's config.json (hidden 1024, 28 layers, 16 query / 8 key-value heads of 128, vocabulary 151936, tied).
QWEN3_0_6B = TinyModelSpec(1024, 3072, 28, 16, 8, 40960, True, vocab_size=151936, head_dim=128, save_dtype="bfloat16")


@dataclass(frozen=True)
class Sizes:
    """Every size stage 0 runs at; one set per mode, chosen once."""

    name: str
    device: str  # cuda or cpu: cluster.device of the actor and the loop, the loss tensors' device
    student: TinyModelSpec  # the random model the actor, the rollout engine and the teacher load
    batch: int  # sequences of one actor step
    prompt_len: int
    response_len: int
    micro_tokens: int  # actor.max_tokens_per_micro_batch
    loss_vocab: int
    loss_tokens: tuple[int, ...]
    top_k: int
    loop_steps: int
    loop_batch: int
    loop_new_tokens: int
    learn_steps: int  # the learning checks' steps (the CPU presets' own 150 on a GPU)
    learn_eval_records: int  # held-out records evaluated before the first step and after the last
    learn_min_gain: float  # the held-out accuracy's least gain for a learning check to pass
    # The learning checks' seconds here against their GPU estimates: they run the presets' own models and steps, so
    # the stage's smaller sizes do not shorten them (2 CPU cores: learn_tools 216 s, estimated 200 s on a GPU).
    learn_estimate_scale: float
    estimate_scale: float  # the checks' seconds here against one H100's at the GPU sizes (the budget's estimates)


GPU = Sizes(
    name="gpu",
    device="cuda",
    student=QWEN3_0_6B,
    batch=8,
    prompt_len=256,
    response_len=768,
    micro_tokens=4096,
    loss_vocab=151936,
    loss_tokens=(6144, 32768),
    top_k=64,
    loop_steps=3,
    loop_batch=16,
    loop_new_tokens=128,
    # The presets' runs as shipped: 150 steps took the demo 30% -> 82% and the tool demo 8% -> 49-56% on a CPU.
    learn_steps=150,
    learn_eval_records=200,
    learn_min_gain=0.2,
    learn_estimate_scale=1.0,
    estimate_scale=1.0,
)
# The rehearsal on a CPU: every code path of the GPU run, at sizes two cores finish in about a minute; the learning
# checks (the presets' full 150 steps) add about 4.5 minutes.
CPU = Sizes(
    name="cpu",
    device="cpu",
    student=TinyModelSpec(128, 256, 2, 4, 2, 512, True, vocab_size=4096, head_dim=32),
    batch=4,
    prompt_len=32,
    response_len=32,
    micro_tokens=128,
    loss_vocab=32768,
    loss_tokens=(512, 1024),
    top_k=64,
    loop_steps=2,
    loop_batch=4,
    loop_new_tokens=8,
    learn_steps=150,
    learn_eval_records=200,
    learn_min_gain=0.2,
    learn_estimate_scale=1.1,
    estimate_scale=0.25,
)
# The suite's case: the same code at the smallest sizes that still have a vocabulary wider than the top-k.
TINY = Sizes(
    name="tiny",
    device="cpu",
    student=TinyModelSpec(64, 128, 2, 4, 2, 256, True, vocab_size=512, head_dim=16),
    batch=2,
    prompt_len=16,
    response_len=16,
    micro_tokens=64,
    loss_vocab=2048,
    loss_tokens=(64,),
    top_k=16,
    loop_steps=2,
    loop_batch=2,
    loop_new_tokens=4,
    # Two steps say the path runs, not that it learns: no gain asked for.
    learn_steps=2,
    learn_eval_records=8,
    learn_min_gain=-1.0,
    learn_estimate_scale=0.05,
    estimate_scale=0.02,
)
SIZES = {s.name: s for s in (GPU, CPU, TINY)}
