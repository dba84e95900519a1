"""A model's sparse (mixture-of-experts) layers: where they are, how many experts and how many per token, and the
experts implementation transformers dispatches to (``eager``, ``batched_mm``, ``grouped_mm``).

A sparse block is transformers' own (a top-k router ``gate`` beside fused ``experts``) or a kind another package
registers (``BlockKind``, ``register_kind``): under expert parallelism (``train.expert_parallel_size`` > 1) DeepSpeed
AutoEP's replacement, which ``app.runtime.expert_parallel`` alone knows. This package imports neither DeepSpeed nor
the runtime that builds it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

EXPERTS_IMPLEMENTATIONS = ("auto", "grouped_mm", "eager", "batched_mm")


def is_router(module) -> bool:
    """A top-k router as transformers' Qwen MoE blocks have it (``Qwen3VLMoeTextTopKRouter``,
    ``Qwen3_5MoeTopKRouter``): a [E, H] weight, ``top_k`` and ``num_experts``."""
    weight = getattr(module, "weight", None)
    return hasattr(module, "top_k") and hasattr(module, "num_experts") and isinstance(weight, torch.nn.Parameter) \
        and len(getattr(weight, "ds_shape", weight.shape)) == 2  # under ZeRO-3 the local shape is a partition


@dataclass(frozen=True)
class BlockKind:
    """A kind of sparse block the core can route, registered by the package that owns it (``register_kind``):
    transformers' own is built in; DeepSpeed AutoEP's expert-parallel replacement is ``app.runtime.expert_parallel``'s
    (this package names none of AutoEP's attributes). ``router``: the module whose forward routes (``patch.install``
    patches it); ``logits_module`` / ``experts_output``: whose outputs are the router logits and the routed experts'
    contribution (the self-check's parts); ``route(plan, index, router, original, *args)``: what the patched router
    returns for a plan (``plan.route`` through the kind's router adapter, in its own return format); ``group_size``:
    the block's expert-parallel size."""

    name: str
    is_block: Callable
    router: Callable
    logits_module: Callable
    experts_output: Callable
    route: Callable
    group_size: Callable = lambda block: 1


def _route_hf(plan, index, router, original, hidden_states):
    from app.grouping.experts.routers import HFRouter

    return plan.route(HFRouter(router, original.__get__(router)), hidden_states, index)


TRANSFORMERS = BlockKind("transformers", lambda m: is_router(getattr(m, "gate", None)) and fused_experts(m) is not None,
                         router=lambda block: block.gate, logits_module=lambda block: block.gate,
                         experts_output=lambda block: fused_experts(block), route=_route_hf)
KINDS: list[BlockKind] = [TRANSFORMERS]


def register_kind(kind: BlockKind) -> None:
    """Let the core route ``kind``'s blocks too (idempotent; a kind registered later is recognised first)."""
    if all(k.name != kind.name for k in KINDS):
        KINDS.insert(0, kind)


def kind_of(block) -> BlockKind | None:
    return next((k for k in KINDS if k.is_block(block)), None)


def router_of(block):
    """The module that routes a sparse block's tokens (transformers' ``gate``, or a registered kind's router)."""
    return kind_of(block).router(block)


def router_logits_module(block):
    """The module whose output is the block's router logits [tokens, E]."""
    return kind_of(block).logits_module(block)


def experts_output_module(block):
    """The module whose output is the routed experts' contribution per token."""
    return kind_of(block).experts_output(block)


def fused_experts(block):
    """A sparse block's fused experts module (``gate_up_proj`` [E, 2I, H], ``down_proj``), under the peft wrappers
    that LoRA on expert weights puts around it (``lora.target_parameters``), or None."""
    experts = getattr(block, "experts", None)
    while experts is not None and not hasattr(experts, "gate_up_proj"):
        experts = getattr(experts, "base_layer", None)
    return experts


def is_sparse_block(module) -> bool:
    """A sparse block of a known kind (``KINDS``): a router ``gate`` and fused ``experts`` (``gate_up_proj``
    [E, 2I, H], ``down_proj``), or a registered replacement of one."""
    return kind_of(module) is not None


def expert_parallel_size(model) -> int:
    """The expert-parallel group size of a model's sparse blocks (1: transformers' own blocks, or a dense model)."""
    for s in sparse_layers(model):
        return int(kind_of(s.block).group_size(s.block))
    return 1


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


def config_expert_shape(config) -> ExpertShape | None:
    """``expert_shape`` from a (composite or text) config alone, as transformers builds the layers: a layer is sparse
    unless ``mlp_only_layers`` names it, every ``decoder_sparse_step``-th (Qwen3.5-MoE: every layer)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = int(getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0) or 0)
    if not experts:
        return None
    step = int(getattr(text, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(text, "mlp_only_layers", None) or ())
    layers = tuple(i for i in range(text.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    return ExpertShape(layers, experts, int(text.num_experts_per_tok))


def expert_shape(model) -> ExpertShape | None:
    found = sparse_layers(model)
    if not found:
        return None
    router = router_of(found[0].block)
    return ExpertShape(tuple(s.index for s in found), int(router.num_experts), int(router.top_k))


def experts_implementation(model) -> str | None:
    """The experts implementation the model's text config dispatches to, or None for a dense model; under expert
    parallelism AutoEP's own (``autoep``: its grouped experts over the rank's share)."""
    if not is_moe(model):
        return None
    kind = kind_of(sparse_layers(model)[0].block)
    if kind is not TRANSFORMERS:
        return kind.name  # the kind's own experts (AutoEP: its grouped experts over the rank's share)
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


def routers_train(model) -> bool:
    """Whether any sparse block's router has a parameter that trains (LoRA freezes them)."""
    return any(p.requires_grad for s in sparse_layers(model) for p in router_of(s.block).parameters())


def describe_experts(model) -> str:
    """One sentence on a mixture-of-experts model: its sparse layers, experts and top-k, the experts implementation
    in use, and whether its routers and routed experts train."""
    layers = sparse_layers(model)
    shape, block = expert_shape(model), layers[0].block
    config = getattr(model, "module", model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    routers = routers_train(model)
    experts = any(p.requires_grad for p in block.experts.parameters())
    ep = expert_parallel_size(model)
    where = f", {shape.experts // ep} of them on each of {ep} expert-parallel ranks" if ep > 1 else ""
    return (f"mixture of experts: {len(layers)} of {text.num_hidden_layers} decoder layers sparse "
            f"({type(block).__name__}), {shape.experts} experts{where}, top-{shape.top_k}; experts implementation "
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
