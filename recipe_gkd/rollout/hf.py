"""HF transformers rollout engine: batched sampling with a KV cache (CPU, or a GPU without vLLM).

A LoRA student (actor.lora.rank > 0) keeps the base it loaded and applies each synced adapter version in memory
(`InMemoryAdapter`: forward hooks on the targeted linears).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from recipe_gkd.config import Device, GKDConfig
from recipe_gkd.config.schema import LoRAConfig
from recipe_gkd.models import DENSE, StackedTensor, family_of
from recipe_gkd.rollout.engine import Generation
from recipe_gkd.stop_set import StopSet, student_stop_set
from recipe_gkd.weight_sync.adapter import adapter_modules, adapter_shapes, collect_version, lora_names

if TYPE_CHECKING:
    from recipe_gkd.weight_sync import EngineTensor

# Prompts generated together; bounds the KV cache (batch x (prompt + new tokens) x layers).
GENERATE_CHUNK = 64


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask [B, P], left-padded: every prompt ends at the same column, so
    the tokens `generate` adds line up after it."""
    width = max(len(p) for p in prompts)
    input_ids_BP = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_BP = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids_BP[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attention_BP[i, width - len(p) :] = 1
    return input_ids_BP, attention_BP


def plain_generation_config(
    tokenizer: Any, stop: StopSet, *, greedy: bool, max_new_tokens: int, **sampling: Any
) -> Any:
    """Every setting of one `generate` call; nothing else may shape the distribution.

    Every sequence stops at any id of `stop` (transformers takes a list of eos ids). `sampling`: temperature,
    top_p, top_k (0 = off) when not greedy. Use with :func:`without_model_generation_defaults`, which keeps
    generation_config.json out (its eos ids are in `stop` already).
    """
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=not greedy,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(stop.ids),
        pad_token_id=tokenizer.pad_token_id,
        **({} if greedy else sampling),
    )


@contextmanager
def without_model_generation_defaults(model: Any) -> Iterator[None]:
    """`model.generate` without the model's generation_config.json for the duration.

    transformers fills every setting a call leaves unset from the model's generation config
    (repetition_penalty, no_repeat_ngram_size, bad_words_ids, forced tokens, ...): Qwen2.5-Instruct
    ships repetition_penalty 1.05, so samples and greedy answers would not be the student's own.
    Only transformers' neutral global defaults remain.
    """
    from transformers import GenerationConfig

    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def checkpoint_views(
    named: Iterable[tuple[str, torch.Tensor]], stacked: tuple[StackedTensor, ...]
) -> dict[str, torch.Tensor]:
    """The model's tensors under their checkpoint names (what the actor sends), each a view of the parameter that holds
    it: a parameter stacked over experts (`stacked`, the family's) gives one [rows, cols] slice per expert and part."""
    views: dict[str, torch.Tensor] = {}
    for name, param in named:
        spec = next((s for s in stacked if name.endswith(f".{s.name}")), None)
        if spec is None:
            views[name] = param.detach()
            continue
        prefix = name[: -len(spec.name)]
        for e, expert_RC in enumerate(param.detach()):  # [E, rows, cols] -> expert e's [rows, cols]
            # [rows, cols] -> each part's [rows / len(parts), cols], in the order the checkpoint concatenates them.
            for part, rows_RC in zip(spec.parts, expert_RC.chunk(len(spec.parts), dim=0), strict=True):
                views[prefix + part.format(e=e)] = rows_RC
    return views


class InMemoryAdapter:
    """A LoRA adapter in its sync form over the HF model's own linears (actor.lora.rank > 0): a forward hook on each
    targeted nn.Linear adds B (A x) to its output, scale 1 (the sync form's B carries alpha / rank), so the
    parameters keep their HF names and values. Absent until the first version arrives: the base model, as PEFT's
    B = 0 at initialisation."""

    def __init__(self, model: torch.nn.Module, lora: LoRAConfig) -> None:
        num_layers = int(model.config.get_text_config().num_hidden_layers)
        self.linears = {m: self._linear(model, m) for m in adapter_modules(num_layers, lora.targets)}
        self.shapes = adapter_shapes(
            {m: (lin.out_features, lin.in_features) for m, lin in self.linears.items()}, lora.rank
        )
        first = next(model.parameters())
        self.dtype, self.device = first.dtype, first.device
        self.tensors: dict[str, torch.Tensor] = {}  # PEFT name -> A or B, in the model's dtype, on its device
        self._hooks: list[Any] = []

    @staticmethod
    def _linear(model: torch.nn.Module, module: str) -> torch.nn.Linear:
        linear = model.get_submodule(module)
        if not isinstance(linear, torch.nn.Linear):
            raise ValueError(
                f"actor.lora.targets: the student's {module} is a {type(linear).__name__}, not a linear layer "
                "(LoRA covers dense Llama / Mistral / Qwen decoder layers)"
            )
        return linear

    def load(self, named: Iterator[tuple[str, Any]]) -> set[str]:
        """Take a whole version (checked complete and shaped before anything changes), then hook the linears once."""
        version = collect_version(named, self.shapes)
        # Cast to the model's dtype: exact from bf16 or fp32 into the fp32 model, so B is held as sent.
        self.tensors = {n: t.to(device=self.device, dtype=self.dtype) for n, t in version.items()}
        if not self._hooks:
            self._hooks = [lin.register_forward_hook(self._hook(m)) for m, lin in self.linears.items()]
        return set(version)

    def _hook(self, module: str) -> Any:
        a_name, b_name = lora_names(module)

        def add_adapter(_linear: torch.nn.Module, inputs: tuple[torch.Tensor, ...], out_BTO: torch.Tensor) -> Any:
            # [B, T, in] -> [B, T, rank] -> [B, T, out]; looked up at each call, so a new version applies at once.
            return out_BTO + F.linear(F.linear(inputs[0], self.tensors[a_name]), self.tensors[b_name])

        return add_adapter

    def checksums(self, dtype: str) -> list[EngineTensor]:
        """Each adapter tensor as the hooks compute with it, under its PEFT name, fingerprinted in `dtype`; none
        before the first version."""
        from recipe_gkd.weight_sync import EngineTensor, tensor_checksum

        as_dtype = getattr(torch, dtype)
        return [EngineTensor(n, ((n, 1),), tensor_checksum(t, as_dtype)) for n, t in self.tensors.items()]


class HFEngine:
    """The student as a transformers causal LM, sampling with `generate`."""

    def __init__(self, cfg: GKDConfig) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        path = cfg.model.student_path
        self.device = torch.device("cuda" if cfg.cluster.device == Device.cuda else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device).eval()
        self.stop = student_stop_set(cfg, self.tokenizer)
        # The family's experts stacked by transformers (Qwen3-MoE), else none: the sender names each expert's tensor.
        self._stacked = (family_of(self.model.config.model_type) or DENSE).stacked
        # Every name a sender may use (tied weights under both names) -> the tensor to fill.
        self._params = checkpoint_views(self.model.state_dict(keep_vars=True).items(), self._stacked)
        # Names that must arrive on every update: tied weights count once, as the embedding.
        self.expected = set(checkpoint_views(self.model.named_parameters(), self._stacked))
        # actor.lora.rank > 0: every sync brings the adapter alone, applied over the base loaded above (never synced).
        self.adapter = InMemoryAdapter(self.model, cfg.actor.lora) if cfg.actor.lora.rank > 0 else None

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        greedy: bool,
        seed: int | None = None,
        max_new_tokens: list[int] | None = None,
    ) -> list[Generation]:
        """Responses to `prompts`; with `seed` the sampling is a function of (seed, weights, prompts).

        `max_new_tokens`: each prompt's own limit (multi-turn rollouts: the room its conversation has left).
        """
        if seed is not None:
            torch.manual_seed(seed)  # the rollout process's own generator: nothing else samples here
        limits = max_new_tokens or [self.cfg.rollout.sampling.max_new_tokens] * len(prompts)
        if len(limits) != len(prompts) or min(limits, default=1) < 1:
            raise ValueError(f"max_new_tokens needs one limit >= 1 per prompt, got {limits} for {len(prompts)}")
        out: list[Generation] = []
        for first in range(0, len(prompts), GENERATE_CHUNK):
            chunk = slice(first, first + GENERATE_CHUNK)
            out.extend(self._generate_chunk(prompts[chunk], greedy, limits[chunk]))
        return out

    def _generate_chunk(self, prompts: list[list[int]], greedy: bool, limits: list[int]) -> list[Generation]:
        if not prompts:
            return []
        s = self.cfg.rollout.sampling
        tok = self.tokenizer
        input_ids_BP, attention_BP = left_pad(prompts, tok.pad_token_id)
        width = input_ids_BP.shape[1]
        # top_k=0 disables top-k filtering explicitly: None would fall back to transformers' 50.
        # The chunk runs to its longest limit; each response is cut at its own afterwards (a token sampled at
        # position j does not depend on the tokens after it, so the cut equals a run with that limit).
        config = plain_generation_config(
            tok,
            self.stop,
            greedy=greedy,
            max_new_tokens=max(limits),
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
        )
        config.return_dict_in_generate = True
        config.output_logits = True
        with without_model_generation_defaults(self.model):
            result = self.model.generate(
                input_ids=input_ids_BP.to(self.device),
                attention_mask=attention_BP.to(self.device),
                generation_config=config,
            )
        new_BN = result.sequences[:, width:].cpu()
        # Raw (unprocessed) logits -> logprob of each sampled token under the student itself.
        logits_BNV = torch.stack(result.logits, dim=1).float().cpu()
        logprobs_BN = torch.log_softmax(logits_BNV, dim=-1).gather(-1, new_BN.unsqueeze(-1)).squeeze(-1)
        # rollout.student_top_k: the student's own top ids (of the raw logits; a temperature keeps the order).
        k_s = self.cfg.rollout.student_top_k
        topk_BNS = logits_BNV.topk(k_s, dim=-1).indices if k_s else None
        return [
            self._cut(new_BN[i, : limits[i]], logprobs_BN[i], None if topk_BNS is None else topk_BNS[i])
            for i in range(len(prompts))
        ]

    def _cut(self, new_N: torch.Tensor, logprobs_N: torch.Tensor, topk_NS: torch.Tensor | None) -> Generation:
        """Keep the response up to and including its first stop id (what follows is generate's padding)."""
        length, stop_id = self.stop.end(new_N.tolist())
        topk = None if topk_NS is None else topk_NS[:length].numpy().astype(np.int32)
        return Generation(new_N[:length].tolist(), logprobs_N[:length].numpy().astype(np.float32), topk, stop_id)

    @torch.no_grad()
    def update_weights(self, named: Iterator[tuple[str, Any]]) -> set[str]:
        """Copy each (name, array or tensor) into its parameter; every parameter must arrive."""
        loaded: set[str] = set()
        for name, value in named:
            self._load_one(name, value)
            loaded.add(name)
        missing = {n for n in self.expected - loaded if not self._tied_alias_loaded(n, loaded)}
        if missing:
            raise ValueError(f"weight sync left {len(missing)} tensors stale, e.g. {sorted(missing)[:3]}")
        return loaded

    def _load_one(self, name: str, value: Any) -> None:
        if name not in self._params:
            raise KeyError(f"weight sync sent {name!r}, which the HF rollout model does not have")
        param = self._params[name]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"weight sync: {name} has shape {tuple(value.shape)}, the rollout model {tuple(param.shape)}"
            )
        if isinstance(value, np.ndarray):
            with warnings.catch_warnings():
                # Arrays from Ray's object store are read-only views; they are only read here.
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                value = torch.from_numpy(np.ascontiguousarray(value))
        param.copy_(value)  # casts from the wire dtype (bf16 buckets into an fp32 model)

    def join_weight_group(
        self, backend: str, host: str, port: int, first_rank: int, world_size: int, timeout_s: float
    ) -> None:
        from recipe_gkd.weight_sync import CollectiveChannel

        self.channel = CollectiveChannel(backend, host, port, first_rank, world_size, timeout_s)

    def receive_weights(self) -> set[str]:
        from recipe_gkd.weight_sync import load_draining

        return load_draining(self.channel.receive(), self.update_weights)

    @torch.no_grad()
    def update_adapter(self, named: Iterator[tuple[str, Any]]) -> set[str]:
        """A whole LoRA adapter version in its sync form (recipe_gkd/weight_sync/adapter.py) into the hooks; a version
        missing a tensor, or bringing one of the wrong shape, is refused and the previous one kept."""
        if self.adapter is None:
            raise ValueError("an adapter-only sync reached an engine of a full student (actor.lora.rank=0)")
        return self.adapter.load(named)

    def _tied_alias_loaded(self, name: str, loaded: set[str]) -> bool:
        """True when `name` shares storage with a tensor that was loaded."""
        ptr = self._params[name].data_ptr()
        return any(self._params[other].data_ptr() == ptr for other in loaded)

    @torch.no_grad()
    def token_logprobs(self, input_ids: np.ndarray) -> np.ndarray:
        ids_BL = torch.as_tensor(input_ids, dtype=torch.long, device=self.device)
        logits_BLV = self.model(input_ids=ids_BL).logits.float()
        logprobs_BLV = torch.log_softmax(logits_BLV[:, :-1], dim=-1)
        return logprobs_BLV.gather(-1, ids_BL[:, 1:].unsqueeze(-1)).squeeze(-1).cpu().numpy()

    @torch.no_grad()
    def weight_checksums(self, dtype: str) -> list[EngineTensor]:
        """Each tensor the model computes with under its checkpoint name (a tied head once, as the embedding; each
        expert's slice of a stacked parameter as that expert's tensor), fingerprinted in `dtype`. With actor.lora.rank
        > 0 the adapter's tensors alone: the base, loaded once from model.student_path, is never synced."""
        from recipe_gkd.weight_sync import EngineTensor, tensor_checksum

        if self.adapter is not None:
            return self.adapter.checksums(dtype)

        as_dtype = getattr(torch, dtype)
        views = checkpoint_views(self.model.named_parameters(), self._stacked)
        return [EngineTensor(name, ((name, 1),), tensor_checksum(view, as_dtype)) for name, view in views.items()]


def describe(engine: HFEngine) -> dict[str, Any]:
    return {"params": sum(p.numel() for p in engine.model.parameters()), "device": str(engine.device)}
