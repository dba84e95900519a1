"""A mixture-of-experts router's load-balancing loss and metrics, from per-layer sums over logical tokens.

The sums (``app.grouping.experts.statistics.RouterStatistics``: per sparse layer, the weighted top-k assignments
per expert ``load`` [S, E], the weighted router probabilities ``probability`` [S, E], the weighted entropy [S], the
weight ``tokens``) count each token of the repeated layout [P;Ri] once: a prompt token shared by G responses
weighs G. So the numbers below are the repeated layout's, exactly, however the rows were packed.

``load_balancing_loss`` is transformers' ``load_balancing_loss_func`` of the Qwen MoE models (Switch Transformer,
arXiv 2101.03961, eqs. 4-6) over the same tokens: the fraction of assignments and the mean router probability of
each expert, both averaged over every sparse layer's tokens, multiplied and summed over experts, times E. Balanced
routing gives top_k; the gradient reaches the router through the probabilities only (the assignments are counts).
"""

from __future__ import annotations

import torch


def load_balancing_loss(stats) -> torch.Tensor:
    """E * sum_e f_e * P_e, f and P over all sparse layers' (weighted) tokens: transformers' definition."""
    rows = stats.tokens * stats.load.shape[0]
    fraction = stats.load.sum(0) / rows
    probability = stats.probability.sum(0) / rows
    return (fraction * probability).sum() * stats.load.shape[-1]


def router_metrics(stats) -> dict[str, float]:
    """Per sparse layer (``layer_NN`` is the decoder layer's index): the expert load's max over its mean (1.0 when
    every expert takes as many tokens), the router's mean entropy per token (nats; ln E when uniform); and over the
    model: the worst layer's imbalance, the mean entropy, the load-balancing loss."""
    out = {}
    mean_load = stats.load.mean(-1).clamp_min(1e-12)
    imbalance = (stats.load.max(-1).values / mean_load).tolist()
    entropy = (stats.entropy / stats.tokens.clamp_min(1e-12)).tolist()
    for layer, ratio, nats in zip(stats.layers, imbalance, entropy):
        out[f"router/load_max_over_mean/layer_{layer:02d}"] = float(ratio)
        out[f"router/entropy/layer_{layer:02d}"] = float(nats)
    out["router/load_max_over_mean"] = float(max(imbalance))
    out["router/entropy"] = float(sum(entropy) / len(entropy))
    with torch.no_grad():
        out["router/aux_loss"] = float(load_balancing_loss(stats.detached() if hasattr(stats, "detached") else stats))
    return out


NO_STATISTICS = ("grpo.router_aux_loss_coef > 0, but this forward returns no router statistics; set "
                 "grpo.router_aux_loss_coef=0")
STATISTICS_KEY = "router_sums"  # step metrics: the routers' sums, added over micro-batches and ranks, then turned
# into router/* by ``step_router_metrics``


def counting_passes(moe: bool, coef: float, iterations: int = 1) -> int:
    """No-gradient forwards per micro-batch a step spends counting its expert loads (``RouterTerm.start_step``): one
    per update pass on a mixture-of-experts policy with a load-balancing loss, none otherwise. The planner prices
    them (``app.planning.timing``, phase ``router_counts``)."""
    return int(iterations) if moe and coef > 0 else 0


class RouterTerm:
    """The routers' part of a GRPO step on a mixture-of-experts policy (nothing on a dense one): what the update's
    forward asks for (``forward_kwargs``: detached sums for the metrics, or differentiable ones when the
    load-balancing loss is in the objective), and the loss with ``coef`` x the step's load-balancing loss added.

    The loss is the step's, over every logical token of every micro-batch and rank, whatever the packing or the
    micro-batching: E x sum_e f_e P_e is linear in P (the mean router probability, the part with a gradient) once f
    (the fraction of assignments, a count) is known. ``start_step`` takes f and the token count from a no-gradient
    pass over the step's micro-batches (``needs_counts``: only when ``coef`` > 0), summed over ranks; ``add`` then
    gives each micro-batch its share E x sum_e f_e x (its probability sums) / (the step's rows), times the number
    of micro-batch losses DeepSpeed averages. The shares add up to the step's loss; their gradients to its gradient.
    """

    def __init__(self, coef: float, moe: bool):
        self.coef, self.moe = float(coef), bool(moe)
        self.fraction, self.rows, self.losses = None, 0.0, 1

    @property
    def forward_kwargs(self) -> dict:
        if not self.moe:
            return {}
        return {"router_statistics": "loss" if self.coef > 0 else "metrics"}

    @property
    def needs_counts(self) -> bool:
        return counting_passes(self.moe, self.coef) > 0

    def start_step(self, counted: list, micro_batches: int, world_size: int = 1, reduce_sum=None) -> None:
        """``counted``: each micro-batch's router sums (no gradient needed) at the weights its update will see."""
        if any(stats is None for stats in counted):
            raise ValueError(NO_STATISTICS)
        load = sum(stats.load.detach().double().sum(0) for stats in counted)
        rows = sum(float(stats.tokens) * stats.load.shape[0] for stats in counted)
        local = [*load.tolist(), rows]
        total = reduce_sum(local) if reduce_sum is not None else local
        self.rows = float(total[-1])
        self.fraction = torch.tensor(total[:-1], dtype=torch.float64) / max(self.rows, 1e-30)
        self.losses = micro_batches * world_size

    def add(self, loss: torch.Tensor, stats) -> torch.Tensor:
        if not self.needs_counts:
            return loss
        if stats is None or self.fraction is None:  # no counts: start_step was not called for this step
            raise ValueError(NO_STATISTICS)
        probability = stats.probability.sum(0)
        share = (self.fraction.to(probability) * probability).sum() * probability.shape[-1] / self.rows
        return loss + (self.coef * self.losses * share).to(loss.dtype)


def declare_sums(metrics, stats) -> None:
    """The step's router sums (``RouterStatistics``, already added over its micro-batches) as summed step metrics,
    so ranks add them before anything nonlinear is taken (``step_router_metrics``): one tensor [tokens, entropy [S],
    load [S x E], probability [S x E]] and its sparse layers, which reach the host in one copy with the step's other
    metrics and cross ranks in its one collective."""
    if stats is None:
        return
    stats = stats.detached()
    metrics.sum(STATISTICS_KEY, torch.cat([stats.tokens.reshape(1).to(stats.load), stats.entropy.to(stats.load),
                                           stats.load.flatten(), stats.probability.flatten().to(stats.load)]))
    metrics.local(f"{STATISTICS_KEY}/layers", torch.tensor([float(layer) for layer in stats.layers]))
    metrics.local(f"{STATISTICS_KEY}/top_k", float(stats.top_k))


def step_router_metrics(values: dict) -> dict:
    """Pops the reduced router sums out of ``values`` and returns ``router_metrics`` of them (empty for a dense
    model): per sparse layer, not per expert."""
    from types import SimpleNamespace

    if STATISTICS_KEY not in values:
        return {}
    summed = torch.tensor(values.pop(STATISTICS_KEY), dtype=torch.float64)
    layers = tuple(int(v) for v in values.pop(f"{STATISTICS_KEY}/layers"))
    top_k = int(values.pop(f"{STATISTICS_KEY}/top_k"))
    s = len(layers)
    experts = (summed.numel() - 1 - s) // (2 * s)
    load, probability = summed[1 + s:].view(2, s, experts)
    stats = SimpleNamespace(layers=layers, load=load, probability=probability, entropy=summed[1: 1 + s],
                            tokens=summed[0], top_k=top_k)
    return router_metrics(stats)


def replay_metrics(differs) -> dict[str, float]:
    """Routing replay (rollout.routing_replay=r3): the replayed tokens whose router, in the update's first forward,
    would have sent them to another expert set in some sparse layer, and the tokens replayed (``CompletionScores.
    replay_differs``); the step's ``routing/replay_differs`` is their ratio. Nothing without a replay."""
    if differs is None:
        return {}
    otherwise, replayed = (float(v) for v in differs)
    return {"routing/replayed_otherwise": otherwise, "routing/replayed": replayed}
