"""The rollout-engine interface (``RolloutEngine``), what building one may use (``EngineSetup``), and the adapters
that wrap any engine (``SharedInGroup``, ``Recorded``). The registry is ``app.rollout.registry``."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class EngineSetup:
    """What building an engine may use. ``policy``: the DeepSpeed engine (training) or a plain model (evaluation);
    ``rollout``: the ``rollout.*`` config section (vLLM's settings, ZeRO-3 gather mode, prefill chunking)."""

    policy: Any
    tokenizer: Any
    sampling: Any  # app.rollout.generate.SamplingConfig
    device: torch.device
    eos_ids: list[int]
    pad_id: int
    rollout: Any
    model_path: str = ""
    dtype: str = "float32"
    world: int = 1
    seed: int = 0
    max_model_len: int = 0
    sleep_level: int = 0  # vLLM on a GPU (``vllm.choose_sleep_level``)
    vision_calls: Callable[[dict], Any] | None = None  # batch -> the vision calls every rank makes (ZeRO-3)
    replay_dir: str = ""
    extra: dict = field(default_factory=dict)


class RolloutEngine:
    """The interface. ``generate``: ``group_size`` completions for each prompt, prompt b drawing from ``seeds[b]``
    only (so a sample does not depend on the batch or the rank), under ``sampling`` when given (a multi-turn
    rollout's turn: its own token budget and the tool-call stop), else the engine's own settings.
    ``sync_weights``: make the next rollout sample from ``policy``'s current weights; returns how many tensors were
    sent (0 where the engine samples from the policy itself)."""

    name = "engine"

    def generate(self, prompts: Sequence, group_size: int, seeds: Sequence[int], sampling=None):
        raise NotImplementedError

    def sync_weights(self, policy) -> int:
        return 0


# ---- adapters ----------------------------------------------------------------------------------------------------
class SharedInGroup(RolloutEngine):
    """The ranks of a sequence-parallel group sample the same prompts with the same seeds; this makes sure they
    train on the very same tokens: every rank gets the group's first rank's rollout, through ``share`` (a list of
    tensors -> the first rank's, ``ParallelContext.same_in_group``)."""

    def __init__(self, inner: RolloutEngine, share: Callable[[list[torch.Tensor]], list[torch.Tensor]]):
        self.inner, self.share, self.name = inner, share, inner.name

    def generate(self, prompts, group_size, seeds, sampling=None):
        from app.rollout.generate import shared_rollout

        return shared_rollout(self.inner.generate(prompts, group_size, seeds, sampling), self.share)

    def sync_weights(self, policy) -> int:
        return self.inner.sync_weights(policy)


def rollout_key(group_size: int, seeds: Sequence[int]) -> str:
    """A rollout's name in a record: its group size and prompt seeds (seeds derive from the run's seed, the step,
    the rank, the draw and the position, so they name one call of one run)."""
    return hashlib.sha256(json.dumps([group_size, [int(s) for s in seeds]]).encode()).hexdigest()[:24]


class Recorded(RolloutEngine):
    """``inner`` with every rollout written to ``folder`` (``rollout.record``), named by ``rollout_key``, for a
    later run with ``rollout.engine=replay``."""

    def __init__(self, inner: RolloutEngine, folder: str | Path):
        self.inner, self.folder, self.name = inner, Path(folder), inner.name
        self.folder.mkdir(parents=True, exist_ok=True)

    def generate(self, prompts, group_size, seeds, sampling=None):
        rollout = self.inner.generate(prompts, group_size, seeds, sampling)
        path = self.folder / f"{rollout_key(group_size, seeds)}.pt"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save({"completion_ids": rollout.completion_ids.cpu(), "completion_mask": rollout.completion_mask.cpu(),
                    "logprobs": rollout.logprobs.cpu(), "group_sizes": list(rollout.group_sizes),
                    "stop_reasons": list(rollout.stop_reasons), "prefill_tokens": int(rollout.prefill_tokens),
                    "prompt_tokens": int(rollout.prompt_tokens)}, tmp)
        os.replace(tmp, path)  # ranks of one SP group write the same rollout: each replace is whole
        return rollout

    def sync_weights(self, policy) -> int:
        return self.inner.sync_weights(policy)
