"""Context parallelism: each of a data-parallel replica's CP ranks holds a load-balanced share of every sequence.

The zigzag split: a micro-batch's length T is padded to T' (a multiple of 2 x CP) and cut into 2 x CP chunks of
c = T' / (2 x CP); CP rank r holds chunks r and 2 x CP - 1 - r, in that order (causal attention's work is then
the same on every rank). It is megatron-core's own order: its rotary embedding gives a CP rank the positions of
exactly these chunks (models/common/embeddings/rope_utils.py `get_pos_emb_on_this_cp_rank`). Everything per
token of a MicroBatch (ids, the loss mask, the teacher's top-k rows and tail, hidden-state targets, the sampled
objective's fields, the tool-token mask) is split the same way; the padding is never a loss token. Attention
gathers the whole sequence's keys and values over the CP group (`gather_sequence`, recipe_gkd/actor/attention.py);
a probe's logits come back whole with `ContextSplit.gather`. Pure torch: no megatron import.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from recipe_gkd.actor.collate import MicroBatch
from recipe_gkd.parallel_layout import ParallelLayout

# The MicroBatch fields with a sequence axis (dim 1) and the value their padding takes (the loss mask False: the
# padding is never a loss token, so the rest only needs to be finite).
PER_TOKEN_FIELDS = {
    "input_ids_BT": None,  # the pad id
    "position_ids_BT": None,  # positions go on
    "teacher_logprobs_BTK": 0.0,
    "teacher_ids_BTK": 0,
    "teacher_tail_BT": 0.0,
    "loss_mask_BT": False,
    "target_ids_BT": 0,
    "rollout_logprobs_BT": 0.0,
    "teacher_sampled_BT": 0.0,
    "sampled_mask_BT": True,
    "payload": 0,
}


def padded_length(length: int, cp_size: int) -> int:
    """The smallest multiple of 2 x cp_size >= length (the memory plan's reading too: ParallelLayout)."""
    return ParallelLayout(cp_size=cp_size).cp_padded_length(length)


def zigzag_positions(length: int, cp_size: int, cp_rank: int) -> Tensor:
    """The positions (of a sequence padded to `length`, a multiple of 2 x cp_size) CP rank `cp_rank` holds."""
    chunk = length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return torch.cat([first, second])


def natural_order(length: int, cp_size: int) -> Tensor:
    """The index into the CP ranks' shares concatenated in rank order ([cp x length / cp]) that puts them back in
    the sequence's order: the inverse of the zigzag split."""
    held = torch.cat([zigzag_positions(length, cp_size, r) for r in range(cp_size)])
    return torch.argsort(held)


class ContextSplit:
    """This rank's share of each micro-batch (`split`) and the whole of what every CP rank computed (`gather`)."""

    def __init__(self, cp_size: int, cp_rank: int, group: Any, pad_id: int) -> None:
        self.cp_size, self.cp_rank, self.group, self.pad_id = cp_size, cp_rank, group, pad_id

    def split(self, micro: MicroBatch) -> MicroBatch:
        """This rank's zigzag share of every per-token field; `num_tokens` counts the loss tokens it holds."""
        if self.cp_size == 1:
            return micro
        length = micro.input_ids_BT.shape[1]
        padded = padded_length(length, self.cp_size)
        mine = zigzag_positions(padded, self.cp_size, self.cp_rank).to(micro.input_ids_BT.device)
        fields: dict[str, Any] = {}
        for name, pad in PER_TOKEN_FIELDS.items():
            tensor = getattr(micro, name)
            if tensor is None:
                continue
            fields[name] = self._padded(tensor, padded, name, pad).index_select(1, mine)
        loss_mask = fields["loss_mask_BT"]
        return dataclasses.replace(micro, **fields, num_tokens=int(loss_mask.sum()))

    def _padded(self, tensor: Tensor, length: int, name: str, pad: Any) -> Tensor:
        """`tensor` [B, T, ...] padded along T to `length`."""
        missing = length - tensor.shape[1]
        if missing == 0:
            return tensor
        if name == "position_ids_BT":
            extra = tensor[:, -1:] + torch.arange(1, missing + 1, device=tensor.device)
            return torch.cat([tensor, extra], dim=1)
        fill = self.pad_id if name == "input_ids_BT" else pad
        padding = torch.full(
            (tensor.shape[0], missing, *tensor.shape[2:]), fill, dtype=tensor.dtype, device=tensor.device
        )
        return torch.cat([tensor, padding], dim=1)

    def gather(self, local_BtX: Tensor, length: int) -> Tensor:
        """Every CP rank's share [B, t, ...] (no gradient) -> the whole [B, length, ...] in the sequence's order."""
        if self.cp_size == 1:
            return local_BtX
        shares = [torch.empty_like(local_BtX) for _ in range(self.cp_size)]
        dist.all_gather(shares, local_BtX.contiguous(), group=self.group)
        whole = torch.cat(shares, dim=1)  # [B, cp x t, ...], rank by rank
        order = natural_order(whole.shape[1], self.cp_size).to(whole.device)
        return whole.index_select(1, order)[:, :length]


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over the CP group; the backward sums every rank's gradient and keeps this rank's."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: Any, rank: int, size: int) -> Tensor:
        ctx.group, ctx.rank, ctx.size = group, rank, size
        shares = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(shares, local.contiguous(), group=group)
        return torch.cat(shares, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            # GPU-only, reasoned (torch.distributed.reduce_scatter_tensor): the sum of every rank's gradient of
            # this rank's share, without the whole sum on every rank.
            mine = torch.empty_like(grad.chunk(ctx.size, dim=0)[ctx.rank])
            dist.reduce_scatter_tensor(mine, grad, group=ctx.group)
            return mine, None, None, None
        # gloo has no reduce-scatter: the whole sum, then this rank's share.
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=0)[ctx.rank].contiguous(), None, None, None


def gather_sequence(local_SX: Tensor, group: Any, rank: int, size: int) -> Tensor:
    """Every CP rank's share [s, ...] concatenated in rank order [size x s, ...], with gradients to each share."""
    return _GatherSequence.apply(local_SX, group, rank, size)
