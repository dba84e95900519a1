"""The rollout-engine interface (``RolloutEngine``), what building one may use (``EngineSetup``), and the adapters
that wrap any engine (``SharedInGroup``, ``Recorded``). The registry is ``app.rollout.registry``."""

from __future__ import annotations

import hashlib
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


def prompt_identity(prompt) -> str:
    """A prompt's identity: its real tokens and every media tensor the processor gave it (pixels, grids, frame
    timing), hashed; the same for the same record encoded with the same settings, whatever the order, the batch or
    data.questions_per_video."""
    inputs = prompt.inputs
    real = inputs["attention_mask"].bool() if "attention_mask" in inputs else None
    digest = hashlib.sha256()
    for key in sorted(inputs):
        value = inputs[key]
        if key == "attention_mask" or not isinstance(value, torch.Tensor):
            continue
        if real is not None and value.shape == real.shape:
            value = value[real]  # per-token tensors: the real tokens, never the padding
        value = value.detach().cpu().contiguous()
        digest.update(f"{key}|{value.dtype}|{tuple(value.shape)}|".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def record_name(identity: str, group_size: int, epoch: int, seed: int) -> str:
    """A recorded prompt's file name: identity, G, the epoch it was drawn in, its sampling seed."""
    return f"{identity}-g{group_size}-e{epoch}-s{int(seed)}.pt"


def sampling_summary(sampling) -> dict:
    """The sampling settings a record must share with its replay (the rollout.* keys that change a sample)."""
    if sampling is None:
        return {}
    return {"rollout.temperature": sampling.temperature, "rollout.top_p": sampling.top_p,
            "rollout.top_k": sampling.top_k, "rollout.max_completion_length": sampling.max_new_tokens,
            "rollout.stop_strings": list(sampling.stop_strings)}


class Recorded(RolloutEngine):
    """``inner`` with every prompt's rollout written to ``folder`` (``rollout.record``), one file per prompt named by
    ``record_name`` (its identity, G, epoch and seed), for a later run with ``rollout.engine=replay``: a replay finds
    each prompt's completions by what the prompt is, not by where it came in the step."""

    def __init__(self, inner: RolloutEngine, folder: str | Path, sampling=None):
        self.inner, self.folder, self.name = inner, Path(folder), inner.name
        self.sampling = sampling_summary(sampling)
        self.folder.mkdir(parents=True, exist_ok=True)

    def generate(self, prompts, group_size, seeds, sampling=None):
        rollout = self.inner.generate(prompts, group_size, seeds, sampling)
        starts = [0, *torch.tensor(rollout.group_sizes).cumsum(0).tolist()]
        lengths = [getattr(p, "length", 0) for p in prompts]
        for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
            a, b = starts[i], starts[i + 1]
            width = max(1, int(rollout.completion_mask[a:b].sum(1).max())) if b > a else 1
            record = getattr(prompt, "record", {}) or {}
            path = self.folder / record_name(prompt_identity(prompt), rollout.group_sizes[i], getattr(prompt, "epoch", 0),
                                             seed)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            torch.save({"completion_ids": rollout.completion_ids[a:b, :width].cpu(),
                        "completion_mask": rollout.completion_mask[a:b, :width].cpu(),
                        "logprobs": rollout.logprobs[a:b, :width].cpu(), "stop_reasons": rollout.stop_reasons[a:b],
                        "prompt_tokens": lengths[i],
                        "prefill_share": rollout.prefill_tokens * lengths[i] / max(1, sum(lengths)),
                        "where": str(record.get("_where", "")), "problem_id": str(record.get("problem_id", "")),
                        "sampling": self.sampling, "seed": int(seed)}, tmp)
            os.replace(tmp, path)  # ranks of one SP group write the same rollout: each replace is whole
        return rollout

    def sync_weights(self, policy) -> int:
        return self.inner.sync_weights(policy)
