"""Actor ranks that train, save or load dist checkpoints, each then training one more step (launched by
test_actor_checkpoint.py; megatron runs here, never in the pytest process).

    python tests/support/checkpoint_scenarios.py --rank R --world W \
        --job PARALLEL,MODEL,CHECKPOINT,MODE,OUT,PORT [--job ...]

Each --job builds its own actor (tp|pp|dp of size W, on MODEL, its process group on PORT) one after the other
in this process, as a run does once: one process per rank serves every scenario of that size (megatron's import
and set-up are most of a rank's cost). `save`: two steps, save to CHECKPOINT, a third step. `load`: load CHECKPOINT,
the third step. Rank 0 writes the third step's loss and lr and the exported HF weights after it to OUT (.npz).
"""

from __future__ import annotations

import argparse

import numpy as np
from megatron_scenarios import make_cfg, rank_shards

from recipe_gkd.targets import actor_kinds

SAVED_STEPS = (1, 2)
NEXT_STEP = 3
# dp: every rank a data-parallel replica, with megatron's distributed optimizer (sharded state).
PARALLEL = ("tp", "pp", "dp")


def run_job(rank: int, world: int, spec: str) -> None:
    parallel, model, checkpoint, mode, out, port = spec.split(",")
    assert parallel in PARALLEL and mode in ("save", "load"), spec
    from recipe_gkd.actor.megatron_actor import MegatronActor

    split: dict[str, object] = {"distributed_optimizer": True} if parallel == "dp" else {parallel: world}
    cfg = make_cfg(model, world, "cpu", **split, micro_batch_size=4, lr=1e-3, warmup_steps=3)
    actor = MegatronActor(cfg, rank, world, "127.0.0.1", int(port), actor_kinds(cfg))
    actor.setup()
    vocab = actor.arch.vocab_size
    if mode == "save":
        for seed in SAVED_STEPS:
            actor.train_step(rank_shards(seed, vocab, actor.layout.dp_rank, actor.layout.dp_size))
        actor.save_checkpoint(checkpoint)
    else:
        actor.load_checkpoint(checkpoint)
    stats = actor.train_step(rank_shards(NEXT_STEP, vocab, actor.layout.dp_rank, actor.layout.dp_size))
    weights = actor.export_hf_state_dict()
    if weights is not None:
        np.savez(out, loss=stats["loss"], lr=stats["lr"], **weights)
    actor.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--job", action="append", required=True, help="PARALLEL,MODEL,CHECKPOINT,MODE,OUT,PORT")
    args = parser.parse_args()
    for spec in args.job:
        run_job(args.rank, args.world, spec)


if __name__ == "__main__":  # dist_checkpointing spawns helpers: without this guard a save hangs
    main()
