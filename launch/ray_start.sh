#!/usr/bin/env bash
# Start Ray on one node of a preset so that Ray sees only that node's actor + rollout GPUs
# (never the teacher's) and carries the node label the driver pins bundles with.
# Where CUDA_VISIBLE_DEVICES is already set (a shared node, SLURM), plan GPU i is its i-th entry
# (recipe_gkd.plan.placement.physical_gpu_ids): Ray gets those devices, never the first ones of the node.
#   head:   launch/ray_start.sh --config PRESET --node-rank 0 --head [--port 6379] [key=value ...]
#   worker: launch/ray_start.sh --config PRESET --node-rank N --address HEAD_IP:6379 [key=value ...]
# key=value overrides are the run's own (the same list start_teacher.sh and run_gkd.sh take): those that shape the
# GPU split (cluster.*, actor.*, rollout.*, teacher.*) change what Ray gets here. server.* keys belong to the
# standalone teacher server (start_teacher.sh) and do not shape the split: they are passed over.
set -euo pipefail
PY=${PYTHON:-python}
CONFIG="" NODE_RANK=0 HEAD=0 ADDRESS="" PORT=6379
OVERRIDES=()
usage="usage: $0 --config PRESET --node-rank N (--head | --address HEAD:PORT) [key=value ...]"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config|--node-rank|--address|--port)
      [[ $# -ge 2 ]] || { echo "$1 needs a value; $usage" >&2; exit 2; } ;;&
    --config) CONFIG=$2; shift 2 ;;
    --node-rank) NODE_RANK=$2; shift 2 ;;
    --head) HEAD=1; shift ;;
    --address) ADDRESS=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    server.*=*) shift ;;
    -*) echo "unknown argument: $1; $usage" >&2; exit 2 ;;
    *=*) OVERRIDES+=("$1"); shift ;;
    *) echo "unknown argument: $1 (an override is key=value); $usage" >&2; exit 2 ;;
  esac
done
[[ -n "$CONFIG" ]] || { echo "$usage" >&2; exit 2; }
PLAN=(--config "$CONFIG" --node-rank "$NODE_RANK")
GPUS=$($PY -m recipe_gkd.plan.placement "${PLAN[@]}" --print ray-gpus "${OVERRIDES[@]}")
RESOURCES=$($PY -m recipe_gkd.plan.placement "${PLAN[@]}" --print ray-resources "${OVERRIDES[@]}")
NUM_GPUS=$(awk -F, '{print ($0 == "" ? 0 : NF)}' <<<"$GPUS")
export CUDA_VISIBLE_DEVICES="$GPUS" RAY_USAGE_STATS_ENABLED=0
echo "node $NODE_RANK: Ray gets GPUs [$GPUS] ($NUM_GPUS), resources $RESOURCES"
if [[ $HEAD == 1 ]]; then
  exec ray start --head --port "$PORT" --num-gpus "$NUM_GPUS" --resources "$RESOURCES"
else
  [[ -n "$ADDRESS" ]] || { echo "--address HEAD:PORT is required on worker nodes" >&2; exit 2; }
  exec ray start --address "$ADDRESS" --num-gpus "$NUM_GPUS" --resources "$RESOURCES"
fi
