"""Let megatron-core 0.16.1 run on CPU over gloo: the one place that knows CUDA is absent.

megatron-core assumes CUDA throughout (~175 `torch.cuda.current_device()` calls, literal
`device="cuda"` tensors in the causal mask, the DDP buffers and the optimizer, a CUDA-only
RNG tracker). `enable_cpu_compat()` makes those harmless, process-wide and for the calling
thread, without touching megatron's source:

1. `torch.cuda.current_device()` returns the CPU device; `torch.cuda.synchronize`,
   `empty_cache` and `manual_seed(_all)` become no-ops (`torch.cuda.is_available()` stays False).
2. A `TorchFunctionMode` rewrites every CUDA device argument (`device="cuda"`, `cuda:0`, a bare
   device index, `Tensor.to(...)`, `Tensor.cuda()`) to the CPU, and names CPU tensor types as
   CUDA ones (`Tensor.type()` -> 'torch.cuda.FloatTensor'), which megatron's optimizer checks.
3. megatron's model-parallel RNG tracker forks the CPU generator instead of the CUDA one, so
   `model_parallel_cuda_manual_seed` and activation recompute's RNG save/restore work unchanged.
4. A mixture of experts (`_patch_moe`): the all-to-all token dispatcher's device-to-host side stream (a
   `torch.cuda.Stream()` built in its `__init__`) is a stand-in that does nothing, its move of the split sizes
   to the host gives them as numpy arrays, as the GPU path does (on CPU megatron's `maybe_move_tensor_to_cpu`
   leaves them tensors, which `all_to_all_single` refuses as split sizes), and the router's gating GEMM takes
   its plain torch path (`te_general_gemm` is undefined without Transformer Engine: NameError).
5. Context parallelism (`_patch_rotary_cp`): the rotary embedding's choice of this CP rank's positions builds
   its index in pinned memory (models/common/embeddings/rope_utils.py get_pos_emb_on_this_cp_rank,
   `pin_memory=True`), which needs CUDA: the same index on the embedding's device.

Dropout is off in every model `hf_convert` builds (HF Llama/Qwen2 fine-tune without it), so no
dropout mask ever depends on the RNG tracker. Call this only when `cluster.device=cpu`.
Torch function modes are thread-local: call it again from every thread that runs megatron
code (it is idempotent and cheap).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

CPU = torch.device("cpu")

_process_patched = False
_patch_lock = threading.Lock()
_thread_state = threading.local()


def enable_cpu_compat() -> None:
    """Make megatron-core run on CPU in this process and thread (idempotent)."""
    global _process_patched
    with _patch_lock:
        if not _process_patched:
            _patch_torch_cuda()
            _patch_megatron_rng_tracker()
            _process_patched = True
    if not getattr(_thread_state, "mode_entered", False):
        # Entered for good: the mode lives as long as the thread (the worker process).
        CudaToCpuMode().__enter__()
        _thread_state.mode_entered = True


def cpu_compat_enabled() -> bool:
    """True when `enable_cpu_compat()` has run in this thread."""
    return bool(getattr(_thread_state, "mode_entered", False))


# ----------------------------------------------------------------------------- torch.cuda


def _noop(name: str) -> Callable[..., None]:
    # One function object per patched name: torch._dynamo's trace rules reject a shared one.
    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    noop.__name__ = noop.__qualname__ = f"cpu_compat_{name}"
    return noop


def _current_device() -> torch.device:
    return CPU


def _patch_torch_cuda() -> None:
    torch.cuda.current_device = _current_device  # type: ignore[assignment]
    # Megatron seeds the CUDA generator next to its tracker; the CPU tracker below seeds its own.
    for name in ("synchronize", "empty_cache", "manual_seed", "manual_seed_all"):
        setattr(torch.cuda, name, _noop(name))


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare index means a CUDA device (`tensor.to(0)`, `device=torch.cuda.current_device()`).
    return isinstance(device, int) and not isinstance(device, bool)


_TENSOR_TO_LIKE: frozenset[Callable[..., Any]] = frozenset({torch.Tensor.to})
_TENSOR_CUDA_LIKE: frozenset[Callable[..., Any]] = frozenset({torch.Tensor.cuda})


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of any torch call to the CPU."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs) if kwargs else {}
        if func in _TENSOR_CUDA_LIKE:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's bf16 optimizer accepts only 'torch.cuda.*Tensor' type names.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = CPU
        if func in _TENSOR_TO_LIKE and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], CPU, *args[2:])
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------- megatron RNG


def _patch_megatron_rng_tracker() -> None:
    """Swap megatron's CUDA RNG tracker class for one that forks the CPU generator."""
    from megatron.core.tensor_parallel import random as mcore_random

    class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
        """megatron's named RNG states (data-parallel, model-parallel, expert) on the CPU generator."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            original = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)

        @contextlib.contextmanager
        def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise KeyError(f"rng state {name} is not added")
            original = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(original)

    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker  # type: ignore[misc]
    # Activation recompute (tensor_parallel.checkpoint) saves and restores "the CUDA generator"
    # around the recomputed forward: on CPU that is the CPU generator (restored once more, harmless).
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    # A tracker built before this patch would still be the CUDA one: rebuild on next use.
    mcore_random.initialize_rng_tracker(force_reset=True)
    _patch_causal_mask()
    _patch_moe()
    _patch_rotary_cp()


def _patch_causal_mask() -> None:
    """The unfused softmax's causal mask (a literal device="cuda") made on the CPU.

    A torch function mode is popped while its own handler runs, so code inside an
    `autograd.Function` it dispatched (recompute's `CheckpointFunction` forward) sees no mode:
    the one CUDA literal reached there, megatron's causal mask, is patched at its import site.
    """
    from megatron.core.fusions import fused_softmax

    def cpu_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, device=CPU), diagonal=1).bool()

    fused_softmax.get_default_causal_mask = cpu_causal_mask


# ----------------------------------------------------------------------------- mixture of experts


class HostStream:
    """Stands in for the token dispatcher's CUDA side stream on CPU: every operation runs on the host, in order."""

    def wait_stream(self, stream: object) -> None:
        return None

    def record_event(self) -> HostStream:
        return self

    def synchronize(self) -> None:
        return None

    def __enter__(self) -> HostStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


HOST_STREAM = HostStream()


def _host_split_sizes(dispatcher: Any, point: str, tokens_per_expert: Any = None) -> Any:
    """megatron-core 0.16.1 MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize on the host: at its
    device-to-host point the split sizes become numpy arrays (GPU: `maybe_move_tensor_to_cpu(..., as_numpy=True)`
    on its side stream); the token counts stay tensors; nothing to synchronise."""
    if not dispatcher.drop_and_pad and point == dispatcher.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(dispatcher, name)
            if torch.is_tensor(value):
                setattr(dispatcher, name, value.numpy())
    return tokens_per_expert


def _patch_moe() -> None:
    """The three places megatron-core 0.16.1's MoE layer needs CUDA or Transformer Engine (module docstring, 4)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher.__init__ builds the stream once per class.
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = HOST_STREAM  # type: ignore[assignment]
    token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _host_split_sizes  # type: ignore[method-assign]
    # transformer/moe/moe_utils.py RouterGatingLinearFunction: `if te_general_gemm is not None` else torch.mm.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- context parallelism


def _rotary_positions_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """megatron-core 0.16.1 rope_utils.get_pos_emb_on_this_cp_rank without pinned memory: chunks cp_rank and
    2 x cp - 1 - cp_rank of 2 x cp along `seq_dim` (recipe_gkd/actor/context_parallel.py's zigzag split)."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])


def _patch_rotary_cp() -> None:
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _rotary_positions_on_this_cp_rank  # type: ignore[assignment]
