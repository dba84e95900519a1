"""The recipes, top to bottom: GRPO (``trainer``), GRPO with tools on prefix trees (``agent``), SFT (``sft``,
``agent_sft``), over one skeleton (``recipe``: model, optimizer, data, checkpoints, the step loop); what a step
carries between its stages (``trajectory``), the policy/old/reference scorers (``scoring``), and the install
self-check (``selfcheck``).

Entry points: ``python -m app.training.train`` (what ``scripts/train.sh`` runs: GRPO, or with tools when
``rollout.tools`` is set), ``app.training.trainer``, ``app.training.sft`` (``scripts/sft.sh``),
``app.training.selfcheck`` (``make selfcheck``).
May import: ``app.common``, ``app.answers``, ``app.grouping``, ``app.runtime``, ``app.data``, ``app.rollout``,
``app.rewards``, ``app.objectives``, ``app.config``.
Exports: none at package level (its modules are entry points).
"""
