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
