"""The driver's side of the weight sync: one class for both pools, over a crew of workers and the run's transport.

`SyncDriver` is the pools' `WeightSync` (recipe_gkd/pools.py): the Ray pools hand it a crew of remote calls
(recipe_gkd/runtime/ray_pools.py RayCrew), the in-process pools one of direct calls (recipe_gkd/runtime/local_pools.py
LocalCrew). It pushes each version through the transport and asks the workers the sync check's questions.
"""

from __future__ import annotations

import numpy as np

from recipe_gkd.weight_sync.check import EngineTensor
from recipe_gkd.weight_sync.transports import SyncCrew, Transport


class SyncDriver:
    """Actor -> rollout weights: one whole version per push through `transport`, and the sync check's fingerprints
    and probe asked of every actor rank and rollout worker at once (recipe_gkd/weight_sync/check.py SyncCheck)."""

    def __init__(self, crew: SyncCrew, transport: Transport) -> None:
        self.crew, self.transport = crew, transport
        self._probe: np.ndarray | None = None

    def push(self, version: int) -> dict[str, float]:
        return self.transport.push(self.crew, version)

    def logprob_probe(self) -> tuple[np.ndarray, list[np.ndarray]]:
        crew = self.crew
        if self._probe is None:
            self._probe = crew.wait(crew.on_rollouts("sync_probe", only=0), "the sync probe")[0]
        actors = crew.on_actors("token_logprobs", self._probe)
        results = crew.wait(actors + crew.on_rollouts("token_logprobs", self._probe), "the sync check's probe")
        return results[0], results[len(actors) :]

    def weight_checksums(self, dtype: str) -> tuple[dict[str, int], list[list[EngineTensor]]]:
        crew = self.crew
        actors = crew.on_actors("weight_checksums", dtype)
        results = crew.wait(actors + crew.on_rollouts("weight_checksums", dtype), "weight checksums")
        return results[0], results[len(actors) :]
