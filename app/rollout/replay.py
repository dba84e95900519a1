"""rollout.engine=replay: the rollouts a recorded run drew (``rollout.record=true`` there), read back by their
prompt seeds (``app.rollout.registry.rollout_key``), so an A/B run trains on the very same completions and only what it
varies (the training layout, say) differs. It needs the recorded run's config, data, seed and world."""

from __future__ import annotations

from pathlib import Path

import torch

from app.rollout.base import RolloutEngine, rollout_key
from app.rollout.generate import Rollout


class ReplayError(RuntimeError):
    """The record has no rollout for a call, or none at all."""


class ReplayEngine(RolloutEngine):
    name = "replay"

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        if (folder / "rollouts").is_dir():  # the recorded run's train.output_dir
            folder = folder / "rollouts"
        if not folder.is_dir() or not any(folder.glob("*.pt")):
            raise ReplayError(f"rollout.replay_dir {str(folder)!r} holds no recorded rollouts (a run with "
                              "rollout.record=true writes them to its train.output_dir/rollouts)")
        self.folder = folder

    def generate(self, prompts, group_size: int, seeds, sampling=None) -> Rollout:  # what was drawn, as drawn
        path = self.folder / f"{rollout_key(group_size, seeds)}.pt"
        if not path.is_file():
            raise ReplayError(f"{self.folder} has no rollout for these {len(prompts)} prompt(s) (G={group_size}, "
                              f"seeds {list(seeds)[:2]}...): replay needs the recorded run's config, data, seed and "
                              "number of ranks, and no more steps than it ran")
        saved = torch.load(path, weights_only=True)
        return Rollout(completion_ids=saved["completion_ids"], completion_mask=saved["completion_mask"],
                       logprobs=saved["logprobs"], group_sizes=list(saved["group_sizes"]), stop_reasons=list(saved["stop_reasons"]),
                       prefill_tokens=int(saved["prefill_tokens"]), prompt_tokens=int(saved.get("prompt_tokens", 0)))
