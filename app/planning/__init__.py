"""Planning a run before launching it: real model shapes from the released configs (``shapes``), the memory and
FLOP formulas (``costs``), the model of a run (``planner``) and the command (``plan``: ``scripts/plan.sh``).

May import: ``app.common``, ``app.grouping``, ``app.runtime``, ``app.data``, ``app.rollout``, ``app.objectives``,
``app.config`` (it reads the trainer's own config).
Exports: none at package level (``plan`` is an entry point).
"""
