"""One actor rank that trains, saves or loads a dist checkpoint, then trains one more step (launched by
test_actor_checkpoint.py; megatron runs here, never in the pytest process).

    python tests/integration/checkpoint_scenarios.py --rank R --world W --port P --model M \
        --checkpoint DIR --mode save|load --out FILE.npz [--parallel tp|pp]

`save`: two steps, save, a third step. `load`: load, the third step. Rank 0 writes the third step's
loss and lr and the exported HF weights after it. The tensor (default) or pipeline parallel size = world.
"""

from __future__ import annotations

import argparse

import numpy as np
from megatron_scenarios import make_cfg, rank_shards

SAVED_STEPS = (1, 2)
NEXT_STEP = 3


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--port"):
        parser.add_argument(name, type=int, required=True)
    for name in ("--model", "--checkpoint", "--mode", "--out"):
        parser.add_argument(name, required=True)
    # dp: every rank a data-parallel replica, with megatron's distributed optimizer (sharded state).
    parser.add_argument("--parallel", choices=("tp", "pp", "dp"), default="tp")
    args = parser.parse_args()
    from recipe_gkd.actor.megatron_actor import MegatronActor

    split: dict[str, object] = {"distributed_optimizer": True} if args.parallel == "dp" else {args.parallel: args.world}
    cfg = make_cfg(args.model, args.world, "cpu", **split, micro_batch_size=4, lr=1e-3, warmup_steps=3)
    actor = MegatronActor(cfg, args.rank, args.world, "127.0.0.1", args.port)
    actor.setup()
    vocab = actor.arch.vocab_size
    if args.mode == "save":
        for seed in SAVED_STEPS:
            actor.train_step(rank_shards(seed, vocab, actor.layout.dp_rank, actor.layout.dp_size))
        actor.save_checkpoint(args.checkpoint)
    else:
        actor.load_checkpoint(args.checkpoint)
    stats = actor.train_step(rank_shards(NEXT_STEP, vocab, actor.layout.dp_rank, actor.layout.dp_size))
    weights = actor.export_hf_state_dict()
    if weights is not None:
        np.savez(args.out, loss=stats["loss"], lr=stats["lr"], **weights)
    actor.shutdown()


if __name__ == "__main__":  # dist_checkpointing spawns helpers: without this guard a save hangs
    main()
