"""The checks before a run starts: named checks, each giving one finding, run in order; the first error stops.

`START_CHECKS` run at every start (`python -m recipe_gkd.main`), on the config as this node reads it (model
references pinned and resolved); `DRY_RUN_CHECKS` run with `--dry-run`, where the files may live on another
machine. A check is a function of the config that returns its one-line figure (or a `Finding`, for a warning or a
report to print); a `ConfigError` it raises is its error, naming the key to change.

Adding a check: write the function, wrap it in `Check(name, function)` and put it in the lists that should run it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum

from recipe_gkd.config import ConfigError, GKDConfig, check_local_paths


class Status(StrEnum):
    ok = "ok"
    warning = "warning"
    error = "error"


@dataclass(frozen=True)
class Finding:
    """What one check found: its status, one line (the figure, or what is wrong), the key to change."""

    check: str
    status: Status
    line: str
    key: str | None = None
    # Printed whatever the status (the memory plan's table); "" for most checks.
    report: str = ""

    @property
    def failed(self) -> bool:
        return self.status == Status.error


@dataclass(frozen=True)
class Check:
    """A named check: `run(cfg)` returns its figure line or its Finding; a ConfigError it raises is its error."""

    name: str
    run: Callable[[GKDConfig], str | Finding]

    def finding(self, cfg: GKDConfig) -> Finding:
        from recipe_gkd.actor.hf_arch import UnsupportedModelError

        try:
            result = self.run(cfg)
        except ConfigError as err:
            return Finding(self.name, Status.error, str(err), err.key)
        except UnsupportedModelError as err:
            return Finding(self.name, Status.error, str(err), "model.student_path")
        return result if isinstance(result, Finding) else Finding(self.name, Status.ok, result)


def run_checks(checks: list[Check], cfg: GKDConfig) -> Iterator[Finding]:
    """Each check's finding, in order, up to and including the first error."""
    for check in checks:
        finding = check.finding(cfg)
        yield finding
        if finding.failed:
            return


# ----------------------------------------------------------------------------- the checks


def local_paths(cfg: GKDConfig) -> str:
    check_local_paths(cfg)
    return "the student's and the autostarted teachers' directories exist here"


def environment(cfg: GKDConfig) -> str:
    """rollout.env: one environment built as the rollout workers build theirs, so a tool that cannot run here (the
    python tool's sandbox, rollout.tool_isolation) is refused before the workers start, not in them."""
    if not cfg.rollout.env:
        return "no environment (single-turn rollouts)"
    from recipe_gkd.rollout.multi_turn import environment_factory

    try:
        env = environment_factory(cfg)()
    except ConfigError:
        raise  # a tool's own refusal, naming its key (the python tool's sandbox: rollout.tool_isolation)
    except ValueError as err:  # an unknown name, or a class of one's own that does not import or is no environment
        raise ConfigError("rollout.env", str(err)) from err
    tools = ", ".join(t["function"]["name"] if "function" in t else str(t.get("name")) for t in env.tools())
    return f"the {cfg.rollout.env} environment builds here, with its tools: {tools or 'none'}"


def record_fields(cfg: GKDConfig) -> str:
    from recipe_gkd.data import check_record_fields

    check_record_fields(cfg)
    files = len(cfg.data.train_files) + len(cfg.data.eval_files)
    return f"the first record of each of {files} data files has the fields the run reads"


def record_teachers(cfg: GKDConfig) -> str:
    from recipe_gkd.data import check_record_teachers

    check_record_teachers(cfg)
    return "every record names a configured teacher (or none)"


def student_split(cfg: GKDConfig) -> str:
    """The student's architecture and the actor's TP x PP x EP split fit together (before Ray starts)."""
    from recipe_gkd.actor import hf_arch

    m = cfg.actor.megatron
    arch = hf_arch.read_student_arch(cfg.model.student_path)
    hf_arch.check_split(arch, m.tp, m.pp, m.cp, ep_size=m.ep)
    hf_arch.check_lora_student(arch, cfg.actor.lora.rank)
    lora = f", LoRA rank {cfg.actor.lora.rank}" if cfg.actor.lora.rank else ""
    return f"the student takes actor.megatron tp={m.tp} pp={m.pp} cp={m.cp} ep={m.ep}{lora}"


def teacher_head(cfg: GKDConfig) -> str:
    """What the target kind reads on the actor is there (teacher.output=hidden: the teacher's head, covering the ids
    the student's tokenizer produces), before Ray starts."""
    from recipe_gkd.targets import build_target

    target = build_target(cfg)
    target.check_before_start()
    return f"the target kind {target.name!r} has what it reads on the actor"


def shared_memory(cfg: GKDConfig) -> str:
    from recipe_gkd.plan.memory_plan import object_store_mib
    from recipe_gkd.plan.shm import check_shared_memory

    store = object_store_mib(cfg)
    check_shared_memory(cfg, store)
    return f"/dev/shm holds Ray's object store ({store} MiB) and NCCL's buffers"


def memory_plan(cfg: GKDConfig) -> Finding:
    """The per-GPU memory plan (GPU runs), printed; a role that does not fit is an error with debug.memory_check
    (the default), a warning without."""
    from recipe_gkd.plan.memory_plan import build_memory_plan, check_memory_plan, format_memory_plan

    name = "memory plan"
    memory = build_memory_plan(cfg)  # a ConfigError: cluster.gpu_memory_gib is not this node's GPU
    if memory is None:
        return Finding(name, Status.ok, "no GPU roles to plan (cluster.device=cpu)")
    report = format_memory_plan(memory)
    try:
        check_memory_plan(memory)
    except ConfigError as err:
        status = Status.error if cfg.debug.memory_check else Status.warning
        return Finding(name, status, str(err), err.key, report)
    return Finding(name, Status.ok, "every GPU role fits its share", report=report)


MEMORY_PLAN = Check("memory plan", memory_plan)
START_CHECKS = [
    Check("local paths", local_paths),
    Check("environment", environment),
    Check("record fields", record_fields),
    Check("record teachers", record_teachers),
    Check("student split", student_split),
    Check("teacher head", teacher_head),
    Check("shared memory", shared_memory),
    MEMORY_PLAN,
]
DRY_RUN_CHECKS = [MEMORY_PLAN]
