"""Planning a run before launching it: real model shapes from the released configs (``shapes``), the memory and
FLOP formulas (``costs``, ``flops``), the step time by phase with its GPU calibration (``timing``), the model of a
run (``planner``), what to change when it does not fit (``remedies``) and the command (``plan``: ``scripts/plan.sh``).

May import: ``app.common``, ``app.grouping``, ``app.runtime``, ``app.data``, ``app.rollout``, ``app.objectives``,
``app.config`` (it reads the trainer's own config).
Exports: none at package level (``plan`` is an entry point).
"""
