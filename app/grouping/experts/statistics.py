"""Router statistics per logical token: each token of a forward weighted by how many rows of the repeated layout
[P;Ri] hold it (a prompt token shared by G responses counts G times, a family's video tokens once per response of
every question, a response token once; padding 0), so that sums over a packed row equal the repeated layout's sums
over its real tokens, exactly, however the rows are packed.

What a load-balancing loss or a metric needs (``app/objectives/router.py`` computes them) is kept per sparse layer
as sums, not as [tokens, experts] tensors: the weighted top-k assignments per expert, the weighted router
probability per expert (differentiable when asked), the weighted entropy, and the weight itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def token_repeats(layout) -> torch.Tensor:
    """[T] float32: per packed token of ``layout`` (a ``GroupLayout``), the rows of the repeated layout holding it."""
    weights = torch.ones(layout.total_len, dtype=torch.float32)
    g = 0
    for f, (size, shared) in enumerate(zip(layout.families, layout.shared_lens)):
        members = range(g, g + size)
        start = layout.family_starts[f]
        weights[start:start + shared] = float(sum(layout.group_sizes[m] for m in members))
        for m in members:
            begin = layout.group_starts[m]
            weights[begin:begin + layout.question_lens[m]] = float(layout.group_sizes[m])
        g += size
    return weights


@dataclass
class RouterStatistics:
    """Sums over one forward's tokens, per sparse layer (S of them), each token weighted by its repeat count."""

    layers: tuple[int, ...]  # decoder layer index of each sparse layer
    load: torch.Tensor  # [S, E] weighted count of top-k assignments per expert (no gradient)
    probability: torch.Tensor  # [S, E] weighted sum of router probabilities (softmax over E; differentiable if asked)
    entropy: torch.Tensor  # [S] weighted sum of each token's router entropy (nats; no gradient)
    tokens: torch.Tensor  # [] the weight summed over the tokens (the repeated layout's real tokens)
    top_k: int

    @property
    def experts(self) -> int:
        return int(self.load.shape[-1])

    @staticmethod
    def stack(layers, per_layer: list[tuple], tokens: torch.Tensor, top_k: int) -> RouterStatistics:
        load, probability, entropy = zip(*per_layer)
        return RouterStatistics(tuple(layers), torch.stack(load), torch.stack(probability), torch.stack(entropy),
                                tokens, top_k)

    def detached(self) -> RouterStatistics:
        return RouterStatistics(self.layers, self.load, self.probability.detach(), self.entropy, self.tokens,
                                self.top_k)

    def __add__(self, other: RouterStatistics) -> RouterStatistics:
        """Two forwards' sums (micro-batches, ranks): the statistics of their tokens together."""
        if self.layers != other.layers or self.top_k != other.top_k:
            raise ValueError("router statistics of different models cannot be added")
        return RouterStatistics(self.layers, self.load + other.load, self.probability + other.probability,
                                self.entropy + other.entropy, self.tokens + other.tokens, self.top_k)


def layer_sums(logits: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, grad: bool):
    """One sparse layer's (load [E], probability [E], entropy []) for router ``logits`` [T, E] and routed
    ``indices`` [T, k] under per-token ``weights`` [T]."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights = weights.to(probs.device, torch.float32)
    with torch.no_grad():
        load = torch.zeros(probs.shape[-1], dtype=torch.float32, device=probs.device)
        load.index_add_(0, indices.reshape(-1).long(), weights.repeat_interleave(indices.shape[-1]))
        entropy = (weights * -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)).sum()
    probability = (probs if grad else probs.detach()) * weights[:, None]
    return load, probability.sum(0), entropy
