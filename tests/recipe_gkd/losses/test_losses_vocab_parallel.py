"""vocab_parallel_gkd_loss_sum (and the sampled-token reverse KL) on gloo with TP=2 equal TP=1, values and gradients."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recipe_gkd.batch import EXCLUDED_ID
from recipe_gkd.losses import DIVERGENCES, gkd_loss_sum, sampled_reverse_kl_loss_sum, vocab_parallel_gkd_loss_sum
from recipe_gkd.plan.ports import reserve_ports

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

WORLD_SIZE = 2
TOLERANCE = 1e-6
VOCAB = 23
VOCAB_SPLIT = 9  # uneven shards: rank 0 holds [0, 9), rank 1 holds [9, 23)
PROCESS_GROUP_TIMEOUT_S = 60


def make_case(
    seed: int, top_k: int, dtype: torch.dtype, folded: bool = False, union: bool = False
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    batch, seq = 2, 7
    teacher_full_BTV = (2 * torch.randn(batch, seq, VOCAB, generator=gen, dtype=torch.float64)).log_softmax(-1)
    teacher_ids_BTK = torch.rand(batch, seq, VOCAB, generator=gen).argsort(-1)[..., :top_k]
    if top_k <= VOCAB_SPLIT:
        # One position whose top-k lies entirely in rank 0's shard, one entirely in rank 1's.
        teacher_ids_BTK[0, 1] = torch.randperm(VOCAB_SPLIT, generator=gen)[:top_k]
        teacher_ids_BTK[0, 2] = VOCAB_SPLIT + torch.randperm(VOCAB - VOCAB_SPLIT, generator=gen)[:top_k]
    loss_mask_BT = torch.rand(batch, seq, generator=gen) > 0.25
    loss_mask_BT[0, :3] = True
    case = {
        "student_logits": (2 * torch.randn(batch, seq, VOCAB, generator=gen, dtype=torch.float64)).to(dtype),
        "teacher_topk_logprobs": teacher_full_BTV.gather(-1, teacher_ids_BTK).to(dtype),
        "teacher_topk_ids": teacher_ids_BTK,
        "loss_mask": loss_mask_BT,
    }
    if folded:
        # One sent id per position lies past the student's rows (a teacher with more embedding rows):
        # its mass must fold into the tail on every shard. The sent tail is the mass outside the K ids.
        case["teacher_tail_logmass"] = teacher_full_BTV.scatter(-1, teacher_ids_BTK, -float("inf")).logsumexp(-1)
        case["teacher_topk_ids"] = teacher_ids_BTK.clone()
        case["teacher_topk_ids"][..., 0] = VOCAB + 2
    if union:
        # algorithm.support=union: 3 more ids (the student's) with the teacher's logprobs, one column repeating a
        # teacher id (sent as EXCLUDED_ID at -inf), the tail outside all of them.
        rest_BTV = torch.rand(batch, seq, VOCAB, generator=gen).scatter(-1, teacher_ids_BTK, -1.0)
        student_ids_BTS = rest_BTV.argsort(-1, descending=True)[..., :3]
        union_BTJ = torch.cat([teacher_ids_BTK, student_ids_BTS], -1)
        excluded_BT1 = torch.full((batch, seq, 1), EXCLUDED_ID, dtype=torch.int64)
        case["teacher_topk_ids"] = torch.cat([union_BTJ, excluded_BT1], -1)
        logprobs_BTJ = teacher_full_BTV.gather(-1, union_BTJ)
        case["teacher_topk_logprobs"] = torch.cat(
            [logprobs_BTJ, torch.full_like(logprobs_BTJ[..., :1], -torch.inf)], -1
        )
        case["teacher_topk_logprobs"] = case["teacher_topk_logprobs"].to(dtype)
        case["teacher_tail_logmass"] = teacher_full_BTV.scatter(-1, union_BTJ, -float("inf")).logsumexp(-1)
    return case


CASES = [
    {"divergence": divergence, "tail": tail, "beta": beta, "temperature": 0.8, "top_k": top_k, "dtype": dtype}
    for divergence in DIVERGENCES
    for tail in (True, False)
    for beta in ((0.0, 0.3, 1.0) if divergence == "jsd" else (0.5,))
    for top_k, dtype in ((5, torch.float64), (VOCAB, torch.float64), (5, torch.float32))
]
# Ids beyond the student's vocabulary fold into the tail (only the tail bucket can take them), with the sent tail.
CASES += [
    {"divergence": divergence, "tail": True, "beta": 0.3, "temperature": 0.8, "top_k": 5, "dtype": torch.float64}
    | {"folded": True}
    for divergence in DIVERGENCES
]
# Union support: the student's ids appended, a repeated one excluded.
CASES += [
    {"divergence": divergence, "tail": True, "beta": 0.3, "temperature": 0.8, "top_k": 5, "dtype": torch.float64}
    | {"union": True}
    for divergence in DIVERGENCES
]


def loss_and_grad(case: dict, logits: torch.Tensor, fn, **extra) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = logits.detach().clone().requires_grad_(True)
    loss_sum, count = fn(
        logits,
        case["teacher_topk_logprobs"],
        case["teacher_topk_ids"],
        case["loss_mask"],
        divergence=case["divergence"],
        beta=case["beta"],
        temperature=case["temperature"],
        tail=case["tail"],
        teacher_tail_logmass=case.get("teacher_tail_logmass"),
        chunk_size=3,
        **extra,
    )
    (loss_sum / count).backward()
    return loss_sum.detach(), count, logits.grad


SAMPLED_RATIO_CLIPS = (0.0, 0.2)


def sampled_case(seed: int) -> dict[str, torch.Tensor]:
    """Stale s_old (weights moved since sampling) and targets on both shards."""
    gen = torch.Generator().manual_seed(seed)
    batch, seq = 2, 7
    logits_BTV = 2 * torch.randn(batch, seq, VOCAB, generator=gen, dtype=torch.float64)
    targets_BT = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    old_BTV = (logits_BTV + 0.5 * torch.randn(batch, seq, VOCAB, generator=gen, dtype=torch.float64)).log_softmax(-1)
    teacher_BTV = (2 * torch.randn(batch, seq, VOCAB, generator=gen, dtype=torch.float64)).log_softmax(-1)
    return {
        "logits": logits_BTV,
        "targets": targets_BT,
        "old": old_BTV.gather(-1, targets_BT[..., None])[..., 0],
        "teacher": teacher_BTV.gather(-1, targets_BT[..., None])[..., 0],
        "mask": torch.rand(batch, seq, generator=gen) > 0.25,
    }


def sampled_loss_and_grad(case: dict, logits: torch.Tensor, ratio_clip: float, **extra) -> tuple[torch.Tensor, ...]:
    logits = logits.detach().clone().requires_grad_(True)
    loss_sum, count, stats = sampled_reverse_kl_loss_sum(
        logits,
        case["targets"],
        case["old"],
        case["teacher"],
        case["mask"],
        ratio_clip=ratio_clip,
        chunk_size=3,
        **extra,
    )
    (loss_sum / count).backward()
    return loss_sum.detach(), logits.grad, torch.stack([stats.ratio_sum, stats.ratio_max, stats.clipped])


def worker(rank: int, port: int, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
    )
    try:
        vocab_start, vocab_end = (0, VOCAB_SPLIT) if rank == 0 else (VOCAB_SPLIT, VOCAB)
        results = []
        for index, spec in enumerate(CASES):
            case = dict(
                spec,
                **make_case(index, spec["top_k"], spec["dtype"], spec.get("folded", False), spec.get("union", False)),
            )
            full_loss, full_count, full_grad = loss_and_grad(case, case["student_logits"], gkd_loss_sum)
            tp_loss, tp_count, tp_grad = loss_and_grad(
                case,
                case["student_logits"][..., vocab_start:vocab_end],
                vocab_parallel_gkd_loss_sum,
                vocab_start=vocab_start,
                vocab_size=VOCAB,
                group=dist.group.WORLD,
            )
            results.append(
                {
                    "full_loss": full_loss,
                    "tp_loss": tp_loss,
                    "full_count": full_count,
                    "tp_count": tp_count,
                    "full_grad_shard": full_grad[..., vocab_start:vocab_end],
                    "tp_grad_shard": tp_grad,
                }
            )
        sampled = []
        for index, ratio_clip in enumerate(SAMPLED_RATIO_CLIPS):
            case = sampled_case(100 + index)
            full = sampled_loss_and_grad(case, case["logits"], ratio_clip)
            tp = sampled_loss_and_grad(
                case,
                case["logits"][..., vocab_start:vocab_end],
                ratio_clip,
                vocab_start=vocab_start,
                vocab_size=VOCAB,
                group=dist.group.WORLD,
            )
            sampled.append({"full": full, "tp": tp, "shard": (vocab_start, vocab_end)})
        wrong_vocab_error = ""
        try:
            spec = CASES[0]
            case = dict(spec, **make_case(0, spec["top_k"], spec["dtype"]))
            loss_and_grad(
                case,
                case["student_logits"][..., vocab_start:vocab_end],
                vocab_parallel_gkd_loss_sum,
                vocab_start=vocab_start,
                vocab_size=VOCAB + 1,
                group=dist.group.WORLD,
            )
        except ValueError as error:
            wrong_vocab_error = str(error)
        torch.save(
            {"results": results, "sampled": sampled, "wrong_vocab_error": wrong_vocab_error},
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    return reserve_ports(1)[0]


def test_tp2_on_gloo_equals_tp1(tmp_path: Path) -> None:
    mp.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    per_rank = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]
    for rank, saved in enumerate(per_rank):
        assert "vocab shards cover" in saved["wrong_vocab_error"]
        assert len(saved["results"]) == len(CASES)
        for spec, result in zip(CASES, saved["results"], strict=True):
            label = f"rank {rank} case {spec}"
            assert result["tp_count"] == result["full_count"], label
            assert abs(result["tp_loss"] - result["full_loss"]).item() <= TOLERANCE, label
            grad_error = (result["tp_grad_shard"] - result["full_grad_shard"]).abs().max().item()
            assert grad_error <= TOLERANCE, label
            # Every rank gets the same loss; the gradient is non-trivial on each shard.
            assert result["tp_grad_shard"].abs().sum() > 0, label
    for spec_index in range(len(CASES)):
        assert torch.equal(per_rank[0]["results"][spec_index]["tp_loss"], per_rank[1]["results"][spec_index]["tp_loss"])
    # The two shards' gradients together are the full gradient.
    for spec_index in range(len(CASES)):
        joined = torch.cat([saved["results"][spec_index]["tp_grad_shard"] for saved in per_rank], dim=-1)
        full = torch.cat([saved["results"][spec_index]["full_grad_shard"] for saved in per_rank], dim=-1)
        assert joined.shape[-1] == VOCAB
        assert torch.allclose(joined, full, rtol=0.0, atol=TOLERANCE)

    # The sampled-token reverse KL: same loss, statistics and gradient shard as on the whole vocabulary.
    for saved in per_rank:
        assert len(saved["sampled"]) == len(SAMPLED_RATIO_CLIPS)
        for result in saved["sampled"]:
            (full_loss, full_grad, full_stats), (tp_loss, tp_grad, tp_stats) = result["full"], result["tp"]
            lo, hi = result["shard"]
            assert abs(tp_loss - full_loss).item() <= TOLERANCE
            assert torch.allclose(tp_stats, full_stats, rtol=0.0, atol=TOLERANCE)
            assert torch.allclose(tp_grad, full_grad[..., lo:hi], rtol=0.0, atol=TOLERANCE)
            assert tp_grad.abs().sum() > 0
