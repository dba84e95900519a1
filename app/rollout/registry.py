"""Rollout engines: G completions per prompt as a ``Rollout``, behind one interface, built once from config and used
by training and evaluation alike.

    engine = build_rollout_engine(name, EngineSetup(...))
    engine.sync_weights(policy)                                   # before a rollout: the policy's current weights
    rollout = engine.generate(prompts, group_size, seeds)         # EncodedPrompts, one seed per prompt

| name | module | what samples |
|---|---|---|
| grouped | ``local.py`` | this project's shared-prefill decoder on the policy in this process (one prefill per prompt) |
| hf | ``local.py`` | plain HF ``generate`` on the repeated batch, with the same sampler (the A/B baseline) |
| vllm | ``vllm.py`` | a vLLM engine colocated in this process, given the policy's weights before every rollout |
| replay | ``replay.py`` | the rollouts a recorded run drew (``rollout.record``): an A/B of the training layout alone |

What an engine needs to be correct lives inside it: the ZeRO-3 gather and the agreed vision-tower calls
(``local.py``), the weight push (``vllm.py``). Adapters wrap any engine: ``SharedInGroup`` gives the ranks of a
sequence-parallel group the first rank's rollout (tensor collectives), ``Recorded`` writes every rollout for a later
``replay``. An engine that runs on other ranks (asynchronous rollouts) implements the same two calls, its
``generate`` returning what those ranks drew for these prompts and seeds; one that stops on a tool call and continues
(multi-turn) returns the whole trajectory as the completion.
"""

from __future__ import annotations

from app.rollout.base import EngineSetup, Recorded, RolloutEngine, SharedInGroup, prompt_identity

__all__ = ["BASELINE_ENGINE", "ENGINE_NAMES", "IN_PROCESS", "EngineSetup", "Recorded", "RolloutEngine", "SharedInGroup", "build_rollout_engine",
           "memory_kind", "needs_engine_views", "prompt_identity"]

ENGINE_NAMES = ("grouped", "hf", "vllm", "replay")  # rollout.engine and eval.engine: the one list
BASELINE_ENGINE = "hf"  # what TRL-style trainers sample with (each sample its own copy of the prompt): the A/B's
TRAINING_ONLY = ("replay",)  # engines evaluation cannot use (nothing was recorded for held-out questions)
IN_PROCESS = ("grouped", "hf", "replay")  # engines that sample from the policy's own modules (expert-parallel ones too)
OWN_PROCESSOR = ("vllm",)  # engines that take the unexpanded prompt and the decoded media (EncodedPrompt.engine_view)
# What an engine's rollout holds in GPU memory, for the planner (app/planning/plan.py): shared_prefix (one K/V of each prompt,
# its G samples' own), per_sample (G copies of the prompt's K/V), reserved (a share of the GPU set aside by the
# engine: rollout.vllm_gpu_memory_utilization; asleep during training when rollout.vllm_sleep), none.
MEMORY_KIND = {"grouped": "shared_prefix", "hf": "per_sample", "vllm": "reserved", "replay": "none"}


def memory_kind(name: str) -> str:
    """How engine ``name`` uses GPU memory during a rollout (``MEMORY_KIND``)."""
    if name not in MEMORY_KIND:
        raise ValueError(f"unknown rollout engine {name!r}; expected one of {ENGINE_NAMES}")
    return MEMORY_KIND[name]


def needs_engine_views(name: str) -> bool:
    """Whether the prompts for engine ``name`` must keep their unexpanded ids and media (``engine_views``)."""
    return name in OWN_PROCESSOR


def build_rollout_engine(name: str, setup: EngineSetup) -> RolloutEngine:
    """The engine ``name`` (one of ``ENGINE_NAMES``), built once."""
    if name in ("grouped", "hf"):
        from app.rollout.local import LocalEngine

        return LocalEngine(name, setup)
    if name == "vllm":
        from app.rollout.vllm import VLLMEngine

        return VLLMEngine(setup.model_path, setup.rollout, setup.dtype, max_model_len=setup.max_model_len,
                          seed=setup.seed, device_type=setup.device.type, world=setup.world,
                          sleep_level=setup.sleep_level, sampling=setup.sampling, eos_ids=setup.eos_ids,
                          pad_id=setup.pad_id,
                          record_routing=getattr(setup.rollout, "routing_replay", "off") == "r3")
    if name == "replay":
        from app.rollout.replay import ReplayEngine

        return ReplayEngine(setup.replay_dir, setup.pad_id, setup.sampling)
    raise ValueError(f"unknown rollout engine {name!r}; expected one of {ENGINE_NAMES}")

