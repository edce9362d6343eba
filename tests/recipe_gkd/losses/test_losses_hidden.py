"""hidden_gkd_loss_sum (the teacher's logits from its final hidden states and output head) against an
independent float64 full-vocabulary reference, values and gradients, at TP=1 and at TP=2 on gloo."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recipe_gkd.losses import gkd_loss_sum, hidden_gkd_loss_sum
from recipe_gkd.plan.ports import reserve_ports

WORLD_SIZE = 2
VOCAB = 23
HIDDEN = 16
VOCAB_SPLIT = 9  # uneven shards: rank 0 holds [0, 9), rank 1 holds [9, 23)
TEMPERATURE = 0.8
PROCESS_GROUP_TIMEOUT_S = 60
# fp32 inputs against the float64 reference, 1e-6 relative to max(1, |value|): a loss near 5 nats is
# itself only held to half an fp32 ulp (2.4e-7), and each per-token value sums V = 23 terms with one
# rounding (6e-8 relative) each; gradient entries are probabilities times O(1) factors (|g| <= ~1).
TOLERANCE = 1e-6


def close(value: torch.Tensor, want: torch.Tensor) -> bool:
    """|value - want| <= TOLERANCE * max(1, |want|), elementwise (see TOLERANCE)."""
    bound = TOLERANCE * want.abs().clamp(min=1.0)
    return bool(((value.double() - want).abs() <= bound).all())


# (divergence, beta): jsd's two limits are forward and reverse KL exactly.
SPECS = [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3), ("jsd", 0.0), ("jsd", 1.0)]


def make_case(seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    batch, seq = 2, 7
    loss_mask_BT = torch.rand(batch, seq, generator=gen) > 0.25
    loss_mask_BT[0, :3] = True
    return {
        "student_logits": (2 * torch.randn(batch, seq, VOCAB, generator=gen, dtype=torch.float64)).to(dtype),
        "hidden": torch.randn(batch, seq, HIDDEN, generator=gen, dtype=torch.float64).to(dtype),
        "head": (0.6 * torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64)).to(dtype),
        "loss_mask": loss_mask_BT,
    }


def reference(case: dict, divergence: str, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-mean divergence and its gradient in float64 over the whole vocabulary, written from the definitions."""
    logits = case["student_logits"].double().clone().requires_grad_(True)
    log_p = (logits / TEMPERATURE).log_softmax(-1)
    log_q = (case["hidden"].double() @ case["head"].double().T / TEMPERATURE).log_softmax(-1)
    p, q = log_p.exp(), log_q.exp()
    if divergence == "jsd" and beta == 0.0:
        divergence = "forward_kl"
    if divergence == "jsd" and beta == 1.0:
        divergence = "reverse_kl"
    if divergence == "forward_kl":
        per_token = (q * (log_q - log_p)).sum(-1)
    elif divergence == "reverse_kl":
        per_token = (p * (log_p - log_q)).sum(-1)
    else:
        log_m = (beta * q + (1 - beta) * p).log()
        per_token = beta * (q * (log_q - log_m)).sum(-1) + (1 - beta) * (p * (log_p - log_m)).sum(-1)
    mask = case["loss_mask"]
    loss = per_token[mask].sum() / mask.sum()
    loss.backward()
    return loss.detach(), logits.grad


def hidden_loss(case: dict, divergence: str, beta: float, shard: slice, **extra) -> tuple[torch.Tensor, torch.Tensor]:
    logits = case["student_logits"][..., shard].clone().requires_grad_(True)
    loss_sum, count = hidden_gkd_loss_sum(
        logits,
        case["hidden"],
        case["head"][shard],
        case["loss_mask"],
        divergence=divergence,
        beta=beta,
        temperature=TEMPERATURE,
        **extra,
    )
    loss = loss_sum / count
    loss.backward()
    return loss.detach(), logits.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("divergence", "beta"), SPECS)
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_hidden_loss_equals_full_vocabulary_reference(
    divergence: str, beta: float, dtype: torch.dtype, chunk_size: int | None
) -> None:
    case = make_case(7, dtype)
    want_loss, want_grad = reference(case, divergence, beta)
    loss, grad = hidden_loss(case, divergence, beta, slice(None), chunk_size=chunk_size)
    assert want_loss > 1e-2  # a real divergence, not a trivially small one
    assert close(loss, want_loss)
    assert close(grad, want_grad)
    assert grad[~case["loss_mask"]].abs().max().item() == 0.0  # masked rows get exactly no gradient


@pytest.mark.parametrize(("divergence", "beta"), SPECS)
def test_hidden_loss_equals_full_logit_topk_loss(divergence: str, beta: float) -> None:
    """The same divergence from the teacher's full logits sent as K = V top-k logprobs (today's loss)."""
    case = make_case(11, torch.float32)
    loss, grad = hidden_loss(case, divergence, beta, slice(None))
    teacher_BTV = (case["hidden"] @ case["head"].T / TEMPERATURE).log_softmax(-1)
    ids_BTV = torch.arange(VOCAB).expand_as(teacher_BTV)
    logits = case["student_logits"].clone().requires_grad_(True)
    loss_sum, count = gkd_loss_sum(
        logits, teacher_BTV, ids_BTV, case["loss_mask"], divergence=divergence, beta=beta, temperature=TEMPERATURE
    )
    (loss_sum / count).backward()
    assert close(loss, (loss_sum.detach() / count).double())
    assert close(grad, logits.grad.double())


def test_hidden_loss_rejects_a_head_of_another_vocabulary() -> None:
    case = make_case(3, torch.float32)
    with pytest.raises(ValueError, match="teacher head"):
        hidden_gkd_loss_sum(
            case["student_logits"], case["hidden"], case["head"][:-1], case["loss_mask"], divergence="forward_kl"
        )


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
        shard = slice(0, VOCAB_SPLIT) if rank == 0 else slice(VOCAB_SPLIT, VOCAB)
        results = []
        for index, (divergence, beta) in enumerate(SPECS):
            case = make_case(100 + index, torch.float32)
            loss, grad = hidden_loss(case, divergence, beta, shard, group=dist.group.WORLD, chunk_size=4)
            want_loss, want_grad = reference(case, divergence, beta)
            results.append({"loss": loss, "grad": grad, "want_loss": want_loss, "want_grad": want_grad[..., shard]})
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_hidden_loss_tp2_on_gloo_equals_full_vocabulary_reference(tmp_path: Path) -> None:
    mp.spawn(worker, args=(reserve_ports(1)[0], str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    per_rank = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]
    for rank, results in enumerate(per_rank):
        for spec, result in zip(SPECS, results, strict=True):
            label = f"rank {rank} {spec}"
            assert close(result["loss"], result["want_loss"]), label
            assert close(result["grad"], result["want_grad"]), label
            assert result["grad"].abs().sum() > 0, label
    for index in range(len(SPECS)):
        assert torch.equal(per_rank[0][index]["loss"], per_rank[1][index]["loss"])
