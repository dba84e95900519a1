"""A sparse block's router as a ``RoutePlan`` routes it (``routing.install`` patches both kinds): transformers' own
(``HFRouter``) and DeepSpeed AutoEP's expert-parallel one (``EPRouter``). Each gives a plan the same three things by
its own rule: its fresh choice (logits, gate weights, expert ids), its logits, and its gate weights over given experts
(a replay), so a replayed or counted forward computes what the un-patched block would have over those experts.
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


class EPRouter:
    """AutoEP's token-choice router (``blocks.is_ep_router``) as a plan routes it, by its own rule: the softmax of its
    ``gate``'s logits in float32, the top-k, their probabilities renormalised (``route_norm``, with AutoEP's 1e-20)
    and scaled (``route_scale``), kept in float32. The Qwen families' rule only: a router with another score function,
    a load-balancing or score-correction bias, or group-limited routing is refused, never routed otherwise."""

    def __init__(self, module, expert_bias=None):
        unsupported = [what for what, present in (
            (f"score_func={module.score_func!r}", module.score_func != "softmax"),
            ("a load-balancing expert bias", expert_bias is not None),
            ("a score-correction bias", getattr(module, "e_score_correction_bias", None) is not None),
            ("group-limited routing", getattr(module, "num_expert_groups", None) is not None)) if present]
        if unsupported:
            raise RoutingError(f"this expert-parallel router has {', '.join(unsupported)}: routing replay and router "
                               "statistics follow the Qwen mixture-of-experts rule (softmax top-k) only")
        self.module, self.top_k = module, int(module.top_k)

    def logits(self, hidden_states):
        return self.module.gate(hidden_states.reshape(-1, self.module.gate.in_features))

    def weights(self, logits, probs, indices):
        top = probs.gather(-1, indices)
        if self.module.route_norm:
            top = renormalised(top, top.sum(dim=-1, keepdim=True) + 1e-20, logits, indices)
        return top * self.module.route_scale

    def fresh(self, hidden_states):
        logits = self.logits(hidden_states)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        indices = torch.topk(probs, self.top_k, dim=-1).indices
        return logits, self.weights(logits, probs, indices), indices

    def tokens_per_expert(self, indices) -> torch.Tensor:
        """[E] int32: the routed (token, slot) pairs each expert receives, as AutoEP's router returns them."""
        return torch.bincount(indices.reshape(-1), minlength=int(self.module.num_experts)).to(torch.int32)
