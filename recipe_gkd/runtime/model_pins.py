"""Model references on several nodes: the driver pins, every process resolves on its own node.

A hub id resolves to a directory of one node's Hugging Face cache; shipping that path would make a worker on
node 1 open node 0's directory (there only with a shared cache). So:
1. the driver pins each hub id it reads to the commit its cache holds (`Qwen/Qwen3-1.7B@<commit>`, in the config
   every process gets and in resolved_config.yaml);
2. each worker resolves the pins it reads in its own node's cache (cache only: no download per process), right
   before it loads anything; a missing snapshot stops the run with exit 2 naming the key, the node and the command
   that downloads it there.
Local directories pass unchanged (they must exist at the same path on every node that reads them).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from recipe_gkd.config import Device, GKDConfig
from recipe_gkd.config.teachers import teacher_handles
from recipe_gkd.targets import build_target
from teacher_server.config.teacher import TeacherBackend


class Reader(enum.Enum):
    """A process that opens model files: which references it reads decides which must be on its node."""

    driver = "driver"
    actor = "actor"
    rollout = "rollout"


@dataclass(frozen=True)
class ModelRef:
    key: str  # the config key as the user wrote it (teachers.NAME.model_path with several teachers)
    holder: Any  # the config section holding the reference
    attr: str

    @property
    def value(self) -> str:
        return str(getattr(self.holder, self.attr))

    def set(self, value: str) -> None:
        setattr(self.holder, self.attr, value)


def model_refs(cfg: GKDConfig, reader: Reader) -> list[ModelRef]:
    """The model references `reader` opens: the student and its tokenizer always; a teacher's model only where
    that process loads part of it (its head on the actor, its tokenizer across tokenizers, an autostarted server
    on the driver's node). A teacher served elsewhere is resolved by its own server, on its own node."""
    refs = [
        ModelRef("model.student_path", cfg.model, "student_path"),
        ModelRef("model.tokenizer_path", cfg.model, "tokenizer_path"),
    ]
    # With `teachers:`, `teacher:` is the first one's copy: both are kept in step.
    sections = [("teacher.model_path", cfg.teacher)]
    sections += [
        (h.key("model_path"), h.section) for h in teacher_handles(cfg).values() if h.section is not cfg.teacher
    ]
    for key, section in sections:
        # backend=openai: the served model's name (or a local tokenizer directory), never resolved here.
        if section.backend != TeacherBackend.openai and _reads_teacher(cfg, section, reader):
            refs.append(ModelRef(key, section, "model_path"))
    return refs


def _reads_teacher(cfg: GKDConfig, section: Any, reader: Reader) -> bool:
    # The target kind of this teacher's section: its head on the actor (recipe_gkd/targets/hidden.py setup_actor),
    # its tokenizer on the rollout worker across tokenizers (recipe_gkd/cross_tokenizer/route.py); and, in a CPU run
    # with an HF teacher, the rollout worker reads the teacher itself for its held-out accuracy (rollout/worker.py).
    target = build_target(dataclasses.replace(cfg, teacher=section))
    head_on_actor = target.teacher_on_actor
    on_rollout = target.teacher_tokenizer_on_rollout or (
        cfg.cluster.device == Device.cpu and section.backend == TeacherBackend.hf and cfg.trainer.eval_every > 0
    )
    if reader is Reader.actor:
        return head_on_actor
    if reader is Reader.rollout:
        return on_rollout
    return head_on_actor or on_rollout or section.autostart


def pin_models(cfg: GKDConfig) -> None:
    """In place: every hub id a process of the run reads becomes `org/name@<commit>` of this node's cache.
    Raises ConfigError naming the key when a reference is not here (nor downloadable, where the hub is reachable)."""
    from recipe_gkd.config.rules import require_built_asset
    from teacher_server.config.model_refs import pin_model_ref

    for ref in model_refs(cfg, Reader.driver):
        require_built_asset(ref.value, ref.key)  # a missing repo-built model: the command that builds it
        ref.set(pin_model_ref(ref.value, ref.key))


def on_this_node(cfg: GKDConfig, reader: Reader) -> GKDConfig:
    """A copy of `cfg` with the references `reader` opens resolved to directories of this node's cache (cache only).
    Raises ConfigError naming the key, this node and how to download the model here."""
    from teacher_server.config.model_refs import resolve_model_ref

    local = copy.deepcopy(cfg)
    for ref in model_refs(local, reader):
        ref.set(resolve_model_ref(ref.value, ref.key, cache_only=True))
    return local
