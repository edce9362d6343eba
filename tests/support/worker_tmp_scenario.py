"""A run's Ray job (recipe_gkd.runtime.ray_cluster, the CPU demo's config) with one worker that imports megatron-core,
killed as the run kills its workers. Prints whether the worker had wandb and its temporary directory.

    python tests/support/worker_tmp_scenario.py RUN_DIR
"""

from __future__ import annotations

import json
import sys
import time

from recipe_gkd.config import load_config
from recipe_gkd.plan.placement import build_plan
from recipe_gkd.runtime.ray_cluster import ray_cluster

TIMEOUT_S = 120.0


class MegatronImporter:
    """What an actor worker does first: import megatron-core (its timers import wandb when they can)."""

    def imports(self) -> tuple[bool, str]:
        import tempfile

        import megatron.core.timers as timers

        return timers.wandb is not None, tempfile.gettempdir()


def main(run_dir: str) -> None:
    cfg = load_config(None, [f"trainer.run_dir={run_dir}", "cluster.ray_num_cpus=1"])
    with ray_cluster(cfg, build_plan(cfg)):
        import ray

        worker = ray.remote(num_cpus=0)(MegatronImporter).remote()
        has_wandb, tmp = ray.get(worker.imports.remote(), timeout=TIMEOUT_S)
        ray.kill(worker)  # as the run ends its workers: no exit handler runs
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                ray.get(worker.imports.remote(), timeout=5)
            except ray.exceptions.RayActorError:
                break
            time.sleep(0.2)
    print(json.dumps({"worker_has_wandb": has_wandb, "worker_tmp": tmp}))


if __name__ == "__main__":
    main(sys.argv[1])
