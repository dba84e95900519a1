"""A rollout's per-row tensors, and the one way they are padded, cut, selected, joined and gathered.

A rollout is rows. Per completion, right-padded (a token's column is its place in the completion): the ids, the mask,
the sampling log-probs, the stop code and, with routing replay, each token's experts [N, L, S, k]. Per prompt,
left-padded (as prompts are collated, a token's column counts from the prompt's end): the prompt's experts [B, Lp, S,
k]. ``Rows`` holds such tensors under names with their fill and side; taking some rows at some width (a micro-batch,
dynamic sampling's picks, prompt order), joining several (a step's draws, a group's ranks) and gathering them from the
ranks of a group (``app.grouping.collectives.gather``) are one operation each, whatever the tensor: a new per-row
record is a field, not a new routine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from app.common.groups import group_slices
from app.grouping.experts.record import MISSING, Routing
from app.grouping.experts.routers import RoutingError
from app.rollout.generate import STOP_REASONS, Rollout, summed_parts


def fit(t: torch.Tensor, width: int, fill, left: bool = False) -> torch.Tensor:
    """``t`` padded with ``fill`` or cut along dim 1 to ``width``: right-padded rows keep their first columns,
    left-padded rows their last. A tensor of one dimension (one value per row) as it is."""
    if t.dim() < 2 or t.shape[1] == width:
        return t
    if t.shape[1] > width:
        return t[:, t.shape[1] - width:] if left else t[:, :width]
    pad = t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), fill)
    return torch.cat([pad, t] if left else [t, pad], dim=1)


@dataclass(frozen=True)
class Rows:
    """Named tensors of one row each per completion (or per prompt): ``fills`` what pads each, ``left`` the names
    padded on the left."""

    tensors: dict[str, torch.Tensor]
    fills: dict[str, float | int] = field(default_factory=dict)
    left: frozenset[str] = frozenset()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def take(self, index, width: int | None = None) -> Rows:
        """Rows ``index`` (a sequence, range or tensor of row numbers), each tensor of two or more dimensions cut or
        padded to ``width`` (None: as they are)."""
        index = torch.as_tensor(index, dtype=torch.long)
        out = {}
        for name, t in self.tensors.items():
            t = t[index.to(t.device)]
            out[name] = t if width is None else fit(t, width, self.fills.get(name, 0), name in self.left)
        return Rows(out, self.fills, self.left)

    @staticmethod
    def joined(parts: Sequence[Rows], width: int | None = None) -> Rows:
        """Several ``Rows`` of the same names, one after the other, each tensor at ``width`` (None: the widest)."""
        first = parts[0]
        for k, part in enumerate(parts):
            if set(part.tensors) != set(first.tensors):
                raise KeyError(f"rows {k} hold {sorted(part.tensors)}, rows 0 hold {sorted(first.tensors)}")
        out = {}
        for name, t in first.tensors.items():
            w = max(p.tensors[name].shape[1] for p in parts) if width is None and t.dim() > 1 else width
            out[name] = torch.cat([fit(p.tensors[name], w, first.fills.get(name, 0), name in first.left)
                                   for p in parts])
        return Rows(out, first.fills, first.left)

    def to(self, device) -> Rows:
        return Rows({name: t.to(device) for name, t in self.tensors.items()}, self.fills, self.left)


# ---- a Rollout as rows -------------------------------------------------------------------------------------------
def completion_rows(rollout, pad_id: int = 0) -> Rows:
    """A rollout's per-completion rows: ids (``pad_id``), mask, sampling log-probs, stop code and, with routing
    replay, the completion tokens' experts (-1 where there is none)."""
    codes = torch.tensor([STOP_REASONS.index(r) for r in rollout.stop_reasons], dtype=torch.long)
    tensors = {"completion_ids": rollout.completion_ids, "completion_mask": rollout.completion_mask,
               "logprobs": rollout.logprobs, "stop": codes.to(rollout.completion_ids.device)}
    if rollout.routing is not None:
        tensors["routing"] = rollout.routing.completion
    return Rows(tensors, {"completion_ids": pad_id, "completion_mask": 0, "logprobs": 0.0, "routing": MISSING})


def prompt_rows(rollout) -> Rows:
    """A rollout's per-prompt rows: with routing replay the prompt tokens' experts, left-padded (-1); else none."""
    if rollout.routing is None:
        return Rows({})
    return Rows({"routing": rollout.routing.prompt}, {"routing": MISSING}, frozenset({"routing"}))


def rollout_of(completions: Rows, prompts: Rows, layers: Sequence[int] = (), **rest):
    """The ``Rollout`` of ``completion_rows`` / ``prompt_rows`` (``rest``: group sizes, token counts, parts)."""
    routing = completions.tensors.get("routing")
    return Rollout(completion_ids=completions["completion_ids"], completion_mask=completions["completion_mask"],
                   logprobs=completions["logprobs"], stop_reasons=[STOP_REASONS[c] for c in completions["stop"].tolist()],
                   routing=None if routing is None else Routing(prompts["routing"], routing, tuple(layers)), **rest)


def select_groups(rollouts: Sequence, picks: Sequence[tuple[int, int]], pad_id: int, width: int | None = None):
    """One rollout made of whole groups taken from several: ``picks`` lists (rollout index, group index) in the
    order wanted; every per-row tensor (``completion_rows``, ``prompt_rows``) at ``width`` (None: the widest picked
    completion). Rollouts that record routing and rollouts that do not cannot be joined: their groups would train
    without replay, so that stops naming them (``RoutingError``)."""
    recorded = [r.routing is not None for r in rollouts]
    if any(recorded) and not all(recorded):
        raise RoutingError(f"rollouts {[k for k, on in enumerate(recorded) if not on]} of {len(rollouts)} carry no "
                           "routing record where the others do: their groups would train without routing replay")
    rows = [(k, group_slices(rollouts[k].group_sizes)[g]) for k, g in picks]
    if width is None:
        width = max([1] + [int(rollouts[k].completion_mask[s].sum(1).max()) for k, s in rows if s.stop > s.start])
    completions = Rows.joined([completion_rows(rollouts[k], pad_id).take(range(s.start, s.stop), width)
                               for k, s in rows] or [completion_rows(rollouts[0], pad_id).take([], width)])
    prompts = Rows.joined([prompt_rows(rollouts[k]).take([g]) for k, g in picks] or [prompt_rows(rollouts[0]).take([])])
    layers = next((r.routing.layers for r in rollouts if r.routing is not None and r.routing.layers), ())
    return rollout_of(completions, prompts, layers, group_sizes=[s.stop - s.start for _, s in rows],
                      prefill_tokens=sum(r.prefill_tokens for r in rollouts),
                      prompt_tokens=sum(r.prompt_tokens for r in rollouts), parts=summed_parts(rollouts))


def sent(rollout, pad_id: int) -> list[torch.Tensor]:
    """What a rank sends of its ``rollout`` to ``gathered``: its token counts and group sizes, its sparse layers, its
    completion rows and its prompt rows (each in name order)."""
    completions, prompts = completion_rows(rollout, pad_id), prompt_rows(rollout)
    counts = torch.tensor([rollout.prefill_tokens, rollout.prompt_tokens, *rollout.group_sizes], dtype=torch.long)
    layers = torch.tensor(rollout.routing.layers if rollout.routing is not None else (), dtype=torch.long)
    return [counts, layers, *[rows[n] for rows in (completions, prompts) for n in sorted(rows.tensors)]]


def gathered(rollout, gather, pad_id: int) -> list:
    """Every rank's ``rollout`` (``gather``: a group's gather of variable-size tensors, given ``sent``), in rank
    order: its rows, group sizes, token counts and sparse layers; a rank that sampled nothing sends empty ones."""
    names = sorted(completion_rows(rollout, pad_id).tensors), sorted(prompt_rows(rollout).tensors)
    return [rollout_of(Rows(dict(zip(names[0], rows))), Rows(dict(zip(names[1], rows[len(names[0]):]))),
                       layers.tolist(), group_sizes=counts[2:].tolist(), prefill_tokens=int(counts[0]),
                       prompt_tokens=int(counts[1]))
            for counts, layers, *rows in gather(sent(rollout, pad_id))]
