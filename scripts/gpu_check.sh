#!/usr/bin/env bash
# GPU acceptance in one command (also `make gpu-check`): the GPU-only tests (tests/test_gpu.py), a CUDA benchmark
# subset with CUDA memory counters (flex shapes, attention, rollout engines, the 7B layer shape at 4 layers with the
# planner's prediction), and one report, docs/gpu/report.json + report.md.
# Without CUDA it says so and exits 0 having run nothing.
#   scripts/gpu_check.sh [REPORT_DIR]      (default docs/gpu; raw outputs under outputs/gpu)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA device on this machine; nothing was run."
  exit 0
fi
REPORT=${1:-docs/gpu}
RAW=outputs/gpu
mkdir -p "$RAW" "$REPORT"
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -rA --junitxml "$RAW/tests.xml" 2>&1 | tee "$RAW/tests.log"
tests_rc=${PIPESTATUS[0]}
"$PY" -m app.bench.flex_shapes --out "$RAW/flex_shapes" 2>&1 | tee "$RAW/flex_shapes.log"
"$PY" -m app.bench.attention --out "$RAW/attention" 2>&1 | tee "$RAW/attention.log"
# The rollout comparison of the CPU README table, on CUDA: grouped vs HF generate, and vLLM when
# PREFIX_GRPO_VLLM_PYTHON names a Python that has it.
"$PY" -m app.bench.rollout --out "$RAW/rollout" --trials 3 2>&1 | tee "$RAW/rollout.log"
# Real shape: Qwen2.5-VL-7B's layer width, 4 of 28 layers, bf16, 8k and 16k video prefixes, G=8: grouped vs
# repeated step time and CUDA peak memory beside the planner's prediction, and grouped decoding vs HF generate.
"$PY" -m app.bench.gpu_real_shape --out "$RAW/gpu_real_shape" 2>&1 | tee "$RAW/gpu_real_shape.log"
"$PY" -m app.bench.gpu_report "$RAW" "$REPORT"
exit "$tests_rc"
