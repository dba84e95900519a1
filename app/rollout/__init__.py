"""Rollouts: G completions per prompt, behind one engine interface, built once from config and used by training and
evaluation alike (``registry``: the engines by name; ``base``: the interface and its adapters).

- ``generate``: the grouped decoder (one prefill per prompt, grouped decode steps, CUDA-graph steps on GPU) and HF
  generate for the A/B (``generate_groups``);
- ``sampling``: what a rollout draws with, one random stream per sample;
- ``local``, ``vllm``, ``replay``: the engines; ``multiturn``: tool-calling rollouts as prefix trees;
- ``tools``: the tools a multi-turn rollout may call.

May import: ``app.common``, ``app.grouping``, ``app.runtime``, ``app.data``.
Exports: ``ENGINE_NAMES``, ``EngineSetup``, ``RolloutEngine``, ``build_rollout_engine``, ``Rollout``,
``SamplingConfig``, ``generate_groups``.
"""

from app.rollout.generate import Rollout, generate_groups
from app.rollout.registry import ENGINE_NAMES, EngineSetup, RolloutEngine, build_rollout_engine
from app.rollout.sampling import SamplingConfig

__all__ = ["ENGINE_NAMES", "EngineSetup", "Rollout", "RolloutEngine", "SamplingConfig", "build_rollout_engine",
           "generate_groups"]
