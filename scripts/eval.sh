#!/usr/bin/env bash
# Held-out evaluation of a checkpoint.
#   scripts/eval.sh MODEL_DIR DATA.jsonl [section.key=value ...]     e.g. eval.samples=8 eval.temperature=1.0
# NPROC_PER_NODE (default 1) ranks split the questions; rank 0 merges predictions and writes the summary.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
[ $# -ge 2 ] || { echo "usage: $0 MODEL_DIR DATA.jsonl [section.key=value ...]" >&2; exit 2; }
NPROC=${NPROC_PER_NODE:-1}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ "$NPROC" -gt 1 ]; then
  exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m app.evaluation.evaluate "$@"
fi
exec "$PY" -m app.evaluation.evaluate "$@"
