#!/usr/bin/env bash
# SFT (cold start) on one node: the same config, data, DeepSpeed, checkpoints and export as GRPO.
#   scripts/sft.sh CONFIG.yaml [section.key=value ...]
# NPROC_PER_NODE (default 1) processes; paths in the config are relative to the current directory.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
[ $# -ge 1 ] || { echo "usage: $0 CONFIG.yaml [section.key=value ...]" >&2; exit 2; }
NPROC=${NPROC_PER_NODE:-1}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ "$NPROC" -gt 1 ]; then
  exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m app.sft "$@"
fi
exec "$PY" -m app.sft "$@"
