"""A mixture of experts' routers as the actor watches and weights them: per-expert load, router entropy, and the
load-balancing loss's weight per micro-batch.

megatron-core 0.16.1's schedule, with `calculate_per_token_loss`, backpropagates each micro-batch's aux loss at
scale 1 (pipeline_parallel/schedules.py forward_step_calc_loss: `MoEAuxLossAutoScaler.set_loss_scale(loss_scale)`),
and finalize_model_grads divides every gradient by the step's global count T of loss tokens. Weighting micro-batch
j's aux loss (megatron's mean over its tokens) by `aux_loss_coeff x n_j`, its count of loss tokens, makes the step's
gradient that of `aux_loss_coeff x sum_j (n_j / T) aux_j`: the loss-token-weighted mean of the micro-batches' aux
losses, whatever the micro-batch split or the data-parallel size. The router reads the coefficient at each forward
(transformer/moe/router.py TopKRouter.get_aux_loss_coeff), so it is set per micro-batch before the forward.

The statistics count the loss positions only (the response tokens the step trains on), at the training forwards
(not a recomputation inside the backward): per expert, its share of all routing assignments over the layers; per
(layer, expert), that share times num_experts (1 = uniform; the max and min are reported); the mean entropy of
the router's softmax over every expert, in nats (ln num_experts = uniform).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from recipe_gkd.models import HFArch


def scaled_aux_loss_coeff(aux_loss_coeff: float, loss_tokens: int) -> float:
    """The router's coefficient for a micro-batch of `loss_tokens` loss tokens (module docstring)."""
    return aux_loss_coeff * loss_tokens


class RouterWatch:
    """Forward hooks on the stage's megatron routers that count, per layer, the routing assignments and the router
    entropy at the loss positions of the training micro-batches (`watch` before each forward)."""

    def __init__(self, gpt: torch.nn.Module, arch: HFArch, first_layer: int, device: torch.device) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.num_experts = arch.num_experts
        self.num_layers = arch.num_layers
        self.routers = [m for m in gpt.modules() if isinstance(m, TopKRouter)]
        # The stage's routers in layer order: global layer first_layer + i.
        self.first_layer = first_layer
        self.device = device
        self._positions: Tensor | None = None
        self._reset()
        for index, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(first_layer + index))

    def _reset(self) -> None:
        # [L, E] assignments, [L] entropy sums, [L] token counts: every layer of the model (other stages' rows 0).
        self.assignments_LE = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64, device=self.device)
        self.entropy_L = torch.zeros(self.num_layers, dtype=torch.float64, device=self.device)
        self.tokens_L = torch.zeros(self.num_layers, dtype=torch.float64, device=self.device)

    def watch(self, loss_mask_BT: Tensor | None) -> None:
        """Count the next forwards at these positions (None: count nothing, an evaluation or a probe)."""
        # megatron's hidden states are [S, B, H]; the router flattens them to tokens s * B + b.
        self._positions = None if loss_mask_BT is None else loss_mask_BT.transpose(0, 1).reshape(-1)

    def _hook(self, layer: int) -> Any:
        def count(router: torch.nn.Module, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
            # A recomputation inside the backward (activation recompute) is the same forward again: not counted.
            if self._positions is None or torch._C._current_graph_task_id() != -1:
                return
            with torch.no_grad():
                routing_map_NE = output[1].reshape(-1, self.num_experts)[self._positions]
                hidden_NH = inputs[0].reshape(-1, inputs[0].shape[-1])[self._positions]
                logits_NE = hidden_NH.float() @ router.weight.float().t()
                logp_NE = torch.log_softmax(logits_NE, dim=-1)
                self.assignments_LE[layer] += routing_map_NE.sum(0).double()
                self.entropy_L[layer] += -(logp_NE.exp() * logp_NE).sum().double()
                self.tokens_L[layer] += float(routing_map_NE.shape[0])

        return count

    def step_stats(self, dp_group: Any, pp_group: Any) -> dict[str, float]:
        """The step's statistics over every data-parallel rank and pipeline stage (every rank calls), then reset.

        Tensor-parallel ranks of a replica route the same tokens: each counts them once, and the sums run over
        data parallel and the stages only."""
        packed = torch.cat([self.assignments_LE.flatten(), self.entropy_L, self.tokens_L])
        dist.all_reduce(packed, group=dp_group)
        if dist.get_world_size(pp_group) > 1:
            dist.all_reduce(packed, group=pp_group)
        L, E = self.num_layers, self.num_experts
        assignments_LE = packed[: L * E].reshape(L, E)
        entropy_L, tokens_L = packed[L * E : L * E + L], packed[L * E + L :]
        self._reset()
        if float(tokens_L.sum()) == 0:
            return {}
        share_E = assignments_LE.sum(0) / assignments_LE.sum()
        ratio_LE = assignments_LE / assignments_LE.sum(1, keepdim=True).clamp(min=1.0) * E
        return {
            **{f"moe_expert_load_{e}": float(share_E[e]) for e in range(E)},
            "moe_load_max_ratio": float(ratio_LE.max()),
            "moe_load_min_ratio": float(ratio_LE.min()),
            "moe_router_entropy": float(entropy_L.sum() / tokens_L.sum()),
            "moe_router_entropy_uniform": math.log(E),
        }
