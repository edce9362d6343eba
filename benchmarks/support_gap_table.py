"""What each support costs and buys: its gap to the exact full-vocabulary divergence, its wire bytes,
the teacher's scoring time and the actor's loss time, per scored token.

    python benchmarks/support_gap_table.py [--quick]

Two student/teacher pairs: the CPU demo's (assets/demo, a 102-token character vocabulary) and a random Llama pair with a
real-size vocabulary (V=32000, H=128, built offline in a temporary directory; the teacher's head is
scaled so that its logits spread like a trained model's, a few nats of entropy, and the student is the
teacher with every weight perturbed). The student samples its own responses (temperature 1, no top-k
or top-p); on them, for forward_kl, reverse_kl and jsd (beta 0.5), each support's per-token divergence
from the library's own losses (recipe_gkd.losses, fed by the hf teacher backend in-process exactly as
the actor is) is compared with the exact divergence computed here in float64 from the two full logit
tensors (the teacher's from transformers directly, not from the backend):

- teacher top-8 + tail and top-64 + tail (algorithm.support=teacher_topk, teacher.top_k=K),
- union, K=8 and k_s=8 (algorithm.support=union, rollout.student_top_k=8),
- full vocabulary from the teacher's bf16 final hidden states (teacher.output=hidden).

Costs per scored token: request and reply bytes on the wire (teacher_server.wire.protocol's encoders; the
default float16 + elias_fano wire, bf16 hidden states), the hf backend's scoring time in-process, and
the actor's loss step alone (forward + backward of the loss function on fixed student logits).
torch runs on one thread. Prints markdown tables and writes benchmarks/results/support_gap_table.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from recipe_gkd.actor.teacher_head import find_teacher_head, load_teacher_head_shard
from recipe_gkd.data import encode_prompt
from recipe_gkd.losses import gkd_loss_sum, hidden_gkd_loss_sum
from recipe_gkd.targets.union import union_scores
from teacher_server.server.backends import BackendOptions, load_backend, parsed_request
from teacher_server.wire.score_frames import reply_frames, request_frames
from teacher_server.wire.scores import TopKBatch

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "assets" / "demo"
RESULTS = REPO / "benchmarks" / "results" / "support_gap_table.json"
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
BETA = 0.5
WIRE = {"logprob_dtype": "float16", "id_encoding": "elias_fano"}
HIDDEN_DTYPE = "bfloat16"
K_S = 8
# (mode name, teacher top-k, named student ids k_s, hidden states)
MODES: tuple[tuple[str, int, int, bool], ...] = (
    ("teacher top-8 + tail", 8, 0, False),
    ("teacher top-64 + tail", 64, 0, False),
    (f"union, K=8, k_s={K_S}", 8, K_S, False),
    ("full vocabulary (hidden, bf16)", 0, 0, True),
)
BIG_VOCAB, BIG_HIDDEN, BIG_LOGIT_STD, BIG_STUDENT_NOISE = 32000, 128, 4.0, 0.3


@dataclass
class Sample:
    """The student's sampled sequences and the full logits of both models at their scored positions."""

    sequences: list[np.ndarray]
    score_from: list[int]
    student_NV: torch.Tensor  # float32, the student's logits at every scored position
    teacher_NV: torch.Tensor  # float32, the teacher's (transformers forward, not the backend)


def build_big_pair(out: Path) -> tuple[Path, Path]:
    """A random teacher with V=32000 whose logits spread ~BIG_LOGIT_STD, and a perturbed copy as the student."""
    config = LlamaConfig(
        vocab_size=BIG_VOCAB,
        hidden_size=BIG_HIDDEN,
        intermediate_size=2 * BIG_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(config)
    with torch.no_grad():
        head = teacher.lm_head.weight
        head.mul_(BIG_LOGIT_STD / (head.std() * BIG_HIDDEN**0.5))  # RMS-normed hidden: logit std ~ BIG_LOGIT_STD
    teacher.save_pretrained(str(out / "teacher"))
    torch.manual_seed(1)
    with torch.no_grad():
        for param in teacher.parameters():
            param.add_(torch.randn_like(param) * BIG_STUDENT_NOISE * param.std().clamp(min=1e-3))
    teacher.save_pretrained(str(out / "student"))
    return out / "teacher", out / "student"


def sample(student_dir: Path, teacher_dir: Path, prompts: list[list[int]], max_new: int, seed: int) -> Sample:
    """The student's own responses (temperature 1, full vocabulary) and both models' full logits on them."""
    student = AutoModelForCausalLM.from_pretrained(str(student_dir), dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32).eval()
    eos = student.config.eos_token_id
    torch.manual_seed(seed)
    sequences, starts, s_rows, t_rows = [], [], [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = student.generate(
                ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new, pad_token_id=0
            )[0]
            response = out[len(prompt) :].tolist()
            if eos in response:
                response = response[: response.index(eos) + 1]
            seq = np.asarray(prompt + response, dtype=np.int32)
            full = torch.from_numpy(seq.astype(np.int64))[None]
            start = len(prompt)
            s_rows.append(student(full).logits[0, start - 1 : seq.size - 1].float())
            t_rows.append(teacher(full).logits[0, start - 1 : seq.size - 1].float())
            sequences.append(seq)
            starts.append(start)
    return Sample(sequences, starts, torch.cat(s_rows), torch.cat(t_rows))


def exact(student_NV: torch.Tensor, teacher_NV: torch.Tensor, divergence: str) -> float:
    """Mean per-token divergence over the whole vocabulary, in float64 (TRL's generalized JSD convention)."""
    log_q = torch.log_softmax(student_NV.double(), -1)
    log_p = torch.log_softmax(teacher_NV.double(), -1)

    def kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a.exp() * (a - b)).sum(-1)

    if divergence == "forward_kl":
        per_token = kl(log_p, log_q)
    elif divergence == "reverse_kl":
        per_token = kl(log_q, log_p)
    else:
        log_m = torch.logaddexp(log_p + np.log(BETA), log_q + np.log(1 - BETA))
        per_token = BETA * kl(log_p, log_m) + (1 - BETA) * kl(log_q, log_m)
    return float(per_token.mean())


def score_request(s: Sample, top_k: int, named: bool, hidden: bool) -> tuple[object, list[np.ndarray] | None]:
    """The request the rollout worker sends for a mode (named ids: the student's top-k_s at each position)."""
    named_ids = None
    if named:
        top_NS = torch.topk(s.student_NV, K_S, dim=-1).indices.numpy().astype(np.int32)
        named_ids = np.split(
            top_NS, np.cumsum([q.size - f for q, f in zip(s.sequences, s.score_from, strict=True)])[:-1]
        )
    req = parsed_request(
        s.sequences, s.score_from, top_k=top_k, named_ids=named_ids, hidden_dtype=HIDDEN_DTYPE if hidden else ""
    )
    return req, named_ids


def loss_fn(
    s: Sample, reply: TopKBatch, named_ids: list[np.ndarray] | None, head_VH: torch.Tensor | None, divergence: str
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The actor's loss for a mode, as a function of the student's logits [1, N, V]."""
    n = reply.topk_ids.shape[0]
    mask = torch.ones(1, n)
    if head_VH is not None:
        hidden = torch.from_numpy(reply.hidden_states)[None]
        return lambda logits: hidden_gkd_loss_sum(logits, hidden, head_VH, mask, divergence=divergence, beta=BETA)
    if named_ids is not None:
        parts = [union_scores(r, ids) for r, ids in zip(reply.split(), named_ids, strict=True)]
        logprobs = np.concatenate([p.topk_logprobs for p in parts])
        ids = np.concatenate([p.topk_ids for p in parts])
        tail = np.concatenate([p.tail_logmass for p in parts])
    else:
        logprobs, ids, tail = reply.topk_logprobs, reply.topk_ids, reply.tail_logmass
    lp = torch.from_numpy(logprobs.astype(np.float32))[None]
    idx = torch.from_numpy(ids.astype(np.int64))[None]
    tl = torch.from_numpy(tail.astype(np.float32))[None]
    return lambda logits: gkd_loss_sum(
        logits, lp, idx, mask, divergence=divergence, beta=BETA, tail=True, teacher_tail_logmass=tl
    )


def median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_pair(name: str, teacher_dir: Path, student_dir: Path, s: Sample, repeats: int) -> dict:
    """Gaps and costs of every mode on one pair."""
    vocab = s.student_NV.shape[-1]
    n = s.student_NV.shape[0]
    backend = load_backend("hf", BackendOptions(model_path=str(teacher_dir), max_top_k=64, dtype="float32"))
    log_p = torch.log_softmax(s.teacher_NV.double(), -1)
    top8 = torch.topk(log_p, 8, -1).values.exp().sum(-1)
    top64 = torch.topk(log_p, 64, -1).values.exp().sum(-1)
    stats = {
        "pair": name,
        "vocab": vocab,
        "scored_tokens": n,
        "sequences": len(s.sequences),
        "teacher_entropy_nats": float(-(log_p.exp() * log_p).sum(-1).mean()),
        "teacher_top8_mass": float(top8.mean()),
        "teacher_top64_mass": min(1.0, float(top64.mean())),
        "exact": {d: exact(s.student_NV, s.teacher_NV, d) for d in DIVERGENCES},
        "modes": [],
    }
    for mode, top_k, k_s, hidden in MODES:
        req, named_ids = score_request(s, min(top_k, vocab), k_s > 0, hidden)
        reply = backend.score(req)
        score_s = median_s(lambda req=req: backend.score(req), repeats)
        request = request_frames(
            1, s.sequences, s.score_from, top_k=req.top_k, temperature=1.0, named_ids=named_ids,
            hidden_dtype=req.hidden_dtype, **WIRE,
        )  # fmt: skip
        frames = reply_frames(1, reply, vocab_size=vocab, hidden_dtype=req.hidden_dtype, **WIRE)
        head = None
        if hidden:
            ref = find_teacher_head(str(teacher_dir), vocab)
            head = load_teacher_head_shard(ref, 0, vocab, torch.float32, torch.device("cpu"))
        row = {
            "mode": mode,
            "request_bytes_per_token": sum(len(f) for f in request) / n,
            "reply_bytes_per_token": sum(len(f) for f in frames) / n,
            "teacher_us_per_token": 1e6 * score_s / n,
            "divergence": {},
            "actor_loss_us_per_token": {},
        }
        for divergence in DIVERGENCES:
            fn = loss_fn(s, reply, named_ids, head, divergence)
            logits = s.student_NV.clone()[None].requires_grad_(True)
            with torch.no_grad():
                loss_sum, count = fn(logits)
            row["divergence"][divergence] = float(loss_sum) / int(count)

            def step(fn=fn, logits=logits) -> None:
                loss_sum, count = fn(logits)
                (loss_sum / count).backward()
                logits.grad = None

            row["actor_loss_us_per_token"][divergence] = 1e6 * median_s(step, repeats) / n
        stats["modes"].append(row)
        print(f"  {name}: {mode} done", flush=True)
    return stats


def demo_prompts(count: int) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO / "student"))
    records = [json.loads(line) for line in (DEMO / "data" / "eval.jsonl").read_text().splitlines()[:count]]
    return [encode_prompt(tokenizer, r, "prompt", True) for r in records]


def print_tables(pairs: list[dict]) -> None:
    for p in pairs:
        print(
            f"\n{p['pair']} (V={p['vocab']}, {p['scored_tokens']} scored tokens in {p['sequences']} student samples; "
            f"teacher entropy {p['teacher_entropy_nats']:.2f} nats, top-8 mass {p['teacher_top8_mass']:.3f}, "
            f"top-64 mass {p['teacher_top64_mass']:.3f})\n"
        )
        print("| support | " + " | ".join(f"{d} (gap)" for d in DIVERGENCES) + " |\n|---|---|---|---|")
        print("| exact, float64 full logits | " + " | ".join(f"{p['exact'][d]:.4f}" for d in DIVERGENCES) + " |")
        for m in p["modes"]:
            cells = []
            for d in DIVERGENCES:
                gap = m["divergence"][d] - p["exact"][d]
                cells.append(f"{m['divergence'][d]:.4f} ({gap:+.4f}, {100 * gap / p['exact'][d]:+.1f}%)")
            print(f"| {m['mode']} | " + " | ".join(cells) + " |")
        print(
            "\n| support | request B/token | reply B/token | teacher µs/token | actor loss fwd+bwd µs/token "
            "(fkl / rkl / jsd) |\n|---|---|---|---|---|"
        )
        for m in p["modes"]:
            actor = " / ".join(f"{m['actor_loss_us_per_token'][d]:.1f}" for d in DIVERGENCES)
            print(
                f"| {m['mode']} | {m['request_bytes_per_token']:.1f} | {m['reply_bytes_per_token']:.1f} | "
                f"{m['teacher_us_per_token']:.1f} | {actor} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples and repeats (a smoke run)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    repeats = 2 if args.quick else 5
    started = time.monotonic()
    pairs = []
    demo = sample(DEMO / "student", DEMO / "teacher", demo_prompts(8 if args.quick else 64), 16, seed=0)
    pairs.append(measure_pair("CPU demo (assets/demo)", DEMO / "teacher", DEMO / "student", demo, repeats))
    with tempfile.TemporaryDirectory() as tmp:
        teacher_dir, student_dir = build_big_pair(Path(tmp))
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, BIG_VOCAB, size=32).tolist() for _ in range(2 if args.quick else 8)]
        big = sample(student_dir, teacher_dir, prompts, 64, seed=0)
        pairs.append(measure_pair(f"random Llama pair, V={BIG_VOCAB}", teacher_dir, student_dir, big, repeats))
    print_tables(pairs)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": platform.processor() or platform.machine(),
        "torch_threads": 1,
        "wire": {**WIRE, "hidden_dtype": HIDDEN_DTYPE},
        "wall_s": time.monotonic() - started,
        "pairs": pairs,
    }
    RESULTS.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {RESULTS} ({payload['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
