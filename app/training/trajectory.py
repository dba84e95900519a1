"""A GRPO step's data as typed containers, handed from stage to stage (no tuples cross a stage boundary).

    Trajectory   one rank's groups for the step: prompts, the rollout, texts, rewards, advantages
    MicroBatch   a view of some of its groups, built once per step: prompts collated and on the device once, the
                 completion rows, their advantages, loss weights and sampling log-probs; the reference and old
                 log-probs are filled in as they are computed and travel inside

Groups are contiguous runs of rows of any sizes; ``app.common.groups.group_slices`` walks them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from app.common.groups import group_slices
from app.data.prompts import collate_prompts
from app.data.records import EncodedPrompt, where
from app.grouping.experts.record import check_routing
from app.grouping.experts.routers import RoutingError
from app.grouping.families import family_sizes
from app.grouping.tree.forward import forest_vision
from app.rollout.generate import Rollout
from app.rollout.rows import completion_rows, prompt_rows, rollout_of, select_groups


@dataclass
class Trajectory:
    """One rank's groups for a step, rolled out and scored."""

    prompts: list[EncodedPrompt]
    rollout: Rollout
    texts: list[str]  # decoded completions, one per row
    accuracy: list[float]  # per completion, scored once (metrics, bonuses and dynamic sampling reuse it)
    rewards: dict[str, list[float]]  # per reward name (and bonus), unweighted, one value per row
    total_reward: torch.Tensor  # [N] weighted sum
    advantages: torch.Tensor | None = None  # [N], set once the step's groups are chosen
    draws: dict[str, float] = field(default_factory=dict)  # counts over every group the step drew (metrics)
    # Multi-turn rollouts: each group is a prefix tree (app.grouping.tree.layout), its rows the paths to its leaves
    # (completion_ids: every path token; completion_mask: the model's own tokens, observations 0)
    trees: list | None = None
    counts: dict[str, float] = field(default_factory=dict)  # per-step counts summed over ranks (tools/*)

    @property
    def group_sizes(self) -> list[int]:
        return list(self.rollout.group_sizes)

    def groups(self) -> list[slice]:
        return group_slices(self.group_sizes)

    @property
    def records(self) -> list[dict]:
        """The record of each row."""
        return [self.prompts[g].record for g, rows in enumerate(self.groups()) for _ in range(rows.stop - rows.start)]

    @classmethod
    def select(cls, trajectories: Sequence[Trajectory], picks: Sequence[tuple[int, int]], pad_id: int) -> Trajectory:
        """The groups ``picks`` = [(trajectory index, group index)] of several, as one trajectory."""
        slices = [t.groups() for t in trajectories]
        rows = [(k, i) for k, g in picks for i in range(slices[k][g].start, slices[k][g].stop)]
        first = trajectories[0]
        return cls(
            prompts=[trajectories[k].prompts[g] for k, g in picks],
            rollout=select_groups([t.rollout for t in trajectories], picks, pad_id),
            texts=[trajectories[k].texts[i] for k, i in rows],
            accuracy=[trajectories[k].accuracy[i] for k, i in rows],
            rewards={name: [trajectories[k].rewards[name][i] for k, i in rows] for name in first.rewards},
            total_reward=(torch.stack([trajectories[k].total_reward[i] for k, i in rows]) if rows
                          else torch.zeros(0)),
            trees=[trajectories[k].trees[g] for k, g in picks] if first.trees is not None else None,
            counts={key: sum(t.counts.get(key, 0.0) for t in trajectories)  # what every draw counted (tools/*)
                    for key in {k for t in trajectories for k in t.counts}},
        )

    def micro_batches(self, groups_per_micro_batch: int, loss_weights: torch.Tensor, pad_id: int,
                      device, share: tuple[int, int] | None = None, replay=None) -> list[MicroBatch]:
        """Views of ``groups_per_micro_batch`` groups each: prompts collated and moved to ``device`` once, for
        every forward of the step (reference, old, self-check, policy), and the rollout's per-row tensors of their
        completions (``app.rollout.rows``: ids, mask, sampling log-probs, routing record); ``share`` = (rank, S)
        under sequence parallelism: only the rank's share of the videos' pixels (what its part of the split tower
        reads). ``replay`` (rollout.routing_replay=r3: the policy's ``ExpertShape``): every micro-batch carries a
        record that covers each of its real tokens, or the step stops here, before any forward, naming the prompt
        and the rank (``experts.record.check_routing``)."""
        slices = self.groups()
        completions, prompts = completion_rows(self.rollout, pad_id), prompt_rows(self.rollout)
        layers = self.rollout.routing.layers if self.rollout.routing is not None else ()
        if replay is not None and self.trees is None and self.rollout.routing is None:  # trees carry their own
            raise RoutingError(f"rollout.routing_replay=r3, but {rank_name()}'s rollout of {where(self.prompts[0].record)}"
                               f"{f' and {len(self.prompts) - 1} more prompt(s)' if len(self.prompts) > 1 else ''} "
                               "carries no routing record: its groups would train without replay")
        out = []
        for first in range(0, len(self.prompts), groups_per_micro_batch):
            groups = list(range(first, min(first + groups_per_micro_batch, len(self.prompts))))
            rows = torch.tensor([i for g in groups for i in range(slices[g].start, slices[g].stop)], dtype=torch.long)
            marked = self.rollout.completion_mask[rows].bool().any(0).nonzero()  # the width keeps every marked token
            width = int(marked.max()) + 1 if len(marked) else 1
            inputs = (collate_prompts([self.prompts[g].inputs for g in groups], pad_id, device, share=share)
                      if self.trees is None else tree_inputs([self.trees[g] for g in groups], device))
            sizes = [slices[g].stop - slices[g].start for g in groups]
            prompt_width = inputs["input_ids"].shape[1] if self.trees is None else 0
            views = rollout_of(completions.take(rows, width).to(device), prompts.take(groups, prompt_width).to(device),
                               layers, group_sizes=sizes, prefill_tokens=0)
            out.append(MicroBatch(
                groups=groups, rows=rows, inputs=inputs,
                completion_ids=views.completion_ids, completion_mask=views.completion_mask, group_sizes=sizes,
                sampled_logprobs=views.logprobs, advantages=self.advantages[rows].to(device),
                loss_weights=loss_weights[rows, :width].to(device),
                families=family_sizes([self.prompts[g].share for g in groups]) if self.trees is None else None,
                routing=views.routing,  # rollout.routing_replay=r3: the record of these groups' tokens
            ))
            if replay is not None and self.trees is None:
                check_routing(views.routing, replay, inputs["attention_mask"], views.completion_mask, group_sizes=sizes,
                              name=lambda g, groups=groups: f"{rank_name()}'s prompt {where(self.prompts[groups[g]].record)}")
        return out


def rank_name() -> str:
    """'rank R' of the run (rank 0 in one process)."""
    import torch.distributed as dist

    return f"rank {dist.get_rank() if dist.is_available() and dist.is_initialized() else 0}"


def tree_inputs(trees: list, device) -> dict:
    """A micro-batch of prefix trees: the trees on the device, and their vision tensors (what the vision-call
    agreement counts)."""
    trees = [t.to(device) for t in trees]
    return {"trees": trees, **forest_vision(trees)}


@dataclass
class MicroBatch:
    """Some groups of a trajectory, ready for a forward: everything on the device, cut to its widest completion."""

    groups: list[int]  # group indices in the trajectory
    rows: torch.Tensor  # completion rows in the trajectory
    inputs: dict  # the groups' prompts, collated (left-padded), on the device
    completion_ids: torch.Tensor  # [n, L]
    completion_mask: torch.Tensor  # [n, L]
    group_sizes: list[int]
    sampled_logprobs: torch.Tensor  # [n, L] the rollout's own log-probs of the sampled tokens
    advantages: torch.Tensor  # [n]
    loss_weights: torch.Tensor  # [n, L] tokens that carry loss (completion mask, overlong filtering applied)
    vision_calls: tuple[str, ...] | None = None  # the vision-tower calls every rank makes in a training forward
    reference_logprobs: torch.Tensor | None = None  # [n, L], when a KL reference is used
    old_logprobs: torch.Tensor | None = None  # [n, L], when mu > 1
    families: list[int] | None = None  # runs of groups whose prompts share a video (data.questions_per_video)
    routing: object = None  # rollout.routing_replay=r3: the rollout's experts of these tokens (experts.record.Routing)

    @property
    def replay(self) -> dict:
        """The forward keyword argument that replays the rollout's routing (none without a record)."""
        return {"routing": self.routing} if self.routing is not None else {}
