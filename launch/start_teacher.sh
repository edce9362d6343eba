#!/usr/bin/env bash
# Start the teacher server on this node's teacher GPUs, or add this node's replicas to one.
#   launch/start_teacher.sh --config PRESET [--node-rank N] [--teacher NAME] [key=value ...]   # NAME: of `teachers:`
#   launch/start_teacher.sh --config configs/teacher/X.yaml [--gpu-ids 4,5,6,7] [--model-path DIR] [--port 5555]
#   launch/start_teacher.sh --config PRESET --node-rank 1 --join tcp://HEAD:5556   # add replicas from another node
# Prints `READY <address> replica_address=<addr>` (`JOINED <addr>` with --join) once every replica has loaded and
# answered a real scoring request; exits non-zero with the failing replica's log tail otherwise.
# Serves until SIGTERM, which stops exactly the processes it started.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python}
if [[ $# -eq 0 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  exec "$PY" -m teacher_server --help
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# A run preset: the trainer's placement plan gives this node's teacher GPUs (--gpu-ids), and keys
# other than teacher.* / server.* shape that plan only. A teacher yaml passes through unchanged.
ARGV=$("$PY" -m recipe_gkd.plan.placement teacher-argv "$@") || exit $?
mapfile -t SERVER_ARGS <<< "$ARGV"
exec "$PY" -m teacher_server "${SERVER_ARGS[@]}"
