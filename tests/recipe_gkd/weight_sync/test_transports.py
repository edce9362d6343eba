"""The transports as classes, without Ray: the in-process transport over real rollout workers, what a collective's
group is, and that a payload is one class the transports carry without looking at it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from recipe_gkd.config import WeightSyncConfig, load_config
from recipe_gkd.rollout.worker import RolloutWorker
from recipe_gkd.runtime.local_pools import LocalCrew
from recipe_gkd.targets import build_target
from recipe_gkd.weight_sync import (
    CollectiveChannel,
    FullStudent,
    Gloo,
    GroupAddress,
    InProcess,
    SyncDriver,
    WeightSender,
)

SETTINGS = WeightSyncConfig("object_store", bucket_mb=1, timeout_s=30)


def _named() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    named = {f"model.layers.{i}.mlp.weight": torch.randn(300, 300, generator=generator) for i in range(4)}
    return named | {"model.layers.0.mlp.lora_A.weight": torch.randn(8, 300, generator=generator)}


class CountingActor(WeightSender):
    """The actor's export interface over fixed weights; counts the exports started."""

    rank = 0

    def __init__(self) -> None:
        self.named = _named()
        self.exports = 0

    def iter_hf_tensors(self, on_device: bool, fp32: bool = False) -> Iterator[tuple[str, Any]]:
        self.exports += 1
        yield from self.named.items()


class Engine:
    """A rollout engine's loads, recorded: the full student's and an adapter's."""

    def __init__(self) -> None:
        self.full: dict[str, np.ndarray] = {}
        self.adapter: dict[str, np.ndarray] = {}

    def update_weights(self, named: Iterator[tuple[str, Any]]) -> set[str]:
        self.full.update((name, np.array(value)) for name, value in named)
        return set(self.full)

    def update_adapter(self, named: Iterator[tuple[str, Any]]) -> set[str]:
        self.adapter.update((name, np.array(value)) for name, value in named)
        return set(self.adapter)

    def receive_weights(self) -> set[str]:
        return {"received over the group"}


def _workers(count: int) -> list[RolloutWorker]:
    cfg = load_config(None, [])
    workers = [RolloutWorker(cfg, rank, count, build_target(cfg)) for rank in range(count)]
    for worker in workers:
        worker.engine = Engine()  # type: ignore[assignment]
    return workers


def _in_process(payload: Any, count: int = 3) -> tuple[CountingActor, list[RolloutWorker], SyncDriver]:
    actor, workers = CountingActor(), _workers(count)
    transport = InProcess(SETTINGS, payload)
    actor.init_weight_sync(transport)
    for index, worker in enumerate(workers):
        worker.init_weight_sync(transport, index)
    return actor, workers, SyncDriver(LocalCrew(actor, workers), transport)


def test_in_process_streams_one_export_into_each_worker() -> None:
    actor, workers, sync = _in_process(FullStudent())
    stats = sync.push(4)
    assert set(stats) == {"sync_export_s", "sync_load_s", "sync_bytes"} and min(stats.values()) >= 0
    assert stats["sync_bytes"] == sum(t.numel() * t.element_size() for t in actor.named.values())
    assert actor.exports == len(workers), "one export per worker: nothing holds a second copy of the model"
    for worker in workers:
        assert worker.weight_version == 4
        loaded = worker.engine.full  # type: ignore[union-attr]
        assert list(loaded) == list(actor.named)
        assert all(np.array_equal(loaded[name], actor.named[name].numpy()) for name in actor.named)


class AdapterOnly:
    """A second payload, as a LoRA sync would add it: its own export (the adapter's tensors) and its own engine load."""

    name = "adapter"

    def export(self, actor: Any, on_device: bool) -> Iterator[tuple[str, Any]]:
        return ((n, t) for n, t in actor.iter_hf_tensors(on_device=on_device) if ".lora_" in n)

    def load(self, engine: Any, named: Iterator[tuple[str, Any]]) -> set[str]:
        return engine.update_adapter(named)

    def receive(self, engine: Any) -> set[str]:
        raise AssertionError("not over a group here")


def test_a_payload_is_one_class_the_transport_carries_unread() -> None:
    actor, workers, sync = _in_process(AdapterOnly(), count=2)
    sync.push(1)
    for worker in workers:
        engine = worker.engine
        assert engine.full == {} and list(engine.adapter) == ["model.layers.0.mlp.lora_A.weight"]  # type: ignore[union-attr]
    # The sync check fingerprints what the payload exports, not the whole model.
    assert list(actor.weight_checksums("float32")) == ["model.layers.0.mlp.lora_A.weight"]


def test_a_collective_receives_through_the_payload_and_numbers_its_ranks() -> None:
    group = GroupAddress("127.0.0.1", 1, ranks_per_engine=2, engines=3)  # vLLM engines of rollout.tp=2
    assert group.world_size == 7 and [group.first_rank(i) for i in range(3)] == [1, 3, 5]
    gloo = Gloo(SETTINGS, FullStudent(), group)
    assert gloo.receive(Engine(), None) == {"received over the group"}
    assert gloo.setup_phase == "weight-sync group setup (gloo on 127.0.0.1:1)"


def test_an_unknown_collective_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"weight_sync\.transport='mpi' is not a collective \(gloo or nccl\)"):
        CollectiveChannel("mpi", "127.0.0.1", 1, 0, 2, 1.0)
