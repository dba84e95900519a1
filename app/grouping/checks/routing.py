"""Two routing records compared (the self-check's grouped and repeated forwards, the benchmarks' rollout and update):
how many tokens and decisions differ, and where the first one is."""

from __future__ import annotations

import torch

from app.grouping.experts.record import Routing


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
