"""GRPO advantages and loss: pure tensor functions, no model code."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def group_advantages(rewards: torch.Tensor, group_sizes: Sequence[int], scale: bool = True,
                     eps: float = 1e-4) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps) per completion; without ``scale``, only centred."""
    out = torch.empty_like(rewards)
    start = 0
    for size in group_sizes:
        group = rewards[start : start + size]
        centred = group - group.mean()
        if scale:
            std = group.std() if size > 1 else group.new_zeros(())
            centred = centred / (std + eps)
        out[start : start + size] = centred
        start += size
    return out


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate exp(r - p) - (r - p) - 1 (always >= 0)."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    aggregation: str = "sequence",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-ratio policy loss plus beta * KL, aggregated per sequence (GRPO) or per token (DAPO).

    All per-token tensors are [N, L]; ``advantages`` is [N]; ``mask`` marks real completion tokens.
    """
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    adv = advantages[:, None]
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if ref_logprobs is not None and beta > 0:
        kl = k3_kl(logprobs, ref_logprobs)
        per_token = per_token + beta * kl
    if aggregation == "sequence":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp_min(1)).mean()
    elif aggregation == "token":
        loss = (per_token * mask).sum() / mask.sum().clamp_min(1)
    else:
        raise ValueError(f"unknown loss aggregation {aggregation!r}; expected 'sequence' or 'token'")
    tokens = mask.sum().clamp_min(1)
    with torch.no_grad():
        low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(mask.dtype)
        high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)
        metrics = {
            "clip_fraction": float(((low + high) * mask).sum() / tokens),
            "clip_fraction_low": float((low * mask).sum() / tokens),
            "clip_fraction_high": float((high * mask).sum() / tokens),
            "kl": float((kl * mask).sum() / tokens) if kl is not None else 0.0,
        }
    return loss, metrics
