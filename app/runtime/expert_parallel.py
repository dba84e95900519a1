"""Expert parallelism (``train.expert_parallel_size`` = EP > 1) through DeepSpeed's AutoEP under ZeRO-3.

AutoEP (DeepSpeed 0.19.8, ``deepspeed/module_inject/auto_ep*``) replaces each sparse block at ``deepspeed.initialize``
by an ``AutoEPMoELayer``: the same router (its ``gate`` a linear layer), the rank's E / EP experts as grouped tensors
(``experts.w1`` gate, ``w3`` up [E / EP, I, H], ``w2`` down [E / EP, H, I]) and an all-to-all that sends each token's
k routed copies to the ranks holding their experts and brings the outputs back. ZeRO-3 then partitions a rank's
experts over its expert-data-parallel group (world / EP ranks) and everything else over the world, as before: what a
forward gathers of a sparse layer is E / EP experts, not E.

This module is the one place that knows AutoEP:
- ``section``: the DeepSpeed config's ``expert_parallel`` section for a Qwen mixture-of-experts family. AutoEP has no
  Qwen3-VL-MoE preset, and its Qwen3.5 preset accepts only the text backbone (``qwen3_5_moe_text``), so both VL
  families run on its ``qwen3_moe`` preset, whose block is theirs: a router ``gate`` [E, H], fused ``gate_up_proj``
  [E, 2I, H] (gate rows first) and ``down_proj`` [E, H, I], softmax top-k with the k weights renormalised and applied
  after the experts, and Qwen3.5-MoE's shared expert behind its sigmoid gate. The project supplies what the preset
  cannot read from a VL model: the layer pattern under ``model.language_model`` (``LAYER_PATTERN``), top-k (from the
  text config: AutoEP asks the VL model's top-level config, which lacks it) and ``route_norm`` (both families'
  routers always renormalise; Qwen3-VL-MoE's config has no ``norm_topk_prob``). AutoEP's own load-balancing bias
  stays off (``load_balance_coeff``): the routers' loss is the project's (``grpo.router_aux_loss_coef``).
- ``problems``: what a run with EP > 1 cannot do, as sentences naming the setting, before any weight is read.
- ``hf_state_dict``: a gathered state dict in the checkpoint's own names and layout (the exported model loads with
  transformers as the source did): each block's experts gathered over its expert-parallel group, the router, the
  shared expert and its gate under their transformers names.
"""

from __future__ import annotations

import torch

from app.grouping.experts.blocks import BlockKind, expert_parallel_size, register_kind
from app.grouping.experts.routers import RoutingError, renormalised

PRESET = "qwen3_moe"  # AutoEP's preset whose block is the Qwen VL families' (see the module's doc)
LAYER_PATTERN = r"(?:.+\.)?language_model\.layers\.\d+\.mlp"  # a VL model's sparse blocks (AutoEP's: model.layers.N.mlp)
FAMILIES = ("qwen3_vl_moe", "qwen3_5_moe")
# AutoEP's names inside a replaced block -> transformers' (the router is ``router.gate``; ``gate`` is AutoEP's alias
# of the same router for transformers' output recorders, dropped on the way out)
RENAMED = {"router.gate.weight": "gate.weight", "shared_experts.": "shared_expert.",
           "shared_experts_gate.": "shared_expert_gate."}


def is_ep_router(module) -> bool:
    """AutoEP's token-choice router (``deepspeed.moe.ep_router.TokenChoiceTopKRouter``): a linear ``gate`` [E, H],
    ``top_k``, ``num_experts`` and its scoring (``score_func``, ``route_norm``, ``route_scale``)."""
    return isinstance(getattr(module, "gate", None), torch.nn.Linear) and hasattr(module, "top_k") \
        and hasattr(module, "num_experts") and hasattr(module, "score_func") and hasattr(module, "route_norm")


def is_ep_block(module) -> bool:
    """AutoEP's replacement of a sparse block (``AutoEPMoELayer``): an expert-parallel ``router`` and the rank's
    share of the experts as ``experts.w1`` / ``w2`` / ``w3`` ([E / EP, I, H], [E / EP, H, I], [E / EP, I, H])."""
    experts = getattr(module, "experts", None)
    return is_ep_router(getattr(module, "router", None)) and all(
        isinstance(getattr(experts, name, None), torch.nn.Parameter) for name in ("w1", "w2", "w3"))


class EPRouter:
    """AutoEP's token-choice router (``is_ep_router``) as a plan routes it, by its own rule: the softmax of its
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


def _route(plan, index, router, original, hidden_states, expert_bias=None):
    """AutoEP's router patched for a plan: AutoEP's own return, (gate weights, expert ids, tokens per expert)."""
    adapter = EPRouter(router, expert_bias)
    _, scores, indices = plan.route(adapter, hidden_states, index)
    return scores, indices, adapter.tokens_per_expert(indices)


# the grouping core routes AutoEP's blocks through this kind (its router is ``router``, the logits its ``gate``'s;
# its experts see the tokens in expert order, so the whole block's output is the experts' contribution)
AUTOEP = BlockKind("autoep", is_ep_block, router=lambda block: block.router, logits_module=lambda block: block.router.gate,
                   experts_output=lambda block: block, route=_route, group_size=lambda block: int(block.ep_size))
register_kind(AUTOEP)


def section(config, size: int) -> dict:
    """The DeepSpeed config's ``expert_parallel`` section for a model of ``config`` (a transformers config of a
    Qwen mixture-of-experts VL family) on ``size`` expert-parallel ranks."""
    from app.grouping.experts.blocks import grouped_mm_available

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {"enabled": True, "autoep_size": int(size), "preset_model": PRESET, "moe_layer_pattern": LAYER_PATTERN,
            "top_k": int(text.num_experts_per_tok), "route_norm": True, "use_grouped_mm": grouped_mm_available()}


def reference_section(ds_config: dict, model) -> dict:
    """``ds_config`` (the policy's, with its ``expert_parallel`` section) for a frozen reference ``model``: the section
    made for the reference's own config at the policy's size, or none for a dense reference (a separate
    ``model.reference_path``), which AutoEP would refuse for having no sparse blocks."""
    from app.grouping.experts.blocks import is_moe

    config = dict(ds_config)
    size = config.pop("expert_parallel")["autoep_size"]
    if is_moe(model):
        config["expert_parallel"] = section(model.config, size)
    return config


def problems(*, size: int, model_type: str | None = None, experts: int | None = None, world: int | None = None,
             sequence_parallel: int = 1, zero_stage: int | None = None, lora_rank: int = 0, lora_targets=(),
             engine: str | None = None, in_process: bool = True, tools: bool = False) -> list[str]:
    """Why ``size`` expert-parallel ranks cannot run, one phrase each, to follow "train.expert_parallel_size=N"
    (empty: they can): the one rule, asked by the config checks (the settings alone), the preflight (the checkpoint's
    config.json, the world being launched, the DeepSpeed JSON) and the planner. Each caller passes what it knows
    (None: not known there). ``experts``: the routed experts of each sparse layer (0: a dense model); ``engine`` /
    ``in_process``: the rollout engine and whether it samples from the policy in this process (through its
    expert-parallel layers: ``app.rollout.registry.IN_PROCESS``)."""
    if size == 1:
        return []
    if size < 1:
        return [f"must be >= 1, got {size}"]
    out = []
    if experts is not None and not experts:
        out.append(f"needs a mixture-of-experts model; this {model_type} checkpoint has no routed experts")
    elif experts is not None and model_type is not None and model_type not in FAMILIES:
        out.append(f"runs the Qwen mixture-of-experts VL families {list(FAMILIES)}, not {model_type}")
    elif experts is not None and experts % size:
        sizes = [d for d in range(1, experts + 1) if experts % d == 0 and d <= (world or experts)]
        out.append(f"does not divide the {experts} routed experts of each sparse layer (each rank holds "
                   f"E / EP of them); sizes that do and fit {world} rank(s): {sizes}")
    if world is not None and world % size:
        out.append(f"does not divide the data-parallel world ({world} rank(s)): every expert-parallel group is {size} "
                   "ranks of it")
    if sequence_parallel > 1:
        out.append(f"cannot be combined with train.sequence_parallel_size={sequence_parallel} yet (the expert-parallel "
                   "groups are not laid out against the sequence-parallel ones)")
    if zero_stage is not None and zero_stage != 3:
        out.append(f"runs under ZeRO-3 (train.deepspeed_config with stage 3, e.g. deepspeed_configs/zero3.json"
                   f"), not stage {zero_stage}: under ZeRO-1/2 DeepSpeed needs the optimizer's parameter groups split "
                   "by expert group, which this trainer does not build")
    if lora_targets:
        out.append(f"cannot be combined with LoRA on the routed experts (lora.target_parameters={list(lora_targets)}): "
                   "AutoEP replaces the fused expert tensors by its own, so the adapters would be dropped")
    elif lora_rank:
        out.append(f"trains full weights only, not LoRA (lora.rank={lora_rank}): LoRA leaves the routed experts "
                   "frozen, and DeepSpeed 0.19.8's AutoEP cannot checkpoint frozen expert weights under ZeRO-3 (\"does "
                   "not support frozen expert parameters yet\"); set lora.rank=0 or train.expert_parallel_size=1")
    if engine is not None and not in_process:
        out.append(f"samples with rollout.engine grouped or hf (through the expert-parallel layers), not {engine} "
                   "(vLLM's own expert parallelism, enable_expert_parallel, is vLLM's: the push of an expert-parallel "
                   "policy into it is not built)")
    if tools:
        out.append("is not available with rollout.tools (prefix trees through expert-parallel layers are not tested)")
    return out


def size_of(engine) -> int:
    """The expert-parallel size of a built engine (or module): 1 without AutoEP."""
    return expert_parallel_size(getattr(engine, "module", engine))


def is_expert_weight(param) -> bool:
    """An AutoEP block's expert tensor (a rank's share of the experts; AutoEP tags them for the expert groups)."""
    return getattr(param, "ds_zero_placement_family", None) == "autoep_expert"


def ep_blocks(module) -> dict[str, torch.nn.Module]:
    """{module name: AutoEP block} of a model (empty without expert parallelism)."""
    return {name: m for name, m in module.named_modules() if is_ep_block(m)}


def full_experts(block) -> dict[str, torch.Tensor] | None:
    """One AutoEP block's experts gathered over its expert-parallel group, in transformers' fused layout:
    ``gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and ``down_proj`` [E, H, I], on the CPU of global rank 0
    (None elsewhere). Only rank 0's group gathers (every rank of it calls this; the other groups hold copies of the
    same experts and skip it); under ZeRO-3 inside a ``GatheredParameters`` of its weights."""
    import torch.distributed as dist

    if block.ep_size > 1 and 0 not in dist.get_process_group_ranks(block.ep_group):
        return None
    mine = block.ep_size == 1 or dist.get_rank() == 0

    def whole(param):
        local = param.detach().contiguous()
        if block.ep_size == 1:
            return local.cpu()
        parts = [torch.empty_like(local) for _ in range(block.ep_size)]
        dist.all_gather(parts, local, group=block.ep_group)  # rank r holds experts [r E/EP, (r + 1) E/EP)
        return torch.cat(parts).cpu() if mine else None

    gate, up, down = (whole(block.experts.w1), whole(block.experts.w3), whole(block.experts.w2))
    return {"gate_up_proj": torch.cat([gate, up], dim=1), "down_proj": down} if mine else None


def hf_state_dict(module, state: dict | None) -> dict | None:
    """``state`` (``module``'s state dict gathered on rank 0, None elsewhere) in transformers' names and layout: each
    AutoEP block's experts whole (``full_experts``, collective over rank 0's expert-parallel group: every rank calls
    this inside the gather of the module's parameters), its router and shared expert renamed (``RENAMED``), AutoEP's
    alias and buffers dropped.
    A module without AutoEP blocks: ``state`` unchanged."""
    blocks = ep_blocks(module)
    if not blocks:
        return state
    experts = {name: full_experts(block) for name, block in blocks.items()}
    if state is None:
        return None
    out = {}
    for key, value in state.items():
        prefix = next((name for name in blocks if key.startswith(name + ".")), None)
        if prefix is None:
            out[key] = value
            continue
        rest = key[len(prefix) + 1:]
        if rest.startswith(("experts.", "gate.", "tokens_per_expert", "expert_bias")):  # the experts go whole below
            continue
        for old, new in RENAMED.items():
            if rest.startswith(old):
                rest = new + rest[len(old):]
                break
        out[f"{prefix}.{rest}"] = value
    for prefix, tensors in experts.items():
        for name, tensor in tensors.items():
            out[f"{prefix}.experts.{name}"] = tensor
    return out


def describe(module) -> str:
    """One line for the log: the expert-parallel groups and what each rank holds."""
    blocks = ep_blocks(module)
    if not blocks:
        return "expert parallelism off"
    block = next(iter(blocks.values()))
    return (f"expert parallelism: {len(blocks)} sparse layers on {block.ep_size} expert-parallel ranks (DeepSpeed "
            f"AutoEP, preset {PRESET}), {block.num_local_experts} of {block.num_experts} experts per rank, tokens "
            "sent to their experts' ranks by an all-to-all; under ZeRO-3 a forward gathers a sparse layer's "
            f"{block.num_local_experts} local experts, not {block.num_experts}")
