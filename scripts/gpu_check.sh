#!/usr/bin/env bash
# GPU acceptance in one command (also `make gpu-check`), within a time budget (default 9 minutes): the 7B LoRA config
# at all 28 layers through train.sh / plan.sh / eval.sh with the rollout's parts, against the TRL-style run and with
# questions sharing a video, the planner beside each; decoding at real width (graph, compiled, eager) against HF
# generate and the bandwidth limit. --parts also names: tests, train, rehearsal, hf_compiled. Each part has
# its own time limit and prints one line of progress; docs/gpu/latest/report.json + report.md are written after every
# part (docs/gpu/report.md indexes the runs).
#   scripts/gpu_check.sh [--quick] [--budget SECONDS] [--parts tests,train,...] [--report DIR] [--raw DIR]
# Without CUDA it says so and exits 0 having run nothing; --quick runs every part here at toy sizes.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m app.bench.gpu.check "$@"
