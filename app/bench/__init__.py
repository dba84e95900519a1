"""Benchmark code behind scripts/bench.sh and scripts/gpu_check.sh: tables on stdout, JSON and PNG plots in an
output folder. ``gpu/``: the GPU acceptance; ``decoding/``: rollout and decoding benchmarks; the rest: attention,
the grouped forward at toy and real widths, the planner's grid, end-to-end steps, scaling, LoRA, long videos, the
judge, prefix trees, the vision cache.

May import: everything in ``app``.
Exports: none (each module is an entry point).
"""
