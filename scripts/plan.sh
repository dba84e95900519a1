#!/usr/bin/env bash
# Memory per rank, FLOPs and time per step, and a verdict for a training config, before launching it.
#   scripts/plan.sh CONFIG.yaml [section.key=value ...] [--nodes N] [--gpus-per-node 8] [--gpu-memory-gib 80]
#                   [--peak-tflops 989] [--efficiency 0.4] [--model PRESET|DIR] [--frames N] [--out DIR]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m app.planning.plan "$@"
