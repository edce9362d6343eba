"""The driver: `python -m recipe_gkd.main [--config PATH] [--dry-run] [key=value ...]`.

With no --config it runs the CPU demo preset (configs/presets/cpu_demo.yaml). A bad config
exits 2 with one line naming the key; --dry-run validates and prints the placement plan and,
for a GPU run, the per-GPU memory plan (recipe_gkd/plan/memory_plan.py, from the models' config.json
only), without starting Ray or any model. A GPU role that does not fit exits 2 naming the key.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recipe_gkd.config import ConfigError, GKDConfig, load_config, to_yaml

# The exit codes and the errors this tool reports itself: recipe_gkd/exit_codes.py (the doctor's too).
from recipe_gkd.exit_codes import (
    EXIT_BAD_CONFIG,
    EXIT_DIVERGED,
    EXIT_HANG,
    EXIT_STOPPED,
    error_line,
    exit_code_for,
)
from recipe_gkd.plan.placement import build_plan, format_plan
from recipe_gkd.preflight import DRY_RUN_CHECKS, START_CHECKS, Check, Status, run_checks


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m recipe_gkd.main", description="On-policy knowledge distillation.")
    parser.add_argument("--config", default=None, help="yaml preset (default: configs/presets/cpu_demo.yaml)")
    parser.add_argument("--dry-run", action="store_true", help="validate, print the placement plan, start nothing")
    parser.add_argument(
        "--doctor", action="store_true", help="every check before the first step, a smoke step, then stop (exit 0/2)"
    )
    parser.add_argument("overrides", nargs="*", help="key.path=value, applied after the yaml")
    return parser.parse_args(argv)


def write_resolved_config(cfg: GKDConfig) -> Path:
    run_dir = Path(cfg.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "resolved_config.yaml"
    path.write_text(to_yaml(cfg))
    return path


def format_run(cfg: GKDConfig) -> str:
    """The run a launch makes (steps, schedule, learning rate, evaluation, checkpoints), in one line."""
    tr = cfg.trainer
    evaluation = (
        f"evaluation every {tr.eval_every} steps on the first {cfg.data.eval_batch_size} records of "
        f"{', '.join(cfg.data.eval_files)}"
        if tr.eval_every
        else "no evaluation (trainer.eval_every=0)"
    )
    checkpoints = (
        f"a checkpoint every {tr.save_every} steps, the last {tr.keep_last} kept in {tr.run_dir}/checkpoints"
        if tr.save_every
        else "no checkpoints (trainer.save_every=0): a stopped run starts again from step 0"
    )
    return (
        f"run: {tr.total_steps} steps, schedule {cfg.algorithm.schedule.value}, lr {cfg.actor.optim.lr:g}; "
        f"{evaluation}; {checkpoints}"
    )


def terminated_line(cfg: GKDConfig) -> str:
    """The one line a run stopped by SIGTERM prints, once its workers and teacher are stopped."""
    from recipe_gkd.runtime.checkpoint import COMPLETE_FILE, list_checkpoints

    # The marker only (written last, after the checksums): verifying every checksum of a GPU run's checkpoint
    # would read tens of GB inside slurm's KillWait.
    complete = [p for p in list_checkpoints(cfg.trainer.run_dir) if (p / COMPLETE_FILE).is_file()]
    kept = (
        f"the last checkpoint {complete[-1]} is kept (the same command resumes from it)"
        if complete
        else "no checkpoint was written (trainer.save_every), a rerun starts from step 0"
    )
    return f"stopped by SIGTERM: the run's workers and teacher are stopped; {kept}"


def preflight(checks: list[Check], cfg: GKDConfig) -> bool:
    """Run `checks` in order (recipe_gkd/preflight.py), printing each report and warning; False at the first error,
    printed as the one line naming the key."""
    for finding in run_checks(checks, cfg):
        if finding.report:
            print(finding.report, flush=True)
        if finding.status == Status.warning:
            print(f"warning: {finding.line}", flush=True)
        if finding.failed:
            print(f"error: {finding.line}", file=sys.stderr)
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.doctor:  # the doctor's own command, with the same arguments
        from recipe_gkd.doctor import main as doctor

        return doctor([*(["--config", args.config] if args.config else []), *args.overrides])
    try:
        cfg = load_config(args.config, args.overrides)
        plan = build_plan(cfg)
        report = format_plan(plan)  # a CUDA_VISIBLE_DEVICES narrower than the plan is a bad config
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    print(report, flush=True)
    print(format_run(cfg), flush=True)
    if args.dry_run:
        # Model references are read where they are (a directory, or the HF cache): nothing is downloaded.
        if not preflight(DRY_RUN_CHECKS, cfg):
            return EXIT_BAD_CONFIG
        print("dry run: config valid, nothing started")
        return 0
    from recipe_gkd.runtime.model_pins import Reader, on_this_node

    try:
        resolve_config_models(cfg)  # hub ids -> org/name@<commit>: each worker resolves the pin on its own node
        local = on_this_node(cfg, Reader.driver)  # what this process checks: the pins in this node's cache
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if not preflight(START_CHECKS, local):
        return EXIT_BAD_CONFIG
    write_resolved_config(cfg)
    from recipe_gkd.gkd import RunDiverged, RunStopped, run
    from recipe_gkd.runtime.stop_signal import EXIT_TERMINATED, RunTerminated, stop_on_sigterm
    from recipe_gkd.runtime.watchdog import PhaseTimeoutError

    stop_on_sigterm()  # before the teacher autostarts: a SIGTERM then stops it too
    try:
        run(cfg, plan)
    except RunTerminated:
        print(terminated_line(cfg), file=sys.stderr, flush=True)
        return EXIT_TERMINATED
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
        print(error_line(err), file=sys.stderr)
        return code
    return 0


def resolve_config_models(cfg: GKDConfig) -> None:
    """Pin every hub id the run's processes read to the commit this node's cache holds (in place); the config the
    workers get carries the pins, each resolves them on its own node (recipe_gkd/runtime/model_pins.py)."""
    from recipe_gkd.runtime.model_pins import pin_models

    pin_models(cfg)


if __name__ == "__main__":
    sys.exit(main())
