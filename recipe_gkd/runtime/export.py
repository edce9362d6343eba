"""Export a checkpoint's student as an HF directory, on demand, without a cluster.

    python -m recipe_gkd.runtime.export --run-dir runs/cpu_demo [--checkpoint PATH] --out DIR

Reads the run's resolved_config.yaml, builds one actor process on the CPU (tensor parallel 1:
the dist checkpoint reshards whatever TP size it was saved with), loads the newest complete
checkpoint (or --checkpoint) and writes config, weights and tokenizer to DIR.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from recipe_gkd.config import ConfigError, load_config
from recipe_gkd.plan.ports import reserve_ports
from recipe_gkd.runtime import checkpoint
from recipe_gkd.targets import actor_kinds

# One CPU process with fake placement: enough to hold and reshard the student.
EXPORT_OVERRIDES = (
    "cluster.nnodes=1",
    "cluster.device=cpu",
    "cluster.fake_gpus=true",
    "actor.nnodes=1",
    "actor.gpus_per_node=1",
    "actor.node_offset=0",
    "actor.megatron.tp=1",
    "actor.megatron.pp=1",
    "actor.megatron.cp=1",
    "actor.precision=fp32",
    "actor.micro_batch_size=1",
    "rollout.nnodes=1",
    "rollout.gpus_per_node=1",
    "rollout.node_offset=0",
    "rollout.tp=1",
    "rollout.backend=hf",
    "teacher.location=remote",
    "teacher.autostart=false",
    "cluster.gpus_per_node=2",
    "data.train_batch_size=1",
    "data.eval_batch_size=1",
    "trainer.resume=none",
)


def export(run_dir: Path, out: Path, path: Path | None = None) -> Path:
    """Write the student of checkpoint `path` (default: the newest complete one) to `out`."""
    from recipe_gkd.actor.megatron_actor import MegatronActor
    from recipe_gkd.runtime.model_pins import Reader, on_this_node

    # The run's pinned hub ids (org/name@commit), read from this machine's Hugging Face cache.
    cfg = on_this_node(load_config(run_dir / "resolved_config.yaml", EXPORT_OVERRIDES), Reader.actor)
    chosen = path or _newest(run_dir)
    problem = checkpoint.verify(chosen)
    if problem:
        raise ConfigError("--checkpoint", f"{chosen} is not a complete checkpoint: {problem}")
    actor = MegatronActor(cfg, 0, 1, "127.0.0.1", reserve_ports(1)[0], actor_kinds(cfg))
    try:
        actor.setup()
        actor.load_checkpoint(str(chosen / checkpoint.ACTOR_DIR))
        actor.save_hf(str(out))
    finally:
        actor.shutdown()
    return chosen


def _newest(run_dir: Path) -> Path:
    for candidate in reversed(checkpoint.list_checkpoints(run_dir)):
        if checkpoint.verify(candidate) is None:
            return candidate
    raise ConfigError("--run-dir", f"no complete checkpoint under {checkpoint.checkpoints_root(run_dir)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe_gkd.runtime.export", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--checkpoint", type=Path, default=None, help="a checkpoints/step_N directory")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        chosen = export(args.run_dir, args.out, args.checkpoint)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {chosen} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
