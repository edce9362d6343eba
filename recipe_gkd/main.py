"""The driver: `python -m recipe_gkd.main [--config PATH] [--dry-run] [key=value ...]`.

With no --config it runs the CPU demo preset (configs/presets/cpu_demo.yaml). A bad config
exits 2 with one line naming the key; --dry-run validates and prints the placement plan and,
for a GPU run, the per-GPU memory plan (recipe_gkd/memory_plan.py, from the models' config.json
only), without starting Ray or any model. A GPU role that does not fit exits 2 naming the key.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recipe_gkd.config import ConfigError, GKDConfig, check_local_paths, load_config, to_yaml
from recipe_gkd.placement import build_plan, format_plan
from teacher_server.config import TeacherBackend, TeacherOutput

EXIT_FAILED = 1
EXIT_BAD_CONFIG = 2
# The run stopped on purpose after saving what it could (e.g. the teacher server stayed down).
EXIT_STOPPED = 3
# A phase exceeded debug.hang_timeout_s: the workers' stacks are in <run_dir>/hang_<phase>_<time>/.
EXIT_HANG = 4
# trainer.stop_on_divergence: the objective diverged; the run saved a checkpoint and stopped (docs/divergence.md).
EXIT_DIVERGED = 5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m recipe_gkd.main", description="On-policy knowledge distillation.")
    parser.add_argument("--config", default=None, help="yaml preset (default: configs/presets/cpu_demo.yaml)")
    parser.add_argument("--dry-run", action="store_true", help="validate, print the placement plan, start nothing")
    parser.add_argument("overrides", nargs="*", help="key.path=value, applied after the yaml")
    return parser.parse_args(argv)


def write_resolved_config(cfg: GKDConfig) -> Path:
    run_dir = Path(cfg.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "resolved_config.yaml"
    path.write_text(to_yaml(cfg))
    return path


def check_student_split(cfg: GKDConfig) -> None:
    """The student's architecture and the actor's TP x PP split fit together (before Ray starts)."""
    from recipe_gkd.actor import hf_arch

    m = cfg.actor.megatron
    hf_arch.check_split(hf_arch.read_student_arch(cfg.model.student_path), m.tp, m.pp, m.cp)


def check_teacher_head(cfg: GKDConfig) -> None:
    """teacher.output=hidden: the teacher's head is there and covers the student's vocabulary (before Ray starts)."""
    if cfg.teacher.output != TeacherOutput.hidden:
        return
    from recipe_gkd.actor import hf_arch
    from recipe_gkd.actor.teacher_head import find_teacher_head, tokenizer_size

    student_vocab = hf_arch.read_student_arch(cfg.model.student_path).vocab_size
    find_teacher_head(
        cfg.teacher.model_path, student_vocab, tokenizer_size(cfg.model.tokenizer_path or cfg.model.student_path)
    )


def report_memory_plan(cfg: GKDConfig) -> bool:
    """Print the per-GPU memory plan (GPU runs); False when a role does not fit and debug.memory_check is on."""
    from recipe_gkd.memory_plan import build_memory_plan, check_memory_plan, format_memory_plan

    try:
        memory = build_memory_plan(cfg)
    except ConfigError as err:  # cluster.gpu_memory_gib is not this node's GPU
        print(f"error: {err}", file=sys.stderr)
        return False
    if memory is None:
        return True
    print(format_memory_plan(memory), flush=True)
    try:
        check_memory_plan(memory)
    except ConfigError as err:
        if cfg.debug.memory_check:
            print(f"error: {err}", file=sys.stderr)
            return False
        print(f"warning: {err}", flush=True)
    return True


def exit_code_for(err: BaseException) -> int | None:
    """The exit code of an error whose message is written for the user (naming what to change), else None."""
    from recipe_gkd.actor.hf_arch import UnsupportedModelError
    from recipe_gkd.checkpoint import CheckpointError
    from recipe_gkd.weight_sync import WeightSyncError
    from teacher_server.client import TeacherError, TeacherMismatchError
    from teacher_server.launcher import TeacherLaunchError
    from teacher_server.vllm_version import UnsupportedVLLMError

    cause = getattr(err, "cause", None) or err
    # A teacher that does not fit the run (another tokenizer or vocabulary, top_k or temperature it does not
    # offer), found at connect time before training: the run's inputs are wrong, as with a bad config.
    if isinstance(cause, ConfigError | UnsupportedModelError | TeacherMismatchError):
        return EXIT_BAD_CONFIG
    if isinstance(cause, TeacherError | TeacherLaunchError | WeightSyncError | CheckpointError | UnsupportedVLLMError):
        return EXIT_FAILED
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        plan = build_plan(cfg)
        report = format_plan(plan)  # a CUDA_VISIBLE_DEVICES narrower than the plan is a bad config
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    print(report, flush=True)
    if args.dry_run:
        # Model references are read where they are (a directory, or the HF cache): nothing is downloaded.
        if not report_memory_plan(cfg):
            return EXIT_BAD_CONFIG
        print("dry run: config valid, nothing started")
        return 0
    from recipe_gkd.actor.hf_arch import UnsupportedModelError
    from recipe_gkd.data import check_record_fields, check_record_teachers
    from recipe_gkd.memory_plan import object_store_mib
    from recipe_gkd.shm import check_shared_memory

    try:
        resolve_config_models(cfg)  # hub ids -> their snapshot directories in the HF cache
        check_local_paths(cfg)
        check_record_fields(cfg)
        check_record_teachers(cfg)
        check_student_split(cfg)
        check_teacher_head(cfg)
        check_shared_memory(cfg, object_store_mib(cfg))
    except (ConfigError, UnsupportedModelError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if not report_memory_plan(cfg):
        return EXIT_BAD_CONFIG
    write_resolved_config(cfg)
    from recipe_gkd.gkd import RunDiverged, RunStopped, run
    from recipe_gkd.watchdog import PhaseTimeoutError

    try:
        run(cfg, plan)
    except RunStopped as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_STOPPED
    except RunDiverged as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_DIVERGED
    except PhaseTimeoutError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_HANG
    except Exception as err:
        code = exit_code_for(err)
        if code is None:
            raise  # not an error this tool reports itself: the traceback is the report
        # Ray wraps an error raised in a worker; its cause carries the one-line message.
        print(f"error: {getattr(err, 'cause', None) or err}", file=sys.stderr)
        return code
    return 0


def resolve_config_models(cfg: GKDConfig) -> None:
    """Replace every hub id in the config's model references by its snapshot directory (in place)."""
    from recipe_gkd.config.rules import require_built_asset
    from teacher_server.model_refs import resolve_model_ref

    def resolve(ref: str, key: str) -> str:
        require_built_asset(ref, key)  # a missing repo-built model: the command that builds it, not a hub lookup
        return resolve_model_ref(ref, key)

    cfg.model.student_path = resolve(cfg.model.student_path, "model.student_path")
    cfg.model.tokenizer_path = resolve_model_ref(cfg.model.tokenizer_path, "model.tokenizer_path")
    from recipe_gkd.teachers_config import teacher_key

    sections = [("default", cfg.teacher), *cfg.teachers.items()]  # with teachers:, teacher: is the first one's copy
    for name, section in sections:
        if section.backend != TeacherBackend.openai:
            # backend=openai: the served model's name (or a local tokenizer directory), never downloaded here.
            key = teacher_key(cfg, name, "model_path") if name in cfg.teachers else "teacher.model_path"
            section.model_path = resolve(section.model_path, key)


if __name__ == "__main__":
    sys.exit(main())
