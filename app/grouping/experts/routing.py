"""Which experts each token went to: recorded in a forward, replayed in another, counted per logical token.

- ``Routing``: the record, layout-independent: ``prompt`` [B, Lp, S, k] aligned with the (left-padded) prompt ids
  and ``completion`` [N, Lc, S, k] aligned with the (right-padded) completion ids, int16 (an expert id, or -1 where
  there is no token or nothing was recorded). A grouped row and the repeated rows read the same record through
  ``for_packed`` / ``for_repeated``; ``from_packed`` / ``from_repeated`` turn a forward's own order back into it.
- ``RoutePlan``: what one forward does at its sparse layers: replay given expert ids (the gate weights recomputed
  from the current router's logits over those experts, so the router still learns: Rollout Routing Replay, arXiv
  2510.11370), record the ids it used, sum router statistics per token weight (``statistics.layer_sums``).
- ``install``: the instance patches that make a plan work, on transformers' routers and on AutoEP's expert-parallel
  ones alike (``HFRouter``, ``EPRouter``: each routes by its own rule). Each sparse decoder layer's ``forward`` takes the plan
  from its keyword arguments (``ROUTING_KWARG``, popped there: attention never sees it) and hands it to its router
  for the layer's call; activation checkpointing's recompute calls the layer with the same arguments, so a replay
  holds in backward too, and the recompute runs the same operations (its record and sums are not kept twice).
  Without a plan the class's forwards run.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.grouping.experts.blocks import (
    ExpertShape,
    expert_shape,
    is_ep_router,
    is_sparse_block,
    router_of,
    sparse_layers,
)
from app.grouping.experts.routers import EPRouter, HFRouter, RoutingError
from app.grouping.experts.statistics import RouterStatistics, layer_sums

ROUTING_KWARG = "prefix_grouping_routing"
ROUTER_STATISTICS = ("off", "metrics", "loss")  # a forward's router sums: none, detached, differentiable
MARK = "_prefix_grouping_routing"
_ACTIVE = "_prefix_grouping_route"  # on a router, for the duration of its layer's call: (plan, layer index)
MISSING = -1


@dataclass
class Routing:
    """Routed expert ids per token and sparse layer, in the prompts' and completions' own coordinates."""

    prompt: torch.Tensor  # [B, Lp, S, k] int16
    completion: torch.Tensor  # [N, Lc, S, k] int16
    layers: tuple[int, ...]  # decoder layer index of each of the S sparse layers

    @property
    def top_k(self) -> int:
        return int(self.prompt.shape[-1])

    def to(self, device) -> Routing:
        return Routing(self.prompt.to(device), self.completion.to(device), self.layers)

    def bytes(self) -> int:
        return self.prompt.numel() * self.prompt.element_size() + self.completion.numel() * \
            self.completion.element_size()

    @staticmethod
    def picked(records: Sequence[Routing | None], groups: Sequence[tuple[int, int]],
               rows: Sequence[tuple[int, int, int]], width: int) -> Routing | None:
        """Whole groups of several rollouts' records as one (``select_groups``): prompt ``groups[i]`` = (record,
        prompt) with completion rows ``rows[i]`` = (record, first, end); prompts right-aligned at the widest
        (left-padded, -1), completions cut or padded (-1) to ``width``. None unless every record is there."""
        if not records or any(r is None for r in records):
            return None
        first = records[0]
        prompt_width = max([1] + [records[k].prompt.shape[1] for k, _ in groups])
        prompts, completions = [], []
        for (k, g), (_, a, b) in zip(groups, rows):
            p, c = records[k].prompt[g], records[k].completion[a:b, :width]
            prompts.append(F.pad(p, (0, 0, 0, 0, prompt_width - p.shape[0], 0), value=MISSING))
            completions.append(F.pad(c, (0, 0, 0, 0, 0, width - c.shape[1]), value=MISSING))
        empty = first.prompt[:0, :prompt_width], first.completion[:0, :width]
        return Routing(torch.stack(prompts) if prompts else empty[0], torch.cat(completions) if completions
                       else empty[1], first.layers)

    def of_groups(self, groups: Sequence[int], rows, prompt_width: int, width: int) -> Routing:
        """The record of some groups (a micro-batch): their prompts at ``prompt_width`` (left-padded: the last
        columns), their completion ``rows`` cut or padded (-1) to ``width``."""
        prompt = self.prompt[list(groups)]
        prompt = F.pad(prompt, (0, 0, 0, 0, max(prompt_width - prompt.shape[1], 0), 0), value=MISSING)
        completion = self.completion[torch.as_tensor(rows, dtype=torch.long), :width]
        completion = F.pad(completion, (0, 0, 0, 0, 0, width - completion.shape[1]), value=MISSING)
        return Routing(prompt[:, prompt.shape[1] - prompt_width:], completion, self.layers)

    # ---- a layout's token order ----------------------------------------------------------------------------
    def for_packed(self, layout) -> torch.Tensor:
        """[T, S, k] in the packed row's order (``GroupLayout.pack``)."""
        return layout.pack(self.prompt, self.completion)

    def for_repeated(self, group_sizes: Sequence[int]) -> torch.Tensor:
        """[N * (Lp + Lc), S, k]: the repeated rows [P_g(n); R_n], flattened as the model flattens its tokens."""
        group = torch.repeat_interleave(torch.arange(len(group_sizes)), torch.tensor(list(group_sizes)))
        rows = torch.cat([self.prompt[group.to(self.prompt.device)], self.completion], dim=1)
        return rows.flatten(0, 1)

    @staticmethod
    def from_packed(layout, packed: torch.Tensor, layers: Sequence[int]) -> Routing:
        """The record of a packed forward's [T, S, k] ids. A family's later questions hold its shared tokens V as
        the first question does (the row holds V once)."""
        b, lp, n, lc = layout.num_groups, layout.prompt_width, layout.num_completions, layout.completion_width
        flat = packed.new_full((b * lp + n * lc, *packed.shape[1:]), MISSING)
        flat[layout.pack_index.to(packed.device)] = packed
        prompt, completion = flat[: b * lp].view(b, lp, *packed.shape[1:]), flat[b * lp:].view(n, lc, *packed.shape[1:])
        g = 0
        for size, shared in zip(layout.families, layout.shared_lens):
            first = lp - layout.prefix_lens[g]
            for m in range(g + 1, g + size):
                start = lp - layout.prefix_lens[m]
                prompt[m, start:start + shared] = prompt[g, first:first + shared]
            g += size
        return Routing(prompt, completion, tuple(layers))

    @staticmethod
    def from_repeated(rows: torch.Tensor, prompt_width: int, group_sizes: Sequence[int], layers: Sequence[int],
                      prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> Routing:
        """The record of a repeated forward's [N * (Lp + Lc), S, k] ids: each prompt as its group's first row routed
        it (``disagreements`` tells whether the other rows did the same). Padding is -1."""
        n = completion_mask.shape[0]
        rows = rows.view(n, -1, *rows.shape[1:])
        firsts = torch.tensor([0, *list(torch.tensor(list(group_sizes)).cumsum(0)[:-1].tolist())])
        prompt = rows[firsts.to(rows.device), :prompt_width].clone()
        prompt[~prompt_mask.bool().to(rows.device)] = MISSING
        completion = rows[:, prompt_width:].clone()
        completion[~completion_mask.bool().to(rows.device)] = MISSING
        return Routing(prompt, completion, tuple(layers))


def disagreements(a: Routing, b: Routing, prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> dict:
    """How many real tokens two records route to different expert SETS in at least one sparse layer (the order of
    the top-k slots does not matter), and how many (token, layer) decisions differ: prompt and completion tokens."""
    def differ(x, y, mask):
        x, y = x.sort(-1).values, y.sort(-1).values
        per_layer = (x != y).any(-1) & mask.bool().to(x.device)[..., None]
        return int(per_layer.any(-1).sum()), int(per_layer.sum()), int(mask.sum())

    p_tokens, p_decisions, p_real = differ(a.prompt, b.prompt, prompt_mask)
    c_tokens, c_decisions, c_real = differ(a.completion, b.completion, completion_mask)
    layers = len(a.layers)
    return {"tokens": p_tokens + c_tokens, "decisions": p_decisions + c_decisions, "real_tokens": p_real + c_real,
            "decisions_total": (p_real + c_real) * layers, "prompt_tokens": p_tokens, "completion_tokens": c_tokens}


def first_difference(a: Routing, b: Routing, prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> str:
    """Where two records first route a real token to different expert sets: 'prompt 1's token 12 at sparse
    layer 3 (decoder layer 7): experts [..] and [..]' (prompts first, then completions), or ''."""
    for part, x, y, mask in (("prompt", a.prompt, b.prompt, prompt_mask), ("completion", a.completion,
                                                                          b.completion, completion_mask)):
        xs, ys = x.sort(-1).values, y.to(x.device).sort(-1).values
        differ = ((xs != ys).any(-1) & mask.bool().to(x.device)[..., None]).nonzero()
        if len(differ):
            row, token, layer = (int(v) for v in differ[0])
            return (f"{part} {row}'s token {token} at sparse layer {layer} (decoder layer {a.layers[layer]}): experts "
                    f"{xs[row, token, layer].tolist()} and {ys[row, token, layer].tolist()}")
    return ""


def check_routing(routing: Routing, shape: ExpertShape, prompt_mask: torch.Tensor, completion_mask: torch.Tensor,
                  name: Callable[[int], str] = lambda g: f"prompt {g}", group_sizes: Sequence[int] | None = None) -> None:
    """Refuse a record that cannot be replayed on these tokens, naming the prompt: another shape, another model's
    layers or top-k, an expert id out of range, or a real token without a record (each completion's LAST token may
    lack one: the rollout never fed it back, and no log-prob depends on its routing)."""
    b, lp = prompt_mask.shape
    n, lc = completion_mask.shape
    s, k = len(shape.layers), shape.top_k
    if tuple(routing.layers) != tuple(shape.layers) or routing.top_k != k:
        raise RoutingError(f"the routing record is of sparse layers {list(routing.layers)} with top-{routing.top_k}; "
                           f"this model routes layers {list(shape.layers)} with top-{k}")
    if tuple(routing.prompt.shape) != (b, lp, s, k) or tuple(routing.completion.shape) != (n, lc, s, k):
        raise RoutingError(f"the routing record's shapes {tuple(routing.prompt.shape)} / "
                           f"{tuple(routing.completion.shape)} do not match the batch's prompts [{b}, {lp}] and "
                           f"completions [{n}, {lc}] x {s} sparse layers x top-{k}")
    sizes = list(group_sizes) if group_sizes is not None else [n // b] * b
    group_of = torch.repeat_interleave(torch.arange(b), torch.tensor(sizes))
    last = torch.zeros_like(completion_mask, dtype=torch.bool)
    lengths = completion_mask.long().sum(1)
    last[torch.arange(n), (lengths - 1).clamp_min(0)] = lengths > 0
    for part, record, mask, owner in (("prompt", routing.prompt, prompt_mask.bool(), torch.arange(b)),
                                      ("completion", routing.completion, completion_mask.bool() & ~last, group_of)):
        record = record.to(mask.device)
        bad = ((record < 0) | (record >= shape.experts)).any(-1).any(-1) & mask
        if bool(bad.any()):
            row, position = (int(v) for v in bad.nonzero()[0])
            value = record[row, position]
            what = "has no record" if bool((value < 0).any()) else f"names expert ids {value.unique().tolist()} " \
                f"of {shape.experts}"
            raise RoutingError(f"{name(int(owner[row]))}: the routing record of its {part} token {position}"
                               f"{'' if part == 'prompt' else f' (completion {row})'} {what}; nothing is replayed "
                               "from another prompt")


# The largest tie gap (``tie_gap``) a replayed routing may have and still count as rounding. On the tiny models in
# bf16, the tokens that flipped between the layouts had gaps up to 0.03; a record with 5% of its tokens sent to a
# neighbouring expert, 0.69 and more (tests/test_experts.py). Unmeasured on the released checkpoints.
TIE_GAP = 0.25


def tie_gap(logits: torch.Tensor, fresh: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """Over the tokens whose replayed expert set differs from the one this forward's router picks: the largest
    (logit of the router's own k-th choice - the lowest logit among the replayed experts), in units of that token's
    logit spread (std over the E experts). Rounding makes near-ties flip, with gaps of a few hundredths; a replayed
    set that is not a near-tie (another token's routing, a wrong expert) is a gap of order 1. 0 if none differs.
    A 0-dim tensor on the logits' device: taken in every replayed forward, it never waits for the device."""
    if logits.shape[0] == 0:
        return logits.new_zeros((), dtype=torch.float32)
    differs = (recorded >= 0).all(-1) & (recorded.sort(-1).values != fresh.sort(-1).values).any(-1)
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

    def shard(self, start: int, end: int) -> RoutePlan:
        """The plan of a shard [start, end) of this forward's tokens (sequence parallelism)."""
        return RoutePlan(self.layers, replay=None if self.replay is None else self.replay[start:end],
                         weights=None if self.weights is None else self.weights[start:end], grad=self.grad,
                         record=self.record)

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
            gap = tie_gap(logits, fresh, recorded)
            other = (recorded >= 0).all(-1) & (recorded.sort(-1).values != fresh.sort(-1).values).any(-1)
            if self.differs is None or self.differs.shape != other.shape:
                self.differs = other
            else:
                self.differs = self.differs | other
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
        if any(i is None for i in self.indices):
            missing = [layer for layer, i in zip(self.layers, self.indices) if i is None]
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

    replay: Routing | bool | None = None  # the record; True: the forward hands ``plan_for`` its ids (prefix trees)
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
        stats = self.plan.statistics(self.shape.top_k) if self.statistics != "off" else None
        return (stats, to_record(self.plan.recorded()) if self.record else None,
                float(self.plan.overruled if self.plan.overruled is not None else 0.0) if self.replay is not None
                else None)


def _decoder_layers(model) -> list:
    """Every text decoder layer (a module with an ``mlp`` beside ``self_attn`` or ``linear_attn``)."""
    model = getattr(model, "module", model)
    return [m for m in model.modules() if hasattr(m, "mlp") and (hasattr(m, "self_attn") or hasattr(m, "linear_attn"))]


def install(model) -> ExpertShape | None:
    """Patch the decoder layers and routers of ``model`` (once; idempotent) so that a ``RoutePlan`` in a layer's
    keyword arguments drives its sparse block's routing (a dense layer of a MoE model just drops it). Returns the
    model's ``ExpertShape`` (None: a dense model, left unpatched)."""
    found = {id(s.layer): s for s in sparse_layers(model)}
    if not found:
        return None
    for layer in _decoder_layers(model):
        sparse = found.get(id(layer))
        router = router_of(sparse.block) if sparse is not None else None
        # a layer whose block was replaced since it was patched (AutoEP, at the engine's start) patches its new router
        if getattr(layer, MARK, False) and (router is None or getattr(router, MARK, False)):
            continue

        layer_forward = type(layer).forward  # unbound, and the router found from ``self``: a deep copy routes its own

        def forward(self, *args, _original=layer_forward, _index=sparse and sparse.index, **kwargs):
            plan = kwargs.pop(ROUTING_KWARG, None)
            router = router_of(self.mlp) if plan is not None and is_sparse_block(self.mlp) else None
            if router is None:
                return _original(self, *args, **kwargs)
            object.__setattr__(router, _ACTIVE, (plan, _index))
            try:
                return _original(self, *args, **kwargs)
            finally:
                router.__dict__.pop(_ACTIVE, None)

        object.__setattr__(layer, "forward", types.MethodType(forward, layer))
        object.__setattr__(layer, MARK, True)
        if router is None:
            continue
        router_forward = type(router).forward
        if is_ep_router(router):
            def route(self, hidden_states, expert_bias=None, _original=router_forward):
                active = self.__dict__.get(_ACTIVE)
                if active is None:
                    return _original(self, hidden_states, expert_bias)
                plan, index = active
                adapter = EPRouter(self, expert_bias)
                _, scores, indices = plan.route(adapter, hidden_states, index)
                return scores, indices, adapter.tokens_per_expert(indices)  # AutoEP's (weights, ids, counts)
        else:
            def route(self, hidden_states, _original=router_forward):
                active = self.__dict__.get(_ACTIVE)
                if active is None:
                    return _original(self, hidden_states)
                plan, index = active
                return plan.route(HFRouter(self, _original.__get__(self)), hidden_states, index)

        object.__setattr__(router, "forward", types.MethodType(route, router))
        object.__setattr__(router, MARK, True)
    return expert_shape(model)
