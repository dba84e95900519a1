"""The experts every token of a rollout went to, recorded as the grouped engine samples (routing replay, R3: arXiv
2510.11370): the prompts' once (each prompt is prefilled once: its record serves its G samples), each completion
token's at the decode step that fed it (a completion's last token is never fed back: no record, and no log-prob
depends on its routing). The record is ``experts.record.Routing`` (int16), layout-independent: the training
forwards replay it in either layout.

``DecodeRouting`` hands a recording ``RoutePlan`` to the prefill (every chunk of a chunked prefill appends) and to
each decode step, and follows the decoder's batch as finished samples leave it. A prefill in two parts (questions
sharing a video: the roots V once, then each question on top, ``shared.py``; the same spread over a
sequence-parallel group, each rank routing its piece of every chunk, ``spread.py``) records each part and hands the
pieces to ``composed``: a family's V is routed once and its record copied into each member's prompt record.
"""

from __future__ import annotations

import torch

from app.grouping.experts.patch import install
from app.grouping.experts.plan import ROUTING_KWARG, RoutePlan
from app.grouping.experts.record import Routing
from app.grouping.modules import unwrap


class DecodeRouting:
    """The routing record of one grouped rollout of ``count`` samples of at most ``limit`` tokens."""

    def __init__(self, model, count: int, limit: int, device):
        shape = install(unwrap(model))
        if shape is None:
            raise ValueError(f"rollout.routing_replay: {type(unwrap(model)).__name__} has no routed experts to record")
        self.shape, self.plan, self.prompt = shape, None, None
        self.completion = torch.full((count, limit, len(shape.layers), shape.top_k), -1, dtype=torch.int16,
                                     device=device)
        self.rows = torch.arange(count, device=device)  # the decoder's batch -> sample index

    def kwargs(self) -> dict:
        """The forward keyword argument of one recording forward (a prefill, or one decode step)."""
        self.plan = RoutePlan(self.shape.layers, record="append")
        return {ROUTING_KWARG: self.plan}

    def _stacked(self, rows: int) -> torch.Tensor:
        """[rows, positions, S, k] of the forward just run: each call's [rows x positions] tokens, in order."""
        per_layer = []
        for layer, calls in zip(self.shape.layers, self.plan.calls):
            if not calls:
                raise RuntimeError(f"sparse layer {layer} routed nothing in the rollout's forward")
            per_layer.append(torch.cat([c.reshape(rows, -1, self.shape.top_k) for c in calls], dim=1))
        return torch.stack(per_layer, dim=2)

    def taken(self, mask: torch.Tensor) -> torch.Tensor:
        """[rows, width, S, k] of the forward just run over left-padded rows ``mask`` [rows, width] (0/1), -1 at the
        pads (a synced prefill's idle calls come after the real chunks and are dropped)."""
        ids = self._stacked(mask.shape[0])[:, : mask.shape[1]]
        return ids.masked_fill(~mask.bool().to(ids.device)[..., None, None], -1)

    def composed(self, roots, root_records, questions: torch.Tensor, lengths, width: int) -> None:
        """After a prefill in two parts: each prompt's record [B, width, S, k] (left-padded, -1) from its root's
        (``root_records[r]`` [V_r, S, k], the first V_r tokens of each of root r's members) and its question's
        (``questions`` [B, Lq, S, k], left-padded: the rest of the prompt)."""
        prompt = questions.new_full((len(lengths), width, *questions.shape[-2:]), -1)
        for (members, v), root in zip(roots, root_records):
            for m in members:
                first, own = width - lengths[m], lengths[m] - v
                prompt[m, first : first + v] = root.to(prompt.device)
                prompt[m, width - own :] = questions[m, questions.shape[1] - own :]
        self.prompt = prompt

    def static_plan(self, holder) -> dict:
        """The forward keyword argument of a static decode step: one plan per static state ``holder`` (the bucket
        kept across rollouts, or the decoder), copying each layer's ids into its fixed buffer, so the step captured
        as a CUDA graph or compiled records too (``static_stepped`` reads the buffer after each step)."""
        plan = getattr(holder, "route_plan", None)
        rows = len(self.rows)
        if plan is None or plan.into.shape[0] != rows:
            plan = RoutePlan(self.shape.layers, into=self.completion.new_full((rows, *self.completion.shape[2:]), -1))
            holder.route_plan = plan
        return {ROUTING_KWARG: plan}

    def static_stepped(self, holder, step: int) -> None:
        """After static step ``step`` (every sample stays in a static batch; a finished one's ids are dropped by
        ``record``)."""
        self.completion[:, step] = holder.route_plan.into

    def stepped(self, step: int) -> None:
        """After decode step ``step`` (it fed completion token ``step`` of every sample in the batch)."""
        self.completion[self.rows, step] = self._stacked(len(self.rows))[:, 0].to(self.completion.device)

    def keep(self, rows: torch.Tensor) -> None:
        self.rows = self.rows[rows.to(self.rows.device)]

    def record(self, completion_mask: torch.Tensor):
        """The rollout's ``Routing``: completions cut to the rollout's width, -1 past each one's tokens."""
        ids = self.completion[:, : completion_mask.shape[1]]
        ids = ids.masked_fill(~completion_mask.bool().to(ids.device)[..., None, None], -1)
        return Routing(self.prompt, ids, tuple(self.shape.layers))
