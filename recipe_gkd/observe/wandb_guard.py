"""Keep wandb out of the run's worker processes, so that a killed worker leaves nothing in /tmp.

With wandb installed, megatron-core's timers import it (megatron/core/timers.py: `try: import wandb`,
0.16.1), and importing wandb creates two temporary directories (wandb/sdk/data_types/_private.py
MEDIA_TMP `tmp*wandb-media`, wandb/sdk/artifacts/artifact.py `Artifact._TMP_DIR` `tmp*wandb-artifacts`,
wandb 0.31) that only a normal interpreter exit removes. The run kills its Ray workers at the end,
so each worker process left both behind. No worker logs to W&B (the driver's MetricsLogger does,
whatever trainer.loggers says), so none of them needs it.
"""

from __future__ import annotations

import sys


def keep_wandb_out() -> None:
    """In this process, `import wandb` raises ImportError and `importlib.util.find_spec("wandb")` is None.

    A None entry in sys.modules is Python's own way to mark a module absent (the import system raises
    ModuleNotFoundError for it), so libraries that import wandb optionally (megatron's timers,
    transformers' integrations) carry on without it. A process that already imported it keeps it."""
    sys.modules.setdefault("wandb", None)  # type: ignore[arg-type]
