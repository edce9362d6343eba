"""The actor's parallel layout: one object for its tensor-, context-, expert-, data- and pipeline-parallel sizes and ranks.

megatron-core orders global ranks "tp-cp-ep-dp-pp" (parallel_state.initialize_model_parallel's default `order`,
RankGenerator) and builds two views of one world from it: the dense layers' (ep = 1, so global rank
r = tp + TP * (cp + CP * (dp + DP * pp)), tensor-parallel ranks adjacent, pipeline stages outermost) and the
experts' (cp = 1, the data-parallel size split into EP x DP/EP: ep = dp mod EP, the expert-data-parallel rank
dp div EP). Expert parallelism thus lives inside data parallelism: each group of EP consecutive data-parallel
replicas splits every layer's experts, and the replicas holding the same experts reduce their gradients together.
Every model-parallel rank (TP x PP) of one data-parallel replica must receive the same data; the driver hands each
rank the shard of its `dp_rank`. `MegatronActor.setup()` checks the layout against megatron's parallel_state. The
actor, its objective and export, the checkpoints and the memory plan all read this one object. Pure Python: no
torch or megatron import.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from recipe_gkd.config import GKDConfig, actor_data_parallel_size

# megatron's rank order of the whole world, innermost dimension first (its `order` string "tp-cp-ep-dp-pp" with the
# dense layers' ep = 1; the expert-parallel rank is a split of the data-parallel one).
RANK_ORDER = ("tp", "cp", "dp", "pp")
# Megatron's embedding / output layer shard the vocabulary evenly over tensor-parallel ranks.
# Padding only to a multiple of tp keeps the padded columns (masked out of every loss) few.
VOCAB_PAD_MULTIPLE_PER_TP_RANK = 1


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Smallest size >= vocab_size that splits evenly over `tp_size` ranks."""
    multiple = tp_size * VOCAB_PAD_MULTIPLE_PER_TP_RANK
    return math.ceil(vocab_size / multiple) * multiple


@dataclass(frozen=True)
class ParallelLayout:
    """The sizes of the parallel dimensions and where global rank `rank` sits in them (megatron's order); `ep_size`
    divides `dp_size` (the data-parallel size counts every replica, expert-parallel or not)."""

    tp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        sizes = self.sizes()
        if any(size < 1 for size in sizes.values()):
            raise ValueError(f"parallel sizes must be >= 1, got {sizes}")
        # megatron builds its dense groups with ep = 1 and its expert groups with cp = 1 (RankGenerator asserts it).
        if self.ep_size < 1 or self.dp_size % self.ep_size:
            raise ValueError(f"ep={self.ep_size} must divide the data-parallel size {self.dp_size}")
        if self.cp_size > 1 and self.ep_size > 1:
            raise ValueError(f"cp={self.cp_size} and ep={self.ep_size}: megatron's rank order takes one of them > 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size} ({sizes})")

    @classmethod
    def from_config(cls, cfg: GKDConfig, rank: int = 0) -> ParallelLayout:
        """The actor's layout (actor.megatron.tp / .cp / .pp, data parallel over the rest, split over .ep for the
        experts), at global rank `rank`."""
        m = cfg.actor.megatron
        dp = actor_data_parallel_size(cfg)
        return cls(tp_size=m.tp, cp_size=m.cp, ep_size=m.ep, dp_size=dp, pp_size=m.pp, rank=rank)

    def at(self, rank: int) -> ParallelLayout:
        """The same layout as global rank `rank` sees it."""
        return dataclasses.replace(self, rank=rank)

    # ------------------------------------------------------------------------- sizes and coordinates

    def sizes(self) -> dict[str, int]:
        """Each dimension's size, innermost first (RANK_ORDER)."""
        return {name: getattr(self, f"{name}_size") for name in RANK_ORDER}

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes().values())

    def coordinates(self, rank: int | None = None) -> dict[str, int]:
        """Global rank `rank`'s (default: this rank's) coordinate in each dimension, innermost first."""
        rest = self.rank if rank is None else rank
        coords = {}
        for name, size in self.sizes().items():
            rest, coords[name] = divmod(rest, size)
        return coords

    def global_rank(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The global rank at these coordinates (megatron's order)."""
        rank = 0
        for name, coord in reversed(tuple(zip(RANK_ORDER, (tp, cp, dp, pp), strict=True))):
            size = getattr(self, f"{name}_size")
            if not 0 <= coord < size:
                raise ValueError(f"{name} rank {coord} outside {name} size {size}")
            rank = rank * size + coord
        return rank

    def rank_with(self, **coords: int) -> int:
        """The global rank at this rank's coordinates with `coords` changed (e.g. `pp=last`: its last stage)."""
        return self.global_rank(**{**self.coordinates(), **coords})

    @property
    def tp_rank(self) -> int:
        return self.coordinates()["tp"]

    @property
    def cp_rank(self) -> int:
        return self.coordinates()["cp"]

    @property
    def _data_context_rank(self) -> int:
        """The rank over data x context parallel (cp innermost): megatron's expert generator takes cp = 1 and
        counts these ranks as its data parallelism."""
        return self.cp_rank + self.cp_size * self.dp_rank

    @property
    def ep_rank(self) -> int:
        """This rank's place in its expert-parallel group: which num_experts / ep experts it holds."""
        return self._data_context_rank % self.ep_size

    @property
    def expert_dp_size(self) -> int:
        """The ranks holding the same experts (they reduce the experts' gradients together): data x context
        parallel / ep (ep > 1 only with cp = 1)."""
        return self.dp_size * self.cp_size // self.ep_size

    @property
    def expert_dp_rank(self) -> int:
        return self._data_context_rank // self.ep_size

    def expert_owner(self, expert: int, num_experts: int) -> int:
        """The expert-parallel rank holding global expert `expert` (megatron: ep_rank x E/EP + local)."""
        return expert // (num_experts // self.ep_size)

    def local_experts(self, num_experts: int) -> range:
        """The global experts this rank holds, in local order."""
        per_rank = num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)

    @property
    def dp_rank(self) -> int:
        return self.coordinates()["dp"]

    @property
    def pp_rank(self) -> int:
        return self.coordinates()["pp"]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    # ------------------------------------------------------------------------- a sequence over context parallel

    @property
    def cp_chunks(self) -> int:
        """Chunks the zigzag split cuts each (padded) sequence into: 2 x cp, rank r holding chunks r and 2cp-1-r
        (1 at cp = 1: the sequence is not cut, nor padded)."""
        return 2 * self.cp_size if self.cp_size > 1 else 1

    def cp_padded_length(self, tokens: int) -> int:
        """A sequence's length padded for the zigzag split: the next multiple of 2 x cp (unchanged at cp = 1)."""
        return math.ceil(tokens / self.cp_chunks) * self.cp_chunks

    def cp_local_length(self, tokens: int) -> int:
        """The tokens of a `tokens`-long sequence each context-parallel rank holds: two chunks of the padded one."""
        return self.cp_padded_length(tokens) // self.cp_size

    # ------------------------------------------------------------------------- the vocabulary over tensor parallel

    def vocab_shard_size(self, vocab_size: int) -> int:
        """The width of each tensor-parallel rank's logits shard: megatron pads `vocab_size` to split evenly."""
        return padded_vocab_size(vocab_size, self.tp_size) // self.tp_size

    def local_vocab_slice(self, vocab_size: int, used: int | None = None) -> tuple[int, slice]:
        """This rank's first vocabulary id and its columns of ids below `used` (default: the real, unpadded
        vocabulary) in its logits shard, whose width megatron pads from `vocab_size`."""
        shard = self.vocab_shard_size(vocab_size)
        vocab_start = self.tp_rank * shard
        end = vocab_size if used is None else min(used, vocab_size)
        return vocab_start, slice(0, max(0, min(shard, end - vocab_start)))


def data_parallel_rank(cfg: GKDConfig, rank: int) -> int:
    """The data-parallel replica whose shard actor rank `rank` trains on."""
    return ParallelLayout.from_config(cfg, rank).dp_rank
