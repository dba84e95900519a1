#!/usr/bin/env bash
# SFT (cold start) on one node: the same config, data, DeepSpeed, checkpoints and export as GRPO.
#   scripts/sft.sh CONFIG.yaml [section.key=value ...]
# NPROC_PER_NODE (default 1) processes; the launch is scripts/train.sh's, running the SFT recipe (app.training.sft).
PREFIX_GRPO_RECIPE=app.training.sft exec "$(dirname "$0")/train.sh" "$@"
