"""A model's sparse (mixture-of-experts) layers: where they are, how many experts and how many per token, and the
experts implementation transformers dispatches to (``eager``, ``batched_mm``, ``grouped_mm``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

EXPERTS_IMPLEMENTATIONS = ("auto", "grouped_mm", "eager", "batched_mm")


def is_router(module) -> bool:
    """A top-k router as transformers' Qwen MoE blocks have it (``Qwen3VLMoeTextTopKRouter``,
    ``Qwen3_5MoeTopKRouter``): a [E, H] weight, ``top_k`` and ``num_experts``."""
    weight = getattr(module, "weight", None)
    return hasattr(module, "top_k") and hasattr(module, "num_experts") and isinstance(weight, torch.nn.Parameter) \
        and len(getattr(weight, "ds_shape", weight.shape)) == 2  # under ZeRO-3 the local shape is a partition


def fused_experts(block):
    """A sparse block's fused experts module (``gate_up_proj`` [E, 2I, H], ``down_proj``), under the peft wrappers
    that LoRA on expert weights puts around it (``lora.target_parameters``), or None."""
    experts = getattr(block, "experts", None)
    while experts is not None and not hasattr(experts, "gate_up_proj"):
        experts = getattr(experts, "base_layer", None)
    return experts


def is_sparse_block(module) -> bool:
    """A sparse block: a router ``gate`` and fused ``experts`` (``gate_up_proj`` [E, 2I, H], ``down_proj``)."""
    return is_router(getattr(module, "gate", None)) and fused_experts(module) is not None


@dataclass(frozen=True)
class SparseLayer:
    index: int  # the decoder layer's index
    layer: torch.nn.Module  # the decoder layer
    block: torch.nn.Module  # its sparse block (``layer.mlp``)


def sparse_layers(model) -> list[SparseLayer]:
    """The decoder layers whose MLP is a sparse block, in order (empty for a dense model)."""
    model = getattr(model, "module", model)
    out = []
    for module in model.modules():
        block = getattr(module, "mlp", None)
        if block is not None and is_sparse_block(block) and isinstance(module, torch.nn.Module):
            index = _layer_index(module, len(out))
            out.append(SparseLayer(index, module, block))
    return out


def _layer_index(layer, fallback: int) -> int:
    for name in ("self_attn", "linear_attn"):
        index = getattr(getattr(layer, name, None), "layer_idx", None)
        if index is not None:
            return int(index)
    return fallback


def is_moe(model) -> bool:
    return bool(sparse_layers(model))


@dataclass(frozen=True)
class ExpertShape:
    """What routing needs to know of a model: its sparse layers' indices, experts per layer, experts per token."""

    layers: tuple[int, ...]
    experts: int
    top_k: int

    def record_bytes_per_token(self, dtype: torch.dtype = torch.int16) -> int:
        """Bytes one token's routing record takes: one expert id per sparse layer and routed slot."""
        return len(self.layers) * self.top_k * torch.empty((), dtype=dtype).element_size()


def expert_shape(model) -> ExpertShape | None:
    found = sparse_layers(model)
    if not found:
        return None
    gate = found[0].block.gate
    return ExpertShape(tuple(s.index for s in found), int(gate.num_experts), int(gate.top_k))


def experts_implementation(model) -> str | None:
    """The experts implementation the model's text config dispatches to, or None for a dense model."""
    if not is_moe(model):
        return None
    config = getattr(model, "module", model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "_experts_implementation", None) or "eager"


def grouped_mm_available() -> bool:
    """Whether this torch has the grouped matrix product transformers' ``grouped_mm`` experts call (torch 2.13 has
    it on CPU too; older GPU hosts may not)."""
    return hasattr(torch, "_grouped_mm") or hasattr(torch.nn.functional, "grouped_mm")


def choose_experts_implementation(setting: str = "auto") -> str:
    """``model.experts_implementation``: ``auto`` is ``grouped_mm`` where torch has it (one grouped product for all
    experts), else ``eager`` (a loop over the experts a batch hit); both give the same numbers (tests)."""
    if setting not in EXPERTS_IMPLEMENTATIONS:
        raise ValueError(f"unknown experts implementation {setting!r}; expected one of {EXPERTS_IMPLEMENTATIONS}")
    if setting == "auto":
        return "grouped_mm" if grouped_mm_available() else "eager"
    return setting


def set_experts_implementation(model, name: str) -> None:
    """Point a MoE model's experts (text config) at ``name``; a dense model is left alone."""
    model = getattr(model, "module", model)
    if is_moe(model):
        model.set_experts_implementation(name)


def describe_experts(model) -> str:
    """One sentence on a mixture-of-experts model: its sparse layers, experts and top-k, the experts implementation
    in use, and whether its routers and routed experts train."""
    layers = sparse_layers(model)
    shape, block = expert_shape(model), layers[0].block
    config = getattr(model, "module", model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    routers = any(p.requires_grad for p in block.gate.parameters())
    experts = any(p.requires_grad for p in block.experts.parameters())
    return (f"mixture of experts: {len(layers)} of {text.num_hidden_layers} decoder layers sparse "
            f"({type(block).__name__}), {shape.experts} experts, top-{shape.top_k}; experts implementation "
            f"{experts_implementation(model)}; routers {'train' if routers else 'frozen'}, routed experts "
            f"{'train' if experts else 'frozen'}; router statistics per logical token")


def released_expert_tensors(name: str, tensor, family: str) -> list:
    """One of the model's fused expert tensors (``mlp.experts.gate_up_proj`` [E, 2I, H] or ``down_proj`` [E, H, I])
    as the released checkpoints store it (what transformers converts on load): Qwen3-VL-MoE's fused tensors
    transposed ([E, H, 2I], [E, I, H]); Qwen3.5-MoE's one tensor per expert and projection
    (``experts.{j}.gate_proj.weight`` [I, H], ``up_proj`` [I, H], ``down_proj`` [H, I]). Any other tensor as is.
    [(name, tensor)]."""
    if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return [(name, tensor)]
    if family == "qwen3_vl_moe":
        return [(name, tensor.transpose(1, 2).contiguous())]
    if name.endswith("gate_up_proj"):  # [E, 2I, H]: gate rows first, then up rows
        base, half = name.removesuffix("gate_up_proj"), tensor.shape[1] // 2
        return [pair for j in range(tensor.shape[0]) for pair in (
            (f"{base}{j}.gate_proj.weight", tensor[j, :half].contiguous()),
            (f"{base}{j}.up_proj.weight", tensor[j, half:].contiguous()))]
    base = name.removesuffix("down_proj")
    return [(f"{base}{j}.down_proj.weight", tensor[j].contiguous()) for j in range(tensor.shape[0])]
