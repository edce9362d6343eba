"""A two-node fake Ray cluster, one blocked worker per node, one watchdog dump (run by test_watchdog_nodes.py).

    python tests/support/watchdog_scenario.py RUN_DIR

Prints one JSON line: each worker's node, its stack file, and the dump directory.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep a fake multi-node cluster on loopback

import ray
from ray.cluster_utils import Cluster

from recipe_gkd.runtime.ray_pools import install_watchdog

STORE = 128 * 1024 * 1024


class Blocked:
    def pid(self) -> int:
        return os.getpid()

    def block_in_user_code(self, seconds: float) -> None:
        time.sleep(seconds)


def main() -> None:
    run_dir = Path(sys.argv[1])
    common = {"object_store_memory": STORE, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"head": 1}, "include_dashboard": False, **common},
    )
    cluster.add_node(num_cpus=1, resources={"other": 1}, **common)
    try:
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1")
        actor = ray.remote(num_cpus=0)(Blocked)
        handles = {
            "near": actor.options(resources={"head": 0.01}).remote(),
            "far": actor.options(resources={"other": 0.01}).remote(),
        }
        ray.get([h.pid.remote() for h in handles.values()], timeout=60)
        dog = install_watchdog(handles, str(run_dir), timeout_s=60)
        for h in handles.values():
            h.block_in_user_code.remote(120)
        time.sleep(1.0)  # both are inside block_in_user_code
        out, _ = dog.dump("test phase")
        print(
            json.dumps(
                {
                    "dump_dir": str(out),
                    "driver_node": dog.driver_node,
                    "workers": {n: {"node": w.node, "stack_file": w.stack_file} for n, w in dog.workers.items()},
                }
            ),
            flush=True,
        )
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
