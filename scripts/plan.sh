#!/usr/bin/env bash
# Memory per rank, FLOPs and time per step, and a verdict for a training config, before launching it.
#   scripts/plan.sh CONFIG.yaml [section.key=value ...] [--nodes N] [--gpus-per-node 8] [--gpu-memory-gib 80]
#                   [--peak-tflops 989] [--bandwidth-tbs 3.35] [--calibration KEY=VALUE ...] [--model PRESET|DIR]
#                   [--frames N] [--video-size WxH] [--host-memory-gib 2048] [--no-varlen-kernel] [--out DIR]
#   (scripts/plan.sh --help lists every flag)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m app.planning.plan "$@"
