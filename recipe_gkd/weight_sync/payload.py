"""What one weight sync carries: a payload strategy, chosen once, owning the actor's export and the engine's load.

A transport (recipe_gkd/weight_sync/transports.py) moves whatever stream of (HF name, tensor) the payload exports on
the actor side and hands what arrives to the payload's load on the engine side; it never looks at the names. Two
payloads: `FullStudent` (every weight) and `AdapterOnly` (actor.lora.rank > 0: the LoRA adapter alone, in its sync
form, recipe_gkd/weight_sync/adapter.py), built by `build_payload` (docs/weight_sync.md, "Adding a transport or a
synced payload").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from recipe_gkd.config import GKDConfig

# (HF name, torch tensor or numpy array) of one weight version, as exported and as loaded.
Named = Iterator[tuple[str, Any]]


class ExportingActor(Protocol):
    """What a payload reads of an actor rank (recipe_gkd/actor/megatron_actor.py MegatronActor)."""

    rank: int

    def iter_hf_tensors(self, on_device: bool, fp32: bool = False) -> Iterator[tuple[str, Any]]:
        """The current weights as (HF name, torch tensor), unit by unit, on global rank 0 only (every rank calls)."""
        ...

    def iter_adapter_tensors(self, on_device: bool) -> Iterator[tuple[str, Any]]:
        """The LoRA adapter in its sync form (PEFT names, B scaled), on global rank 0 only (every rank calls)."""
        ...


class LoadingEngine(Protocol):
    """What a payload calls on a rollout engine (recipe_gkd/rollout/engine.py Engine)."""

    def update_weights(self, named: Named) -> set[str]:
        """Load a whole version from a stream in the rollout process; raise if any tensor is left stale."""
        ...

    def receive_weights(self) -> set[str]:
        """Receive one version over the weight-sync group the engine's own receivers joined, and load it."""
        ...

    def update_adapter(self, named: Named) -> set[str]:
        """Load a whole adapter version (sync form) from a stream; raise if any adapter tensor is missing."""
        ...


class SyncPayload(Protocol):
    """What a weight version is: the stream the actor exports and how a rollout engine loads it."""

    name: str

    def export(self, actor: ExportingActor, on_device: bool) -> Named:
        """Every actor rank calls it (the export gathers over TP); the stream yields on rank 0 only.

        `on_device`: each tensor where it was gathered, in the training dtype (a GPU bucket for an NCCL broadcast
        never visits host memory); else a host copy in the training dtype."""
        ...

    def load(self, engine: LoadingEngine, named: Named) -> set[str]:
        """The engine's load of a whole version streamed into the rollout process; returns the names loaded."""
        ...

    def receive(self, engine: LoadingEngine) -> set[str]:
        """The engine's load of a whole version its own receivers take from the weight-sync group (each TP worker
        of a vLLM engine receives itself); returns the names loaded."""
        ...


class FullStudent:
    """The whole student under its HF names: the actor's export (gathered over TP, later pipeline stages sending
    theirs, one decoder layer at a time) into the engine's in-place load of every tensor.

    The engine refuses a version that leaves a tensor stale (recipe_gkd/rollout/hf.py HFEngine.update_weights,
    recipe_gkd/rollout/vllm.py VLLMEngine._finish)."""

    name = "full student"

    def export(self, actor: ExportingActor, on_device: bool) -> Named:
        return actor.iter_hf_tensors(on_device=on_device)

    def load(self, engine: LoadingEngine, named: Named) -> set[str]:
        return engine.update_weights(named)

    def receive(self, engine: LoadingEngine) -> set[str]:
        return engine.receive_weights()


class AdapterOnly:
    """The LoRA adapter alone (actor.lora.rank > 0): the base weights reached the engines once, at start (they load
    model.student_path); every sync carries the adapter in its sync form, megabytes, into the engine's adapter load
    (vLLM: its LoRA API, reloading the same adapter in place; HF: the adapter applied in memory).

    It travels through the object store (config rule): a collective's receivers live in the engine's workers, while
    the LoRA load is the engine's own call."""

    name = "adapter"

    def export(self, actor: ExportingActor, on_device: bool) -> Named:
        return actor.iter_adapter_tensors(on_device=on_device)

    def load(self, engine: LoadingEngine, named: Named) -> set[str]:
        return engine.update_adapter(named)

    def receive(self, engine: LoadingEngine) -> set[str]:
        raise RuntimeError("an adapter-only sync is not received over a collective group (weight_sync.transport)")


def build_payload(cfg: GKDConfig) -> SyncPayload:
    """The payload of `cfg`'s sync, built once where the pools are built: the adapter with actor.lora.rank > 0,
    else the whole student."""
    return AdapterOnly() if cfg.actor.lora.rank > 0 else FullStudent()
