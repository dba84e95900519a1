#!/usr/bin/env bash
# Plot a run's metrics JSONL to PNG:  scripts/plot_metrics.sh OUTPUT_DIR/metrics.jsonl curves.png
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" -m app.runtime.plots "$@"
