"""In-process on-policy GKD on the demo assets (no Ray, no servers): calibrates the CPU demo.

    python benchmarks/bench_demo_distill.py [--assets assets/demo] [--steps 120] [--seeds 0]

Each step: the student samples responses to a batch of train prompts (temperature 1), the
teacher scores them (top-k log-probs of the full-vocabulary softmax), the student takes one
AdamW step on gkd_loss(top-k + tail). Held-out greedy exact match is measured before, every
`--eval-every` steps and after. Prints a table and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from recipe_gkd.demo.evaluate import accuracy_on
from recipe_gkd.demo.sft import encode_prompt
from recipe_gkd.demo.task import Example, read_jsonl
from recipe_gkd.losses import gkd_loss
from recipe_gkd.rollout.hf import left_pad, plain_generation_config, without_model_generation_defaults

RESULTS = Path("benchmarks/results/demo_distill.json")


@dataclass(frozen=True)
class DistillConfig:
    steps: int = 120
    batch_size: int = 64
    lr: float = 3e-3
    clip_grad: float = 1.0
    top_k: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 16
    divergence: str = "forward_kl"
    eval_every: int = 20
    threads: int = 1
    seed: int = 0


def _response_mask(new_BN: Tensor, eos_id: int) -> Tensor:
    """1 on each response token up to and including its first EOS."""
    is_eos_BN = (new_BN == eos_id).long()
    eos_before_BN = is_eos_BN.cumsum(-1) - is_eos_BN  # EOS strictly before this position
    return (eos_before_BN == 0).long()


def on_policy_step(
    student: Any, teacher: Any, tokenizer: Any, prompts: list[str], cfg: DistillConfig, timings: dict[str, float]
) -> float:
    """Sample, score with the teacher's top-k, and return the GKD loss (backward done).

    Adds each phase's seconds to `timings` (generate_s, teacher_s, train_s: forward + backward).
    """
    start = time.perf_counter()
    ids_BP, prompt_mask_BP = left_pad([encode_prompt(tokenizer, p) for p in prompts], tokenizer.pad_token_id)
    width = ids_BP.shape[1]
    with torch.no_grad():
        student.eval()
        config = plain_generation_config(
            tokenizer, greedy=False, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=0, top_p=1.0
        )
        with without_model_generation_defaults(student):
            seq_BS = student.generate(input_ids=ids_BP, attention_mask=prompt_mask_BP, generation_config=config)
    timings["generate_s"] = time.perf_counter() - start
    start = time.perf_counter()
    mask_BS = torch.cat([prompt_mask_BP, _response_mask(seq_BS[:, width:], tokenizer.eos_token_id)], dim=1)
    positions_BS = (mask_BS.cumsum(-1) - 1).clamp(min=0)
    # Logits at position t predict token t + 1: the loss covers the predictions of response tokens.
    loss_mask_BT = mask_BS[:, 1:].clone()
    loss_mask_BT[:, : width - 1] = 0
    with torch.no_grad():
        teacher_logits_BTV = teacher(input_ids=seq_BS, attention_mask=mask_BS, position_ids=positions_BS).logits[:, :-1]
        teacher_full_BTV = torch.log_softmax(teacher_logits_BTV.float(), -1)
        teacher_logprobs_BTK, teacher_ids_BTK = teacher_full_BTV.topk(cfg.top_k, -1)
        teacher_tail_BT = teacher_full_BTV.scatter(-1, teacher_ids_BTK, -math.inf).logsumexp(-1)
    timings["teacher_s"] = time.perf_counter() - start
    start = time.perf_counter()
    student.train()
    student_logits_BTV = student(input_ids=seq_BS, attention_mask=mask_BS, position_ids=positions_BS).logits[:, :-1]
    loss = gkd_loss(
        student_logits_BTV,
        teacher_logprobs_BTK,
        teacher_ids_BTK,
        loss_mask_BT.float(),
        divergence=cfg.divergence,
        temperature=1.0,
        tail=True,
        teacher_tail_logmass=teacher_tail_BT,
    )
    loss.backward()
    timings["train_s"] = time.perf_counter() - start
    return loss.item()


def distill(assets: Path, cfg: DistillConfig) -> dict[str, Any]:
    """Run on-policy GKD from the demo student; returns accuracies, losses and timings."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(assets / "student"))
    student = AutoModelForCausalLM.from_pretrained(str(assets / "student"), dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(str(assets / "teacher"), dtype=torch.float32).eval()
    train: list[Example] = read_jsonl(assets / "data/train.jsonl")
    held_out: list[Example] = read_jsonl(assets / "data/eval.jsonl")
    optimizer = torch.optim.AdamW(student.parameters(), lr=cfg.lr, weight_decay=0.0)
    curve = [{"step": 0, "accuracy": accuracy_on(student, tokenizer, held_out), "train_seconds": 0.0}]
    losses: list[float] = []
    phases: list[dict[str, float]] = []
    train_seconds = 0.0
    for step in range(1, cfg.steps + 1):
        t = time.perf_counter()
        timings: dict[str, float] = {}
        optimizer.zero_grad(set_to_none=True)
        prompts = [e.prompt for e in rng.sample(train, cfg.batch_size)]
        losses.append(on_policy_step(student, teacher, tokenizer, prompts, cfg, timings))
        update = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.clip_grad)
        optimizer.step()
        timings["train_s"] += time.perf_counter() - update
        timings["step_s"] = time.perf_counter() - t
        phases.append(timings)
        train_seconds += timings["step_s"]
        if step % cfg.eval_every == 0 or step == cfg.steps:
            accuracy = accuracy_on(student, tokenizer, held_out)
            curve.append({"step": step, "accuracy": accuracy, "loss": losses[-1], "train_seconds": train_seconds})
            print(f"  seed {cfg.seed} step {step:4d} loss {losses[-1]:.4f} accuracy {accuracy:.1%}", flush=True)
    return {
        "config": asdict(cfg),
        "before": curve[0]["accuracy"],
        "after": curve[-1]["accuracy"],
        "curve": curve,
        "losses": losses,
        "phases": phases,
        "train_seconds": round(train_seconds, 2),
        "seconds_per_step": round(train_seconds / cfg.steps, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--assets", type=Path, default=Path("assets/demo"))
    parser.add_argument("--steps", type=int, default=DistillConfig.steps)
    parser.add_argument("--lr", type=float, default=DistillConfig.lr)
    parser.add_argument("--divergence", default=DistillConfig.divergence)
    parser.add_argument("--eval-every", type=int, default=DistillConfig.eval_every)
    parser.add_argument("--threads", type=int, default=DistillConfig.threads)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    runs = []
    for seed in args.seeds:
        cfg = DistillConfig(
            steps=args.steps,
            lr=args.lr,
            divergence=args.divergence,
            eval_every=args.eval_every,
            threads=args.threads,
            seed=seed,
        )
        runs.append(distill(args.assets, cfg))
    print(f"\n{'seed':>4} {'before':>7} {'after':>7} {'gain':>6} {'train s':>8} {'s/step':>7}")
    for run in runs:
        gain = run["after"] - run["before"]
        seed = run["config"]["seed"]
        print(
            f"{seed:>4} {run['before']:>7.1%} {run['after']:>7.1%} {gain * 100:>+6.1f} "
            f"{run['train_seconds']:>8.1f} {run['seconds_per_step']:>7.3f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"assets": str(args.assets), "runs": runs}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
