#!/usr/bin/env bash
# GRPO training on one node.
#   scripts/train.sh CONFIG.yaml [section.key=value ...]
# NPROC_PER_NODE (default 1) processes; paths in the config are relative to the current directory.
# PREFIX_GRPO_RECIPE (default app.training.train: GRPO, with tools when rollout.tools is set) is the Python module run; scripts/sft.sh sets app.training.sft.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
[ $# -ge 1 ] || { echo "usage: $0 CONFIG.yaml [section.key=value ...]" >&2; exit 2; }
NPROC=${NPROC_PER_NODE:-1}
RECIPE=${PREFIX_GRPO_RECIPE:-app.training.train}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ "$NPROC" -gt 1 ]; then
  # the checks that need no weights, once, in one line (a bad setting is not repeated by every rank under torchrun)
  [ "$RECIPE" != app.training.train ] || "$PY" -m app.training.preflight "$@"
  exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m "$RECIPE" "$@"
fi
exec "$PY" -m "$RECIPE" "$@"
