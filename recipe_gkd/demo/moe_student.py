"""Build the MoE demo's student offline and deterministically: the demo student upcycled to a Qwen3-MoE
(configs/presets/cpu_moe.yaml's model.student_path).

    python -m recipe_gkd.demo.moe_student [--out assets/moe] [--force]

1. Upcycle assets/demo/student (a Llama; its bytes are part of the recipe) into a transformers
   Qwen3MoeForCausalLM of its shape: embeddings, attention and norms copied; in every layer MOE.num_experts
   experts, each the layer's dense MLP plus a seeded perturbation (so the experts differ), and a seeded random
   router; Qwen3's per-head q/k RMSNorm, which Llama lacks, at its initial weight 1.
2. Warm it up with the project's SFT loop on the demo's training split until its dev accuracy reaches the dense
   student's warm-up target: the q/k norms change the attention (the upcycled model starts near 0%), and the
   warm-up stops where the dense student starts, well below the teacher. Saved in bfloat16 (SAVE_DTYPE), the dense
   student's tokenizer files copied.
3. Check the router on the demo's held-out records: no exact tie of its top-k choice anywhere, and how close the
   closest choice is (its gap, and its ratio to the float32 rounding bound of the two logits).
4. Evaluate the student, the dense student and the teacher on assets/demo/data/eval.jsonl and write
   `manifest.json` (recipe, accuracies, the router's smallest top-k gap and per-expert load, seconds, the sha256 of
   every file).

A second run with a complete manifest whose recipe matches does nothing (unless --force). Same determinism as
recipe_gkd.demo.build_assets (fixed seeds, deterministic torch algorithms, one thread): a rebuild on the same
machine and torch version gives the same bytes.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from recipe_gkd.demo import task
from recipe_gkd.demo.build_assets import (
    BUILD_THREADS,
    DEMO,
    STUDENT_TARGET_DEV_ACCURACY,
    Laps,
    asset_command,
    build_unless_current,
    count_params,
    load_model,
    recipe_manifest_problem,
    sha256_file,
)
from recipe_gkd.demo.evaluate import EVAL_BATCH_SIZE, accuracy_on, greedy_accuracy
from recipe_gkd.demo.sft import SFTConfig, collate, encode_example, sft_train

DEFAULT_OUT = Path("assets/moe")
MANIFEST = "manifest.json"
BUILD_VERSION = 1
INIT_FROM = Path("assets/demo/student")
TEACHER = Path("assets/demo/teacher")
EVAL_FILE = Path("assets/demo/data/eval.jsonl")
# The dense student's files the MoE student keeps as they are (its model files are written by save_pretrained).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
REQUIRED_FILES = ("student/model.safetensors", "student/config.json", "student/tokenizer.json")
# float32's unit roundoff: a dot product of length n is off by at most n*u/(1-n*u) of the sum of |terms| (Higham).
FP32_UNIT_ROUNDOFF = 2.0**-24
# The saved weights' dtype: half the bytes of float32 (1.0 MiB, not 2.0). Every reader (the rollout, the actor at
# precision fp32, the evaluation) loads them into float32 exactly; the manifest's figures are the saved weights'.
SAVE_DTYPE = "bfloat16"


@dataclass(frozen=True)
class MoESpec:
    """The experts of every layer (the rest of the shape is the dense student's)."""

    num_experts: int = 4
    experts_per_token: int = 2
    moe_intermediate_size: int = 192  # the dense MLP's width: each expert starts as a copy of it
    norm_topk_prob: bool = True


@dataclass(frozen=True)
class Upcycle:
    """How the dense student's weights become the MoE's."""

    seed: int = 3
    # Each expert's tensors: the dense MLP's plus N(0, (expert_noise x that tensor's std)^2). Small: the model stays
    # the dense one (the chosen experts' weights sum to 1), the experts differ enough for the router to matter.
    expert_noise: float = 0.02
    # The router's weights: N(0, (router_scale / sqrt(hidden))^2), its logits about router_scale apart (its input
    # is RMS-normalised): distinct choices from the first step. (A gap's ratio to its float32 rounding does not
    # depend on the scale; router_stats measures it.)
    router_scale: float = 1.0
    # Qwen3's per-head q/k RMSNorm (Llama has none) starts at its own initial weight.
    qk_norm_weight: float = 1.0


MOE = MoESpec()
UPCYCLE = Upcycle()
# lr 1e-3, a third of the dense student's from-scratch warm-up: the embeddings and MLPs are trained already.
SFT = SFTConfig(steps=400, batch_size=128, lr=1e-3, warmup_steps=10, seed=2)
CHECK_FROM_STEP = 4
CHECK_EVERY = 2


def recipe() -> dict[str, Any]:
    """Everything the student's bytes depend on besides torch (the dense student by its sha256)."""
    return {
        "build_version": BUILD_VERSION,
        "threads": BUILD_THREADS,
        "init_from": {"path": str(INIT_FROM), "sha256": sha256_file(INIT_FROM / "model.safetensors")},
        "moe": asdict(MOE),
        "upcycle": asdict(UPCYCLE),
        "sft": asdict(SFT),
        "save_dtype": SAVE_DTYPE,
        "stop": {
            "target_dev_accuracy": STUDENT_TARGET_DEV_ACCURACY,
            "check_from_step": CHECK_FROM_STEP,
            "check_every": CHECK_EVERY,
        },
        "task": DEMO.describe(),
    }


def manifest_problem(out: Path) -> str | None:
    """Why `out` does not hold a complete student of the current recipe (None when it does)."""
    return recipe_manifest_problem(out, recipe(), REQUIRED_FILES)


def moe_config(dense_config: Any, moe: MoESpec = MOE) -> Any:
    """A Qwen3MoeConfig of the dense (Llama) config's shape, tokens and RoPE, with `moe`'s experts in every layer."""
    from transformers import Qwen3MoeConfig

    d = dense_config
    return Qwen3MoeConfig(
        vocab_size=d.vocab_size,
        hidden_size=d.hidden_size,
        intermediate_size=d.intermediate_size,
        num_hidden_layers=d.num_hidden_layers,
        num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads,
        head_dim=d.head_dim,
        hidden_act=d.hidden_act,
        max_position_embeddings=d.max_position_embeddings,
        initializer_range=d.initializer_range,
        rms_norm_eps=d.rms_norm_eps,
        rope_parameters=dict(d.rope_parameters),
        attention_bias=d.attention_bias,
        tie_word_embeddings=d.tie_word_embeddings,
        bos_token_id=d.bos_token_id,
        eos_token_id=d.eos_token_id,
        pad_token_id=d.pad_token_id,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.experts_per_token,
        moe_intermediate_size=moe.moe_intermediate_size,
        norm_topk_prob=moe.norm_topk_prob,
    )


def upcycle(dense: torch.nn.Module, moe: MoESpec = MOE, how: Upcycle = UPCYCLE) -> torch.nn.Module:
    """A Qwen3MoeForCausalLM (float32) from `dense`, a LlamaForCausalLM: every tensor set from it or `how`'s seed."""
    from transformers import Qwen3MoeForCausalLM

    if moe.moe_intermediate_size != dense.config.intermediate_size:
        raise ValueError(
            f"moe_intermediate_size {moe.moe_intermediate_size} != the dense MLP's {dense.config.intermediate_size}"
        )
    torch.manual_seed(how.seed)  # construction's own initialisation (all overwritten below)
    model = Qwen3MoeForCausalLM(moe_config(dense.config, moe)).float()
    generator = torch.Generator().manual_seed(how.seed)
    source = dense.state_dict()
    target = model.state_dict()
    set_names = {name for name in target if name in source}
    hidden = dense.config.hidden_size

    def perturbed(tensor: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        return tensor + how.expert_noise * tensor.std() * noise

    with torch.no_grad():
        for name in set_names:
            target[name].copy_(source[name])
        for i, layer in enumerate(model.model.layers):
            prefix = f"model.layers.{i}."
            layer.self_attn.q_norm.weight.fill_(how.qk_norm_weight)
            layer.self_attn.k_norm.weight.fill_(how.qk_norm_weight)
            # transformers holds an expert's gate and up projections fused, gate first: [2F, H].
            gate_up_FH = torch.cat([source[f"{prefix}mlp.gate_proj.weight"], source[f"{prefix}mlp.up_proj.weight"]])
            down_HF = source[f"{prefix}mlp.down_proj.weight"]
            for e in range(moe.num_experts):
                layer.mlp.experts.gate_up_proj[e].copy_(perturbed(gate_up_FH))
                layer.mlp.experts.down_proj[e].copy_(perturbed(down_HF))
            router_EH = torch.randn(layer.mlp.gate.weight.shape, generator=generator, dtype=torch.float32)
            layer.mlp.gate.weight.copy_(router_EH * how.router_scale / hidden**0.5)
            set_names |= {
                f"{prefix}self_attn.q_norm.weight",
                f"{prefix}self_attn.k_norm.weight",
                f"{prefix}mlp.experts.gate_up_proj",
                f"{prefix}mlp.experts.down_proj",
                f"{prefix}mlp.gate.weight",
            }
    unset = sorted(set(target) - set_names)
    if unset:
        raise RuntimeError(f"upcycle left {unset} at their random initialisation")
    return model


@dataclass(frozen=True)
class RouterStats:
    """The routers' choices over a set of tokens, every layer's (k = experts per token)."""

    tokens: int  # tokens per layer
    min_gap: float  # smallest gap between the k-th and the (k+1)-th largest router logit, as the model computes them
    # The smallest ratio of that gap to its worst-case float32 rounding bound, and how many (token, layer) choices
    # are within it: another summation order (another CPU, megatron's router GEMM) could route those differently.
    min_gap_over_bound: float
    near_ties: int
    expert_load: list[list[float]]  # per layer, each expert's share of the routed (token, slot) pairs


def router_stats(model: torch.nn.Module, tokenizer: Any, examples: Sequence[task.Example]) -> RouterStats:
    """Run `examples` (prompt and reference response, as SFT sees them) through `model` and read every router."""
    k = model.config.num_experts_per_tok
    num_experts = model.config.num_experts
    hidden = model.config.hidden_size
    # A float32 dot product of length H is off by at most gamma_H x sum_h |hidden_h x weight_eh| (Higham, any order).
    gamma = hidden * FP32_UNIT_ROUNDOFF / (1 - hidden * FP32_UNIT_ROUNDOFF)
    gaps: list[torch.Tensor] = []
    ratios: list[torch.Tensor] = []
    counts_LE = torch.zeros(len(model.model.layers), num_experts, dtype=torch.long)
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def capture(layer: int) -> Any:
        def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: Any) -> None:
            captured[layer] = (inputs[0].reshape(-1, hidden), output[0])  # [B*L, H], the router's logits [B*L, E]

        return hook

    hooks = [layer.mlp.gate.register_forward_hook(capture(i)) for i, layer in enumerate(model.model.layers)]
    encoded = [encode_example(tokenizer, e) for e in examples]
    tokens = 0
    model.eval()
    try:
        with torch.no_grad():
            for first in range(0, len(encoded), EVAL_BATCH_SIZE):
                batch = encoded[first : first + EVAL_BATCH_SIZE]
                input_ids_BL, attention_BL, _ = collate(batch, tokenizer.pad_token_id)
                model(input_ids=input_ids_BL, attention_mask=attention_BL)
                real_N = attention_BL.reshape(-1).bool()  # [B*L]: not the padding
                tokens += int(real_N.sum())
                for i, layer in enumerate(model.model.layers):
                    hidden_NH, logits_NE = (t[real_N] for t in captured[i])
                    bound_NE = gamma * (hidden_NH.double().abs() @ layer.mlp.gate.weight.double().abs().T)
                    order_NE = logits_NE.argsort(dim=-1, descending=True, stable=True)
                    kth_N1, next_N1 = order_NE[:, k - 1 : k], order_NE[:, k : k + 1]
                    gap_N = (logits_NE.gather(1, kth_N1) - logits_NE.gather(1, next_N1)).squeeze(1).double()
                    gaps.append(gap_N)
                    ratios.append(gap_N / (bound_NE.gather(1, kth_N1) + bound_NE.gather(1, next_N1)).squeeze(1))
                    counts_LE[i] += torch.bincount(order_NE[:, :k].reshape(-1), minlength=num_experts)
    finally:
        for hook in hooks:
            hook.remove()
    ratio = torch.cat(ratios)
    load = (counts_LE.double() / counts_LE.sum(dim=1, keepdim=True)).tolist()
    return RouterStats(
        tokens=tokens,
        min_gap=float(torch.cat(gaps).min()),
        min_gap_over_bound=float(ratio.min()),
        near_ties=int((ratio <= 1).sum()),
        expert_load=[[round(share, 4) for share in row] for row in load],
    )


def warm_up(model_dir: Path, splits: task.Splits) -> dict[str, Any]:
    """Upcycle INIT_FROM into `model_dir` and train it until its dev accuracy reaches the dense student's target."""
    from transformers import GenerationConfig

    dense, tokenizer = load_model(INIT_FROM)
    model = upcycle(dense)
    dev_checks: list[dict[str, float]] = [
        {"step": 0, "dev_accuracy": accuracy_on(model, tokenizer, splits.dev)},
    ]
    print(f"  upcycled: dev {dev_checks[0]['dev_accuracy']:.1%}", flush=True)

    def reached_target(steps_done: int) -> bool:
        if steps_done < CHECK_FROM_STEP or steps_done % CHECK_EVERY:
            return False
        dev_checks.append({"step": steps_done, "dev_accuracy": accuracy_on(model, tokenizer, splits.dev)})
        print(f"  step {steps_done}: dev {dev_checks[-1]['dev_accuracy']:.1%}", flush=True)
        return dev_checks[-1]["dev_accuracy"] >= STUDENT_TARGET_DEV_ACCURACY

    losses = sft_train(model, tokenizer, splits.train, SFT, stop=reached_target)
    if dev_checks[-1]["dev_accuracy"] < STUDENT_TARGET_DEV_ACCURACY:
        raise RuntimeError(
            f"MoE student warm-up: dev accuracy {dev_checks[-1]} never reached {STUDENT_TARGET_DEV_ACCURACY} "
            f"in {SFT.steps} steps; raise moe_student.SFT.steps"
        )
    model.generation_config = GenerationConfig.from_pretrained(str(INIT_FROM))
    model.to(getattr(torch, SAVE_DTYPE)).save_pretrained(str(model_dir), safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(INIT_FROM / name, model_dir / name)
    return {
        "params": count_params(model),
        "steps": len(losses),
        "final_loss": losses[-1],
        "dev_accuracy": dev_checks[-1]["dev_accuracy"],  # where the warm-up stopped (float32, before the save)
        "upcycled_dev_accuracy": dev_checks[0]["dev_accuracy"],
    }


def check_router(model_dir: Path, examples: Sequence[task.Example]) -> RouterStats:
    """The saved student's router statistics on `examples`; refuses an exact tie of its top-k choice."""
    model, tokenizer = load_model(model_dir)
    stats = router_stats(model, tokenizer, examples)
    if stats.min_gap <= 0:
        raise RuntimeError(
            f"MoE student: a router's top-{model.config.num_experts_per_tok} choice is an exact tie on the held-out "
            "prompts (the expert it takes is the sort's choice, not the router's); change moe_student.UPCYCLE's seed"
        )
    return stats


def build(out: Path, force: bool = False) -> dict[str, Any]:
    """Build the student into `out/student` unless a complete matching manifest is there; returns the manifest."""

    def build_into(work: Path) -> dict[str, Any]:
        import transformers

        laps = Laps()
        student = warm_up(work / "student", task.generate_splits())
        laps.lap("warm_up")
        held_out = task.read_jsonl(EVAL_FILE)
        student["router"] = asdict(check_router(work / "student", held_out))
        laps.lap("router")
        student["eval_accuracy"] = greedy_accuracy(work / "student", EVAL_FILE)
        reference = {
            "dense_student_eval_accuracy": greedy_accuracy(INIT_FROM, EVAL_FILE),
            "teacher_eval_accuracy": greedy_accuracy(TEACHER, EVAL_FILE),
        }
        laps.lap("eval")
        return {
            "recipe": recipe(),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "student": student,
            "reference": reference,
            "seconds": laps.total(),
        }

    manifest, built = build_unless_current(
        out, "MoE student", manifest_problem(out), force, build_into, entries=("student",)
    )
    if built:
        s, ref = manifest["student"], manifest["reference"]
        print(
            f"MoE student: {s['params']:,} params, {s['steps']} warm-up steps, held-out accuracy {s['eval_accuracy']:.1%} "
            f"(dense student {ref['dense_student_eval_accuracy']:.1%}, teacher {ref['teacher_eval_accuracy']:.1%}); "
            f"router: smallest top-{MOE.experts_per_token} gap {s['router']['min_gap']:.3g} "
            f"({s['router']['min_gap_over_bound']:.3g} x its float32 rounding bound, {s['router']['near_ties']} choices "
            f"within it) over {s['router']['tokens']} tokens per layer; {manifest['total_bytes'] / 2**20:.2f} MiB in {out}; built in {manifest['seconds']['total']:.0f} s"
        )
    return manifest


def main(argv: list[str] | None = None) -> int:
    return asset_command(argv, __doc__, DEFAULT_OUT, build)


if __name__ == "__main__":
    sys.exit(main())
