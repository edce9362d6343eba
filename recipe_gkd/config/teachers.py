"""Several teachers in one run: the `teachers:` map, its rules and each record's teacher (docs/teachers.md).

A config with only `teacher:` has one teacher, named `default`. With `teachers:` (name -> a teacher
section, everything `teacher:` holds), the loader fills `teacher:` from the first teacher: the trainer's
side reads only what every teacher must share there (top_k, temperature), while the servers, the
clients and the placement use each teacher's own section through `teacher_views`.

A record names its teacher in the field `data.teacher_key`; a record without it goes to
`data.default_teacher` (empty: the first teacher). A record naming no configured teacher stops the run.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from recipe_gkd.config.schema import GKDConfig
from recipe_gkd.teacher_prompt import TeacherPrompt, prompt_rule
from teacher_server.config.errors import ConfigError
from teacher_server.config.fields import require
from teacher_server.config.teacher import TeacherConfig, TeacherLocation

DEFAULT_TEACHER = "default"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")
# What the trainer reads from `teacher:`: every teacher must agree on these.
SHARED_FIELDS = ("top_k", "temperature")


def teacher_sections(cfg: GKDConfig) -> dict[str, TeacherConfig]:
    """Teacher name -> its section, in config order (`default` -> `teacher:` without `teachers:`)."""
    return dict(cfg.teachers) if cfg.teachers else {DEFAULT_TEACHER: cfg.teacher}


def teacher_names(cfg: GKDConfig) -> list[str]:
    return list(teacher_sections(cfg))


def default_teacher(cfg: GKDConfig) -> str:
    """The teacher of a record without data.teacher_key."""
    return cfg.data.default_teacher or teacher_names(cfg)[0]


def teacher_views(cfg: GKDConfig) -> dict[str, GKDConfig]:
    """Teacher name -> the run's config with `teacher:` set to that teacher's section (and no `teachers:`):
    what a single-teacher client or autostarted server reads."""
    if not cfg.teachers:
        return {DEFAULT_TEACHER: cfg}
    return {
        name: dataclasses.replace(cfg, teacher=section, teachers={})  # type: ignore[type-var]
        for name, section in cfg.teachers.items()
    }


def teacher_key(cfg: GKDConfig, name: str, field: str) -> str:
    """The dotted config key of `field` of teacher `name`, as the user wrote it."""
    return f"teachers.{name}.{field}" if cfg.teachers else f"teacher.{field}"


@dataclass(frozen=True)
class TeacherHandle:
    """One teacher of the run, with everything that names it; a run with only `teacher:` holds one, `default`.

    The names are what users and tests read, exactly as before: keys `teacher.X` for `teacher:` and
    `teachers.NAME.X` under `teachers:` (with its own log and resolved-config files), and per-teacher metric
    columns (`teacher_NAME_loss`, ...) and teacher-named errors only in a set of several.
    """

    name: str
    section: TeacherConfig
    # The dotted prefix of its keys: "teacher" or "teachers.NAME".
    key_prefix: str
    # Its part of file and log names: "" or ".NAME" (teacher_server.NAME.log, resolved_config.NAME.yaml).
    file_suffix: str
    # Its replicas' log directory in the run directory: "teacher_logs" or "teacher_logs/NAME".
    replica_logs: str
    # How messages and the plan call it: "the teacher" / "teacher 'NAME'", "teacher" / "teacher NAME".
    who: str
    label: str
    # Prefixed to its errors' messages (several teachers: "teacher 'NAME': "), else "".
    error_prefix: str
    # Its per-teacher metric columns (`teacher_NAME_...`, several teachers), else None.
    metric_prefix: str | None
    # Its name in the rows' sample_teachers column (None for the default teacher).
    row_name: str | None
    # What it is prompted with per record: the student's prompt, or its own (privileged context; teacher_prompt.py).
    prompt: TeacherPrompt

    def key(self, field: str) -> str:
        """The dotted config key of its `field`, as the user wrote it."""
        return f"{self.key_prefix}.{field}"

    @property
    def address(self) -> str:
        return self.section.address

    @property
    def log_name(self) -> str:
        """Its autostarted server's log in the run directory."""
        return f"teacher_server{self.file_suffix}.log"

    @property
    def server(self) -> str:
        """How the driver's lines call its server ("teacher server", "teacher 'NAME' server")."""
        return f"{self.who.removeprefix('the ')} server"


def teacher_handles(cfg: GKDConfig) -> dict[str, TeacherHandle]:
    """Teacher name -> its handle, in config order: the one place that tells one teacher's names from several."""
    named, several = bool(cfg.teachers), len(cfg.teachers) >= 2
    return {
        name: TeacherHandle(
            name=name,
            section=section,
            key_prefix=f"teachers.{name}" if named else "teacher",
            file_suffix=f".{name}" if named else "",
            replica_logs=f"teacher_logs/{name}" if named else "teacher_logs",
            who=f"teacher {name!r}" if named else "the teacher",
            label=f"teacher {name}" if named else "teacher",
            error_prefix=f"teacher {name!r}: " if several else "",
            metric_prefix=f"teacher_{name}_" if several else None,
            row_name=None if name == DEFAULT_TEACHER else name,
            prompt=prompt_rule(cfg.data, section, f"teachers.{name}" if named else "teacher"),
        )
        for name, section in teacher_sections(cfg).items()
    }


def chosen_teacher(cfg: GKDConfig, name: str | None) -> TeacherHandle | None:
    """The teacher a launch's `--teacher NAME` picks: any name picks the one of `teacher:`; under `teachers:`
    the one named (None: none is)."""
    handles = teacher_handles(cfg)
    if not cfg.teachers:
        return handles[DEFAULT_TEACHER]
    return handles.get(name) if name is not None else None


def split_teachers(cfg: GKDConfig) -> list[str]:
    """The teachers with their own metric columns (a set of several), sorted; empty for a set of one."""
    return sorted(name for name, h in teacher_handles(cfg).items() if h.metric_prefix is not None)


@contextmanager
def keys_of(cfg: GKDConfig, name: str) -> Iterator[None]:
    """Re-raise a ConfigError about `teacher.X` (a single-teacher rule run on a view) as `teachers.NAME.X`."""
    try:
        yield
    except ConfigError as err:
        if not cfg.teachers or not err.key.startswith("teacher."):
            raise
        field = err.key.removeprefix("teacher.")
        raise ConfigError(teacher_key(cfg, name, field), err.message.replace("teacher.", f"teachers.{name}.")) from None


def resolve_teachers(cfg: GKDConfig) -> None:
    """With `teachers:`, fill `teacher:` from the first teacher (before validation).

    `teacher:` must then be left out (a resolved config, where it equals the first teacher, reloads too).
    """
    if not cfg.teachers:
        return
    first = next(iter(cfg.teachers.values()))
    require(
        cfg.teacher in (TeacherConfig(), first),
        "teacher",
        "is set beside `teachers:`: move it into `teachers:` under a name (a run has `teacher:` or `teachers:`)",
    )
    cfg.teacher = dataclasses.replace(first)


def validate_teachers(cfg: GKDConfig) -> None:
    """The rules of the teacher set (each section's own rules run per view in config._validate_teacher)."""
    names = teacher_names(cfg)
    for name in names:
        require(
            bool(NAME_PATTERN.fullmatch(name)),
            f"teachers.{name}",
            "a teacher name is 1-32 letters, digits, '_' or '-', starting with a letter or digit",
        )
    require(bool(cfg.data.teacher_key), "data.teacher_key", "is empty: name the record field that holds its teacher")
    require(
        not cfg.data.default_teacher or cfg.data.default_teacher in names,
        "data.default_teacher",
        f"is {cfg.data.default_teacher!r}, not one of the configured teachers {names}",
    )
    sections = teacher_sections(cfg)
    first_name, first = names[0], sections[names[0]]
    for name, section in sections.items():
        for field in SHARED_FIELDS:
            require(
                getattr(section, field) == getattr(first, field),
                f"teachers.{name}.{field}",
                f"is {getattr(section, field)} but teachers.{first_name}.{field} is {getattr(first, field)}: the "
                "student trains on one top-k size at one temperature, so every teacher must use the same",
            )
    bound: dict[str, str] = {}
    for name, section in sections.items():
        # Each local teacher is its own server: two cannot bind one address (port 0: each binds a free one).
        if section.location == TeacherLocation.local and not section.address.endswith(":0"):
            require(
                section.address not in bound,
                f"teachers.{name}.address",
                f"is {section.address}, the address of teacher {bound.get(section.address)!r} too: give each "
                "teacher its own port",
            )
            bound[section.address] = name


def teacher_gpu_count(section: TeacherConfig) -> int:
    """GPUs a local teacher takes from the cluster (0 for a remote one)."""
    return section.replicas * section.gpus_per_replica if section.location == TeacherLocation.local else 0


def local_teacher_gpus(cfg: GKDConfig) -> int:
    """GPUs all local teachers take together."""
    return sum(teacher_gpu_count(s) for s in teacher_sections(cfg).values())


def autostarted_replicas(cfg: GKDConfig) -> int:
    """Teacher server replicas the driver starts (processes on a CPU run)."""
    return sum(s.replicas for s in teacher_sections(cfg).values() if s.autostart)


def records_name_teachers(cfg: GKDConfig) -> bool:
    """Whether records are routed by data.teacher_key (`teachers:`); with `teacher:` that field is not read."""
    return bool(cfg.teachers)


def record_teacher(cfg: GKDConfig, record: dict[str, Any], where: str) -> str:
    """The teacher of `record` (`where`: the file and record, for the error).

    Without `teachers:` every record goes to the one teacher and data.teacher_key is not read (a
    dataset that happens to have such a field trains as before)."""
    if not cfg.teachers:
        return DEFAULT_TEACHER
    value = record.get(cfg.data.teacher_key)
    if value is None:
        return default_teacher(cfg)
    if not isinstance(value, str) or value not in teacher_sections(cfg):
        raise ConfigError(
            "data.teacher_key",
            f"{where} names teacher {value!r} in field {cfg.data.teacher_key!r}, not one of the configured "
            f"teachers {teacher_names(cfg)}: fix the record or add that teacher under `teachers:`",
        )
    return value
