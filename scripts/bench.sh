#!/usr/bin/env bash
# Benchmarks: each prints a table and writes JSON (+ PNG where it plots) under OUT (default outputs/bench/NAME).
#   scripts/bench.sh grid|attention|rollout|decode_step|e2e|flex_shapes|scale|lora|vision_cache|long_video|long_prefill|judge|tree|real_width|gpu_real_shape|all [--out DIR] [--quick]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
name=${1:-}
shift || true
case "$name" in
  grid|attention|rollout|decode_step|e2e|flex_shapes|scale|lora|vision_cache|long_video|long_prefill|judge|tree|real_width|gpu_real_shape) exec "$PY" -m "app.bench.$name" "$@" ;;
  all) for n in attention rollout decode_step grid e2e flex_shapes scale lora vision_cache long_video long_prefill judge tree; do "$PY" -m "app.bench.$n" "$@"; done ;;
  *) echo "usage: $0 grid|attention|rollout|decode_step|e2e|flex_shapes|scale|lora|vision_cache|long_video|long_prefill|judge|tree|real_width|gpu_real_shape|all [--out DIR] [--quick]" >&2; exit 2 ;;
esac
