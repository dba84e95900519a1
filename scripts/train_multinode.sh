#!/usr/bin/env bash
# GRPO training across nodes: run once per node with the same CONFIG and overrides.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NPROC_PER_NODE=8 scripts/train_multinode.sh CONFIG.yaml [k=v ...]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
[ $# -ge 1 ] || { echo "usage: $0 CONFIG.yaml [section.key=value ...]" >&2; exit 2; }
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
MASTER_PORT=${MASTER_PORT:-29500}
NPROC=${NPROC_PER_NODE:-1}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -m app.training.preflight "$@"  # the checks that need no weights, once per node, in one line
exec "$PY" -m torch.distributed.run --nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" \
  --master_port "$MASTER_PORT" --nproc_per_node "$NPROC" -m app.training.train "$@"
