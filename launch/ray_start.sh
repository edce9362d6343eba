#!/usr/bin/env bash
# Start Ray on one node of a preset so that Ray sees only that node's actor + rollout GPUs
# (never the teacher's) and carries the node label the driver pins bundles with.
# Where CUDA_VISIBLE_DEVICES is already set (a shared node, SLURM), plan GPU i is its i-th entry
# (recipe_gkd.placement.physical_gpu_ids): Ray gets those devices, never the first ones of the node.
#   head:   launch/ray_start.sh --config PRESET --node-rank 0 --head [--port 6379]
#   worker: launch/ray_start.sh --config PRESET --node-rank N --address HEAD_IP:6379
set -euo pipefail
PY=${PYTHON:-python}
CONFIG="" NODE_RANK=0 HEAD=0 ADDRESS="" PORT=6379
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) CONFIG=$2; shift 2 ;;
    --node-rank) NODE_RANK=$2; shift 2 ;;
    --head) HEAD=1; shift ;;
    --address) ADDRESS=$2; shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
[[ -n "$CONFIG" ]] || { echo "usage: $0 --config PRESET --node-rank N (--head | --address HEAD:PORT)" >&2; exit 2; }
GPUS=$($PY -m recipe_gkd.placement --config "$CONFIG" --node-rank "$NODE_RANK" --print ray-gpus)
RESOURCES=$($PY -m recipe_gkd.placement --config "$CONFIG" --node-rank "$NODE_RANK" --print ray-resources)
NUM_GPUS=$(awk -F, '{print ($0 == "" ? 0 : NF)}' <<<"$GPUS")
export CUDA_VISIBLE_DEVICES="$GPUS" RAY_USAGE_STATS_ENABLED=0
echo "node $NODE_RANK: Ray gets GPUs [$GPUS] ($NUM_GPUS), resources $RESOURCES"
if [[ $HEAD == 1 ]]; then
  exec ray start --head --port "$PORT" --num-gpus "$NUM_GPUS" --resources "$RESOURCES"
else
  [[ -n "$ADDRESS" ]] || { echo "--address HEAD:PORT is required on worker nodes" >&2; exit 2; }
  exec ray start --address "$ADDRESS" --num-gpus "$NUM_GPUS" --resources "$RESOURCES"
fi
