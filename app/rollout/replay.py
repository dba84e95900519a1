"""rollout.engine=replay: the rollouts a recorded run drew (``rollout.record=true`` there), read back by each
prompt's identity (``app.rollout.base.prompt_identity``: its tokens and media, hashed), its group size and the epoch
it was drawn in. So an A/B run trains on the very same completions for the very same prompts whatever order they
come in (another data.questions_per_video, train.prompts_per_rank or shuffle, another number of ranks), and only
what it varies differs. A prompt the record lacks stops the run with one line naming it.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path

import torch

from app.rollout.base import RolloutEngine, prompt_identity, record_name, sampling_summary
from app.rollout.generate import Rollout
from app.rollout.rows import Rows

RECORD = re.compile(r"^(?P<identity>[0-9a-f]{32})-g(?P<g>\d+)-e(?P<epoch>\d+)-s(?P<seed>-?\d+)\.pt$")


class ReplayError(RuntimeError):
    """The record has no rollout for a prompt, none at all, or was made under other sampling settings."""


def _describe(prompt) -> str:
    record = getattr(prompt, "record", {}) or {}
    where = record.get("_where", "?")
    pid = record.get("problem_id")
    return f"{where}" + (f" (problem_id {pid})" if pid is not None else "")


class ReplayEngine(RolloutEngine):
    name = "replay"

    def __init__(self, folder: str | Path, pad_id: int = 0, sampling=None):
        folder = Path(folder)
        if (folder / "rollouts").is_dir():  # the recorded run's train.output_dir
            folder = folder / "rollouts"
        if not folder.is_dir():
            raise ReplayError(f"rollout.replay_dir {str(folder)!r} is not a folder (a run with rollout.record=true "
                              "writes its rollouts to its train.output_dir/rollouts)")
        self.folder, self.pad_id, self.sampling = folder, pad_id, sampling_summary(sampling)
        self.index: dict[tuple[str, int, int], list[int]] = defaultdict(list)  # (identity, G, epoch) -> seeds
        old = 0
        for entry in os.scandir(folder):
            match = RECORD.match(entry.name)
            if match:
                key = (match["identity"], int(match["g"]), int(match["epoch"]))
                self.index[key].append(int(match["seed"]))
            elif entry.name.endswith(".pt"):
                old += 1
        if not self.index:
            hint = (f"; its {old} file(s) were recorded by an earlier version, by position in the step, which a replay "
                    "no longer trusts: record the run again" if old else "")
            raise ReplayError(f"rollout.replay_dir {str(folder)!r} holds no recorded rollouts (a run with "
                              f"rollout.record=true writes them to its train.output_dir/rollouts){hint}")
        for seeds in self.index.values():
            seeds.sort()
        self.taken: dict[tuple[str, int, int], int] = defaultdict(int)  # several records of one key: taken in turn
        self.checked = False

    def generate(self, prompts, group_size: int, seeds, sampling=None) -> Rollout:  # what was drawn, as drawn
        parts = [self._load(p, group_size, int(s)) for p, s in zip(prompts, seeds)]
        fills = {"completion_ids": self.pad_id, "completion_mask": 0, "logprobs": 0.0}
        rows = Rows.joined([Rows({name: part[name] for name in fills}, fills) for part in parts])
        return Rollout(completion_ids=rows["completion_ids"], completion_mask=rows["completion_mask"],
                       logprobs=rows["logprobs"], group_sizes=[part["completion_ids"].shape[0] for part in parts],
                       stop_reasons=[r for part in parts for r in part["stop_reasons"]],
                       prefill_tokens=round(sum(part["prefill_share"] for part in parts)),
                       prompt_tokens=sum(int(part["prompt_tokens"]) for part in parts))

    def _load(self, prompt, group_size: int, seed: int) -> dict:
        identity, epoch = prompt_identity(prompt), getattr(prompt, "epoch", 0)
        key = (identity, group_size, epoch)
        seeds = self.index.get(key)
        if not seeds:
            raise ReplayError(self._missing(prompt, identity, group_size, epoch))
        if seed in seeds:  # the recorded run's very call (same order): its own record
            chosen = seed
        else:  # the prompt came elsewhere in this run: its record (a record drawn twice in one epoch: in turn)
            chosen = seeds[self.taken[key] % len(seeds)]
            self.taken[key] += 1
        saved = torch.load(self.folder / record_name(identity, group_size, epoch, chosen), weights_only=True)
        self._check_sampling(saved.get("sampling", {}))
        return saved

    def _check_sampling(self, recorded: dict) -> None:
        if self.checked or not self.sampling or not recorded:
            return
        differ = [f"{k}: recorded {recorded[k]!r}, this run {self.sampling[k]!r}" for k in recorded
                  if k in self.sampling and recorded[k] != self.sampling[k]]
        if differ:
            raise ReplayError(f"{self.folder} was recorded under other sampling settings ({'; '.join(differ)}): a "
                              "replay trains on completions drawn from another distribution; use the recorded settings")
        self.checked = True

    def _missing(self, prompt, identity: str, group_size: int, epoch: int) -> str:
        """One line: which prompt, and what the record holds."""
        same = sorted((g, e) for i, g, e in self.index if i == identity)
        prompts = len({i for i, _, _ in self.index})
        epochs = sorted({e for _, _, e in self.index})
        holds = (f"the record holds {sum(len(s) for s in self.index.values())} rollouts of {prompts} prompts "
                 f"(epochs {epochs[0]}-{epochs[-1]}, G={sorted({g for _, g, _ in self.index})})")
        if same:
            where = ", ".join(f"G={g} epoch {e}" for g, e in same[:4])
            why = (f"it was recorded at {where}, not at G={group_size} epoch {epoch} (another rollout.group_size, or "
                   "a replay past the recorded steps)")
        else:
            why = ("no prompt with its tokens and media was recorded (another data file or record, other data.* "
                   "frame, pixel or template settings, or another processor)")
        return f"replay: prompt {_describe(prompt)} is not in {self.folder}: {why}; {holds}"
