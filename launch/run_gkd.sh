#!/usr/bin/env bash
# Run the driver on the Ray head node: launch/run_gkd.sh --config PRESET [key=value ...]
set -euo pipefail
export RAY_USAGE_STATS_ENABLED=0
exec "${PYTHON:-python}" -m recipe_gkd.main "$@"
