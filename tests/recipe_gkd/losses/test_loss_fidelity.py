"""The loss sees what the teacher computed: an LM-shaped teacher, over the real teacher wire, at the optimum.

A student equal to the teacher must get (almost) zero loss and no push in any direction. The
teacher here is shaped like an LM's next-token distribution (a few likely tokens, a far tail of
mass <= 1e-6 over a 32k vocabulary); its scores travel through the protocol's own reply frames
(float16 logprobs and Elias-Fano ids by default) and come out as the rollout worker sees them.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch

from recipe_gkd.losses import DIVERGENCES, gkd_loss
from teacher_server.config.teacher import TeacherClientConfig
from teacher_server.wire.protocol import ScoreReply, TopKBatch
from teacher_server.wire.score_frames import parse_score_reply, reply_frames

pytestmark = pytest.mark.timeout(120)

VOCAB = 32000
TOP_K = 64
TOKENS = 256
# The likely tokens' logits over a N(0, 1) background: top-1 ~0.8, tail mass <= 1e-6.
LIKELY_LOGITS = (26.0, 24.0, 23.0, 22.0)
AT_OPTIMUM = 1e-7


def lm_shaped_teacher(seed: int) -> torch.Tensor:
    """Teacher logits [TOKENS, VOCAB] (float32) with a sharp top and a far tail."""
    gen = torch.Generator().manual_seed(seed)
    logits_MV = torch.randn(TOKENS, VOCAB, generator=gen)
    likely_M4 = torch.rand(TOKENS, VOCAB, generator=gen).argsort(-1)[:, : len(LIKELY_LOGITS)]
    boost_M4 = torch.tensor(LIKELY_LOGITS) + 0.5 * torch.randn(TOKENS, len(LIKELY_LOGITS), generator=gen)
    return logits_MV.scatter_(1, likely_M4, boost_M4)


def over_the_wire(logits_MV: torch.Tensor, logprob_dtype: str, id_encoding: str) -> TopKBatch:
    """What a backend computes from these logits, encoded and decoded as the server and client do."""
    logprobs_MV = torch.log_softmax(logits_MV.double(), dim=-1)
    values_MK, ids_MK = logprobs_MV.topk(TOP_K, dim=-1)
    tail_M = logprobs_MV.scatter(-1, ids_MK, -math.inf).logsumexp(-1)
    assert tail_M.exp().max() <= 1e-6, "the test's teacher must have a far tail"
    computed = TopKBatch(
        np.asarray([TOKENS]),
        values_MK.float().numpy(),
        ids_MK.int().numpy(),
        values_MK[:, 0].float().numpy(),
        tail_M.float().numpy(),
    )
    frames = reply_frames(1, computed, vocab_size=VOCAB, logprob_dtype=logprob_dtype, id_encoding=id_encoding)
    return parse_score_reply(msgspec.msgpack.decode(frames[0], type=ScoreReply), frames[1:])


def loss_and_grad(
    student_MV: torch.Tensor, wire: TopKBatch, divergence: str, *, sent_tail: bool
) -> tuple[float, torch.Tensor]:
    student_1MV = student_MV[None].clone().requires_grad_(True)
    loss = gkd_loss(
        student_1MV,
        torch.from_numpy(wire.topk_logprobs)[None],
        torch.from_numpy(wire.topk_ids).long()[None],
        torch.ones(1, TOKENS, dtype=torch.bool),
        divergence=divergence,
        teacher_tail_logmass=torch.from_numpy(wire.tail_logmass)[None] if sent_tail else None,
    )
    (grad_1MV,) = torch.autograd.grad(loss, student_1MV)
    return float(loss.detach()), grad_1MV[0]


def tail_direction(grad_MV: torch.Tensor, wire: TopKBatch) -> torch.Tensor:
    """d loss / d (a common shift of every logit outside the top-k), per token [M]: the push on the tail's mass."""
    outside_MV = torch.ones_like(grad_MV, dtype=torch.bool).scatter_(1, torch.from_numpy(wire.topk_ids).long(), False)
    return (grad_MV * outside_MV).sum(-1)


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_student_equal_to_teacher_is_at_the_optimum_over_the_default_wire(divergence: str) -> None:
    defaults = TeacherClientConfig()
    assert defaults.logprob_dtype == "float16"
    teacher_MV = lm_shaped_teacher(seed=0)
    wire = over_the_wire(teacher_MV, defaults.logprob_dtype, defaults.id_encoding)
    loss, grad_MV = loss_and_grad(teacher_MV, wire, divergence, sent_tail=True)
    assert abs(loss) < AT_OPTIMUM
    # No push on the mass outside the top-k (the rebuilt tail pushed it towards 0).
    assert tail_direction(grad_MV, wire).norm() < AT_OPTIMUM
    # The remaining gradient is float16's rounding of the top-k values themselves, zero-mean noise
    # of a few 1e-6 here; the float32 wire removes it (next test).
    assert grad_MV.norm() < 1e-5


def test_a_tail_rebuilt_from_float16_values_is_off_at_the_optimum() -> None:
    """The defect the sent tail fixes, kept as a check that the test above can fail."""
    teacher_MV = lm_shaped_teacher(seed=0)
    wire = over_the_wire(teacher_MV, "float16", "elias_fano")
    loss, grad_MV = loss_and_grad(teacher_MV, wire, "forward_kl", sent_tail=False)
    assert loss > 1e-5
    assert tail_direction(grad_MV, wire).norm() > 1e-6


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_float32_wire_gives_no_gradient_at_the_optimum(divergence: str) -> None:
    teacher_MV = lm_shaped_teacher(seed=1)
    wire = over_the_wire(teacher_MV, "float32", "int32")
    loss, grad_MV = loss_and_grad(teacher_MV, wire, divergence, sent_tail=True)
    assert abs(loss) < AT_OPTIMUM
    assert grad_MV.norm() < AT_OPTIMUM
