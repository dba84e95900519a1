"""A sparse block's router as a ``RoutePlan`` routes it (``patch.install`` patches every kind: ``blocks.KINDS``):
transformers' own (``HFRouter``; DeepSpeed AutoEP's is ``app.runtime.expert_parallel.EPRouter``). Each gives a plan
the same three things by its own rule: its fresh choice (logits, gate weights, expert ids), its logits, and its gate
weights over given experts (a replay), so a replayed or counted forward computes what the un-patched block would have
over those experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from app.grouping.layout import LayoutError


class RoutingError(LayoutError):
    """A routing record that does not cover a forward's tokens (missing, out of range, another shape): the message
    names the prompt."""


def renormalised(top: torch.Tensor, total: torch.Tensor, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The k chosen experts' probabilities over their sum, as the routers weight them (``top / total``), except where
    every one of them underflowed to 0 (a replayed set the current router all but rules out; 0 / 0 would be NaN):
    there the softmax over those experts' logits, the same quantity computed without the underflow."""
    stable = torch.softmax(logits.float().gather(-1, indices), dim=-1)  # [T, k]: no host sync to decide where
    return torch.where(total <= 1e-20, stable, top / total.clamp_min(1e-30))


class HFRouter:
    """transformers' top-k router (``Qwen3VLMoeTextTopKRouter``, ``Qwen3_5MoeTopKRouter``) as a plan routes it: its
    own forward when nothing is replayed (the class's numbers, bit for bit); over replayed experts the softmax of its
    logits gathered there and renormalised, in the logits' dtype, as the class weights its own choice."""

    def __init__(self, module, original):
        self.module, self.original, self.top_k = module, original, int(module.top_k)

    def fresh(self, hidden_states):
        return self.original(hidden_states)

    def logits(self, hidden_states):
        return F.linear(hidden_states.reshape(-1, self.module.hidden_dim), self.module.weight)

    def weights(self, logits, probs, indices):
        top = probs.gather(-1, indices)
        return renormalised(top, top.sum(dim=-1, keepdim=True), logits, indices).to(logits.dtype)
