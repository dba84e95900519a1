"""One forward's routing work at its sparse layers (``RoutePlan``: replay given expert ids, record the ids used, sum
router statistics per token weight) and what a forward asks of it (``Routed``).

Replay recomputes the gate weights from the current router's logits over the replayed experts, so the router still
learns (Rollout Routing Replay, arXiv 2510.11370). A plan reaches each sparse layer through the forward's keyword
arguments (``ROUTING_KWARG``; ``patch.install`` makes the layers read it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app.grouping.experts.routers import RoutingError
from app.grouping.experts.statistics import RouterStatistics, layer_sums

ROUTING_KWARG = "prefix_grouping_routing"
ROUTER_STATISTICS = ("off", "metrics", "loss")  # a forward's router sums: none, detached, differentiable

# The largest tie gap (``tie_gap``) a replayed routing may have and still count as rounding. On the tiny models in
# bf16, the tokens that flipped between the layouts had gaps up to 0.03; a record with 5% of its tokens sent to a
# neighbouring expert, 0.69 and more (tests/test_experts.py). Unmeasured on the released checkpoints.
TIE_GAP = 0.25


def tie_gap(logits: torch.Tensor, fresh: torch.Tensor, recorded: torch.Tensor, differs: torch.Tensor) -> torch.Tensor:
    """Over the tokens ``differs`` (their replayed set is not the router's own pick ``fresh``): the largest (logit of
    the router's own k-th choice - the lowest logit among the replayed experts), in units of that token's logit spread
    (std over the E experts). Rounding makes near-ties flip, with gaps of a few hundredths; a replayed set that is not
    a near-tie (another token's routing, a wrong expert) is a gap of order 1. 0 if none differs. A 0-dim tensor on
    the logits' device: taken in every replayed forward, it never waits for the device."""
    if logits.shape[0] == 0:
        return logits.new_zeros((), dtype=torch.float32)
    x = logits.detach().float()
    kth = x.gather(-1, fresh).min(-1).values
    worst = x.gather(-1, recorded.clamp_min(0)).min(-1).values
    gap = (kth - worst).clamp_min(0) / x.std(-1).clamp_min(1e-12)
    return torch.where(differs, gap, torch.zeros_like(gap)).max()


class RoutePlan:
    """One forward's routing work at its sparse layers (in ``layers`` order):
    ``replay`` [T, S, k] expert ids in the forward's token order (-1: route afresh: padding, a completion's last
    token); ``weights`` [T] each token's repeat count for ``statistics`` (None: no statistics); ``grad``: the
    statistics' probabilities keep their gradient (a load-balancing loss); ``record``: keep the ids used (True:
    once per layer; ``"append"``: every call's, in order: a rollout's prefill chunks and decode steps, ``calls``).
    A replay counts, per token, whether this forward's router would have chosen another set in any layer
    (``differs``: [T] bool; the rollout-against-update routing agreement)."""

    def __init__(self, layers: Sequence[int], *, replay: torch.Tensor | None = None,
                 weights: torch.Tensor | None = None, grad: bool = False, record: bool = False,
                 into: torch.Tensor | None = None):
        self.into = into  # [T, S, k] int16: each layer's ids copied in (a static decode step's record: the copy is
        # part of the step, so a captured or compiled step keeps recording)
        self.layers = tuple(layers)
        self.slot = {layer: s for s, layer in enumerate(self.layers)}
        self.replay, self.weights, self.grad, self.record = replay, weights, grad, record
        self.indices: list[torch.Tensor | None] = [None] * len(self.layers)
        self.sums: list[tuple | None] = [None] * len(self.layers)
        self.overruled = None  # replay: the largest tie gap of a replayed expert set this forward would not choose
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.layers]
        self.differs: torch.Tensor | None = None

    def route(self, router, hidden_states: torch.Tensor, layer: int):
        """Route one sparse layer's tokens through ``router`` (``HFRouter`` or ``EPRouter``): (logits [T, E], gate
        weights [T, k], expert ids [T, k]), replayed, recorded and counted as the plan says."""
        s = self.slot[layer]
        if self.replay is None:
            logits, scores, indices = router.fresh(hidden_states)
        else:
            logits = router.logits(hidden_states)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            recorded = self.replay[:, s].to(logits.device).long()
            if recorded.shape != (logits.shape[0], router.top_k):
                raise RoutingError(f"the routing replayed at layer {layer} covers {tuple(recorded.shape)} tokens x "
                                   f"slots, the forward routes {logits.shape[0]} tokens to {router.top_k} experts")
            fresh = torch.topk(probs, router.top_k, dim=-1).indices
            indices = torch.where(recorded >= 0, recorded, fresh)
            other = (recorded >= 0).all(-1) & (recorded.sort(-1).values != fresh.sort(-1).values).any(-1)
            gap = tie_gap(logits, fresh, recorded, other)
            self.differs = other if self.differs is None or self.differs.shape != other.shape else self.differs | other
            self.overruled = gap if self.overruled is None else torch.maximum(self.overruled, gap.to(self.overruled))
            scores = router.weights(logits, probs, indices)
        first = self.indices[s] is None and self.sums[s] is None  # a checkpoint's recompute: the same work, not kept
        if self.weights is not None:
            sums = layer_sums(logits, indices, self.weights, self.grad)
            if first:
                self.sums[s] = sums
        if self.into is not None:
            self.into[:, s].copy_(indices.detach())
        if self.record == "append":
            self.calls[s].append(indices.detach().to(torch.int16))
        elif self.record and first:
            self.indices[s] = indices.detach().to(torch.int16)
        return logits, scores, indices

    def recorded(self) -> torch.Tensor:
        """[T, S, k] int16: the ids every sparse layer used."""
        missing = [layer for layer, i in zip(self.layers, self.indices) if i is None]
        if missing:
            raise RoutingError(f"sparse layers {missing} were not reached by the forward")
        return torch.stack(self.indices, dim=1)

    def statistics(self, top_k: int) -> RouterStatistics | None:
        if self.weights is None or any(s is None for s in self.sums):
            return None
        return RouterStatistics.stack(self.layers, self.sums, self.weights.sum().to(torch.float32), top_k)


@dataclass
class Routed:
    """What a forward asks of a MoE model's sparse layers (``completion_logprobs``'s ``routing``,
    ``router_statistics``, ``record_routing``), and what it got back."""

    replay: object = None  # the record (``record.Routing``); True: the forward hands ``plan_for`` its ids (prefix trees)
    statistics: str = "off"
    record: bool = False
    shape: object = None  # the model's experts.blocks.ExpertShape
    plan: RoutePlan | None = None

    @property
    def wanted(self) -> bool:
        return self.replay is not None or self.statistics != "off" or self.record

    def plan_for(self, replay: torch.Tensor | None, weights: torch.Tensor) -> dict:
        """The forward keyword argument of a plan over tokens whose replayed ids / repeat counts are given."""
        if self.shape is None:
            return {}
        self.plan = RoutePlan(self.shape.layers, replay=replay if self.replay is not None else None,
                              weights=weights if self.statistics != "off" else None,
                              grad=self.statistics == "loss", record=self.record)
        return {ROUTING_KWARG: self.plan}

    def replay_differs(self) -> torch.Tensor | None:
        """A replayed forward: [2] (tokens whose router would have chosen another expert set in some sparse layer,
        tokens replayed), on the device (no sync); None otherwise."""
        plan = self.plan
        if self.replay is None or plan is None or plan.differs is None:
            return None
        replayed = (plan.replay >= 0).all(-1).any(-1).to(plan.differs.device)
        return torch.stack([(plan.differs & replayed).sum(), replayed.sum()]).float()

    def results(self, to_record) -> tuple:
        """(RouterStatistics or None, Routing or None, tie gap or None) of the forward just run; ``to_record`` turns
        its [T, S, k] ids into a ``Routing``; the tie gap (``tie_gap``, a replay only) over every sparse layer."""
        if self.plan is None:
            return None, None, None
        gap = None if self.replay is None else float(self.plan.overruled if self.plan.overruled is not None else 0.0)
        return self.plan.statistics(self.shape.top_k), to_record(self.plan.recorded()) if self.record else None, gap


