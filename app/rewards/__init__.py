"""Rewards: one float per completion from its text and record (``rules``: format, accuracy per problem type,
plug-ins, the length and temporal bonuses, ``RewardSet``), a model judge that scores a group through the grouping
core's public API (``judge``), and the scoring of published evaluation protocols (``protocols``).

May import: ``app.common``, ``app.answers``, ``app.data``, ``app.runtime`` (the judge's model), and ``app.grouping``
through its package API only (no model internals).
Exports: ``RewardSet``, ``accuracy_of``, ``build_rewards``, ``build_judge``.
"""

from app.rewards.judge import build_judge
from app.rewards.rules import RewardSet, accuracy_of, build_rewards

__all__ = ["RewardSet", "accuracy_of", "build_judge", "build_rewards"]
