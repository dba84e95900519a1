#!/usr/bin/env bash
# Benchmarks: each prints a table and writes JSON (+ PNG where it plots) under OUT (default outputs/bench/NAME).
#   scripts/bench.sh grid|attention|rollout|decode_step|e2e|flex_shapes|scale|lora|vision_cache|long_video|long_prefill|judge|tree|real_width|hybrid|moe|qsa|qsa_grouping|mismatch|replay|shared_video|long_rehearsal|host_decode|planner_accuracy|planner_calibration|gpu_real_shape|ep|all [--out DIR] [--quick]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
name=${1:-}
shift || true
module_of() {  # benchmark name -> its module (app/bench/; decoding/, video/, gpu/ and planning/ under it)
  case "$1" in
    rollout|decode_step|long_prefill|mismatch) echo "app.bench.decoding.$1" ;;
    gpu_real_shape) echo "app.bench.gpu.real_shape" ;;
    ep) echo "app.bench.parallel.experts" ;;  # expert parallelism against ZeRO-3 alone, 2 processes
    planner_accuracy) echo "app.bench.planning.accuracy" ;;
    planner_calibration) echo "app.bench.planning.calibrate" ;;
    vision_cache|shared_video|long_rehearsal|host_decode) echo "app.bench.video.$1" ;;
    grid|attention|e2e|flex_shapes|scale|lora|long_video|judge|tree|real_width|hybrid) echo "app.bench.$1" ;;
    qsa) echo "app.bench.sparse.qsa" ;;  # QSA indexed attention at real lengths (Qwen3.8-Flash-Next)
    *) return 1 ;;
  esac
}
usage="usage: $0 grid|attention|rollout|decode_step|e2e|flex_shapes|scale|lora|vision_cache|long_video|long_prefill|judge|tree|real_width|hybrid|moe|qsa|qsa_grouping|mismatch|replay|shared_video|long_rehearsal|host_decode|planner_accuracy|planner_calibration|gpu_real_shape|ep|all [--out DIR] [--quick]"
case "$name" in
  moe) exec "$PY" -m app.bench.hybrid --moe "$@" ;;  # the mixture-of-experts families (app/bench/hybrid.py)
  qsa_grouping) exec "$PY" -m app.bench.hybrid --qsa "$@" ;;  # Qwen3.8-Flash-Next grouped vs repeated
  replay) exec "$PY" -m app.bench.decoding.mismatch --replay "$@" ;;  # routing replay off / r3 (MoE)
  all) for n in attention rollout decode_step grid e2e flex_shapes scale lora vision_cache long_video long_prefill judge tree; do "$PY" -m "$(module_of "$n")" "$@"; done ;;
  *) module=$(module_of "$name") || { echo "$usage" >&2; exit 2; }; exec "$PY" -m "$module" "$@" ;;
esac
