#!/usr/bin/env bash
# Two "nodes" on one machine: two torchrun launches with --nnodes=2 and a static rendezvous on the loopback
# address (127.0.0.1 only), NPROC processes each. Usage: scripts/simulate_2node.sh [train args ...]
# Env: PY (python of the venv), NPROC (default 1), MASTER_PORT (default 29511).
set -euo pipefail
PY=${PY:-.venv/bin/python}
NPROC=${NPROC:-1}
MASTER_PORT=${MASTER_PORT:-29511}
launch() {
  "$PY" -m torch.distributed.run --nnodes=2 --node_rank="$1" --nproc_per_node="$NPROC" \
    --master_addr=127.0.0.1 --master_port="$MASTER_PORT" -m train train "${@:2}"
}
launch 1 "$@" > >(sed 's/^/[node 1] /') 2>&1 &
node1=$!
status=0
launch 0 "$@" || status=$?
wait "$node1" || status=$?
exit "$status"
