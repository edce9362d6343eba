"""`python -m teacher_server --config PATH [flags] [key=value ...]`: serve until SIGTERM.

Prints `READY <address> replica_address=<address>` once every replica has loaded and answered a scoring request
(`JOINED <address>` in --join mode). Exit codes: 0 stopped by a signal, 1 a replica failed
to start (its log tail is printed), 2 bad configuration (the message names the key).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from teacher_server.config.errors import ConfigError
from teacher_server.config.teacher import validate_teacher_section
from teacher_server.server.settings import ServerSettings, is_loopback, load_settings, with_port

EXIT_CONFIG = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m teacher_server", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", required=True, help="a run preset (configs/presets/) or a teacher yaml (configs/teacher/)"
    )
    parser.add_argument("--node-rank", type=int, default=0, help="which node of the preset this is (its teacher GPUs)")
    parser.add_argument(
        "--teacher", default="", metavar="NAME", help="a run preset with `teachers:`: serve the teacher NAME"
    )
    parser.add_argument(
        "--gpu-ids",
        default="",
        help="explicit GPU ids, e.g. 4,5,6,7 or the UUIDs of a UUID mask (split by teacher.gpus_per_replica)",
    )
    parser.add_argument("--model-path", default="", help="sets teacher.model_path")
    parser.add_argument("--address", default="", help="sets teacher.address (bind address), e.g. tcp://127.0.0.1:5555")
    parser.add_argument("--port", type=int, default=None, help="replaces the port of teacher.address")
    parser.add_argument("--replicas", type=int, default=None, help="sets teacher.replicas")
    parser.add_argument("--log-dir", default="", help="sets server.log_dir (replica logs)")
    parser.add_argument(
        "--join",
        default="",
        metavar="ADDRESS",
        help="add this node's replicas to the frontend whose replica address is ADDRESS",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides (teacher.*, server.*)")
    return parser.parse_args(argv)


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """The flags as the config keys they set, before any explicit key=value override."""
    out = []
    if args.gpu_ids:
        out.append(f"server.gpu_ids=[{args.gpu_ids}]")
    if args.model_path:
        out.append(f"teacher.model_path={args.model_path}")
    if args.address:
        out.append(f"teacher.address={args.address}")
    if args.replicas is not None:
        out.append(f"teacher.replicas={args.replicas}")
    if args.log_dir:
        out.append(f"server.log_dir={args.log_dir}")
    return out + list(args.overrides)


def check_runnable(settings: ServerSettings, join: str) -> None:
    """What must hold before anything is spawned: a model directory, and a secret for non-loopback binds."""
    from teacher_server.config.model_refs import resolve_model_ref

    t = settings.teacher
    t.model_path = resolve_model_ref(t.model_path, "teacher.model_path")  # a hub id -> its cached snapshot
    if not t.model_path or not Path(t.model_path).is_dir():
        raise ConfigError(
            "teacher.model_path", f"{t.model_path!r} is not a model directory (set teacher.model_path or --model-path)"
        )
    if t.secret_file and not Path(t.secret_file).is_file():
        raise ConfigError("teacher.secret_file", f"no such file {t.secret_file!r}")
    exposed = [a for a in ([join] if join else [t.address, settings.replica_address]) if not is_loopback(a)]
    if exposed and not t.secret_file:
        raise ConfigError(
            "teacher.secret_file",
            f"{exposed[0]} is reachable from other machines: set teacher.secret_file to a file holding a shared "
            "secret (the same file for the server, its replicas and every client)",
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        settings = load_settings(args.config, flag_overrides(args), node_rank=args.node_rank, teacher=args.teacher)
        if args.port is not None:
            settings.teacher.address = with_port(settings.teacher.address, args.port)
            validate_teacher_section(settings.teacher)
        check_runnable(settings, args.join)
    except ConfigError as err:
        print(f"teacher_server: {err}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    from teacher_server.server.supervisor import Supervisor

    return Supervisor(settings, join=args.join).run()


if __name__ == "__main__":
    sys.exit(main())
