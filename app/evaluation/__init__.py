"""Held-out evaluation of any checkpoint on files in Video-R1's schema, with published protocols as presets
(``configs/eval``): ``evaluate`` (``python -m app.evaluation.evaluate``, what ``scripts/eval.sh`` runs) and
``runs`` (the identity of an evaluation run, so a resumed one never mixes settings) and ``batches`` (a video's
questions to one rank and one batch, decoded and prefilled once).

May import: ``app.common``, ``app.answers``, ``app.grouping``, ``app.runtime``, ``app.data``, ``app.rollout``,
``app.rewards``, ``app.config``.
Exports: none at package level (``evaluate`` is an entry point).
"""
