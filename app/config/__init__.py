"""Typed configuration: the sections with their help strings and allowed values (``sections``), the checks across
keys (``checks``), YAML loading with ``section.key=value`` overrides and "did you mean" errors, and the generated
reference page (``loading``; ``python -m app.config [--markdown]``).

Config sits above the stages it configures: the allowed values are imported from the code that defines them
(engines, prompt templates, reward rules, loss options), and the recipes import config.
May import: ``app.common``, ``app.answers``, ``app.grouping``, ``app.runtime``, ``app.data``, ``app.rollout``,
``app.rewards``, ``app.objectives``.
Exports: ``Config``, ``ConfigError``, ``load_config``.
"""

from app.config.loading import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "load_config"]
