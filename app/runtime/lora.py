"""LoRA adapters (peft) and frozen towers on the policy; the reference as "adapters off"; merged and adapter export.

Adapters are injected in place (``peft.inject_adapter_in_model``): the model keeps its own class and module tree, so
the grouped forward, the rollouts and DeepSpeed see the same model with a few more (trainable) Linear layers, and
every base weight frozen. Which Linear layers get adapters is decided from the module names:
- language model: the projections named in ``lora.target_modules`` (Qwen: q/k/v/o and gate/up/down);
- vision tower (``lora.vision_tower``): every Linear under ``visual`` outside the merger;
- projector (``lora.projector``): the merger(s) that map vision features into the language model;
- routed experts of a mixture-of-experts model (``lora.target_parameters``): their fused 3-D weights (not Linear
  layers) through peft's ``target_parameters`` (``ParamWrapper``: one low-rank pair per expert, the delta added to
  the weight for the call). Without it the routed experts stay frozen, said once by name; the routers are base
  weights and never get adapters (full-weight training freezes them too unless ``model.train_router``).
The output head and the embeddings never get adapters.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger("app.runtime.lora")
ADAPTER = "default"  # peft's adapter name; one adapter per model here
PROJECTOR_PARTS = ("merger", "deepstack_merger_list")


def part_of(name: str) -> str:
    """'language', 'vision' or 'projector' for a parameter or module name of a Qwen(-VL) model."""
    parts = name.split(".")
    if "visual" not in parts:
        return "language"
    return "projector" if any(p in PROJECTOR_PARTS for p in parts) else "vision"


def freeze(model, vision_tower: bool, projector: bool) -> int:
    """Stop training the vision tower and/or the projector; returns how many parameters were frozen."""
    frozen = 0
    for name, param in model.named_parameters():
        part = part_of(name)
        if (part == "vision" and vision_tower) or (part == "projector" and projector):
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


def target_names(model, lora_cfg) -> list[str]:
    """Full names of the Linear modules that get adapters (of a model without adapters yet)."""
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name.split(".")[-1] == "lm_head":
            continue
        part = part_of(name)
        if ((part == "language" and name.split(".")[-1] in lora_cfg.target_modules)
                or (part == "vision" and lora_cfg.vision_tower) or (part == "projector" and lora_cfg.projector)):
            names.append(name)
    if not names:
        raise ValueError(f"lora.target_modules={list(lora_cfg.target_modules)} matches no Linear layer of "
                         f"{type(model).__name__}")
    return names


def target_parameter_names(model, lora_cfg) -> list[str]:
    """Full names of the language model's parameters that ``lora.target_parameters`` names (by their name's end,
    e.g. ``mlp.experts.gate_up_proj``); a name that matches none stops with the name and what it could have been."""
    wanted = list(getattr(lora_cfg, "target_parameters", []) or [])
    names = [n for n, _ in model.named_parameters() if part_of(n) == "language"]
    out = []
    for want in wanted:
        hits = [n for n in names if n == want or n.endswith("." + want)]
        if not hits:
            experts = sorted({".".join(n.split(".")[-3:]) for n in names if ".experts." in n})
            raise ValueError(f"lora.target_parameters entry {want!r} matches no parameter of {type(model).__name__}"
                             + (f" (its expert weights end in {experts})" if experts else " (it has no experts)"))
        out += hits
    return out


def expert_coverage(model, lora_cfg) -> str | None:
    """For LoRA on a mixture-of-experts model: a sentence when no routed expert weight gets an adapter (the
    experts' fused weights are no Linear layers, so ``lora.target_modules`` never reaches them), else None."""
    from app.grouping.experts.blocks import sparse_layers

    layers = sparse_layers(model)
    if not lora_cfg.rank or not layers:
        return None
    adapted = target_parameter_names(model, lora_cfg)
    if any(".experts." in n for n in adapted):
        return None
    shared = any(n.endswith(("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"))
                 for n in target_names(model, lora_cfg))
    weights = sorted({n.split(".")[-1] for n, _ in layers[0].block.experts.named_parameters()})
    return (f"LoRA adapts none of the {len(layers)} sparse layers' routed experts ({', '.join(weights)} are fused "
            "expert weights, not Linear layers, so lora.target_modules cannot reach them)"
            + ("; the shared expert is adapted" if shared else "")
            + ": they stay frozen. Set lora.target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj] to "
            "train them")


def peft_config(model, lora_cfg):
    from peft import LoraConfig

    parameters = target_parameter_names(model, lora_cfg)
    return LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout, bias="none",
                      target_modules=target_names(model, lora_cfg), **({"target_parameters": parameters}
                                                                      if parameters else {}))


def freeze_routers(model) -> int:
    """Stop training every sparse block's router (``mlp.gate``); returns how many parameters were frozen."""
    from app.grouping.experts.blocks import sparse_layers

    frozen = 0
    for s in sparse_layers(model):
        for param in s.block.gate.parameters():
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


def prepare(model, lora_cfg, model_cfg, seed: int | None = None):
    """The policy as configured: towers frozen (``model.freeze_*``), the routers frozen (``model.train_router``
    off), LoRA adapters injected (``lora.rank`` > 0), drawn from ``seed`` when given: their initialisation then
    depends on the seed alone, not on what the load drew before (a ZeRO-3 load draws otherwise than a plain one)."""
    freeze(model, model_cfg.freeze_vision_tower, model_cfg.freeze_projector)
    if not getattr(model_cfg, "train_router", False):
        freeze_routers(model)
    if lora_cfg.rank:
        note = expert_coverage(model, lora_cfg)
        if note:
            log.warning("%s", note)
        if seed is not None:
            torch.manual_seed(seed)
        apply(model, lora_cfg)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("nothing left to train: every parameter is frozen")
    return model


def apply(model, lora_cfg):
    """Inject LoRA adapters in place; every other parameter is frozen. Returns the model."""
    from peft import inject_adapter_in_model

    return inject_adapter_in_model(peft_config(model, lora_cfg), model, adapter_name=ADAPTER)


def has_adapters(model) -> bool:
    return any(_is_lora_layer(m) for m in model.modules())


def _is_lora_layer(module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


@contextmanager
def adapters_disabled(model, disabled: bool = True):
    """The base model inside the block: every LoRA layer returns its base layer's output. The adapters' own
    parameters (and their requires_grad, which DeepSpeed's gradient hooks rely on) are left untouched."""
    layers = [m for m in model.modules() if _is_lora_layer(m)] if disabled else []
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True  # what peft's enable_adapters(False) sets, without toggling requires_grad
    try:
        yield model
    finally:
        for m, was in zip(layers, before):
            m._disable_adapters = was


class AdaptersOff:
    """The KL reference of a LoRA policy: the policy itself (an engine or module) with its adapters disabled.

    No second copy of the weights exists; the trainer passes this wherever it would pass a reference model."""

    def __init__(self, policy):
        self.policy = policy


def resolve(model) -> tuple[object, bool]:
    """What to run for a "reference" (or any model) argument, and whether its adapters go off while it runs."""
    return (model.policy, True) if isinstance(model, AdaptersOff) else (model, False)


def _lora_prefixes(state: dict) -> list[str]:
    return [k[: -len(".base_layer.weight")] for k in state if k.endswith(".base_layer.weight")]


def _wrapper_prefixes(state: dict) -> list[str]:
    """peft ``ParamWrapper``s (adapters on a 3-D expert weight): adapter keys with no ``base_layer.weight``."""
    linear = set(_lora_prefixes(state))
    suffix = f".lora_A.{ADAPTER}.weight"
    return [k[: -len(suffix)] for k in state if k.endswith(suffix) and k[: -len(suffix)] not in linear]


def _wrapped_parameter(state: dict, wrapper: str) -> tuple[str, str]:
    """(state key, merged key) of the expert weight a ``ParamWrapper`` adapts: among the module's parameters under
    its ``base_layer`` chain, the one whose [E, out, in] (or [E, in, out]) shape the adapter's factors fit."""
    module = wrapper
    while module.endswith(".base_layer"):
        module = module[: -len(".base_layer")]
    a, b = state[f"{wrapper}.lora_A.{ADAPTER}.weight"], state[f"{wrapper}.lora_B.{ADAPTER}.weight"]
    fits = (b.shape[0], a.shape[1])
    found = []
    for key, value in state.items():
        rest = key[len(module):].split(".")
        if key.startswith(module + ".") and len(rest) > 2 and set(rest[1:-1]) == {"base_layer"} and value.ndim == 3:
            if tuple(value.shape[1:]) in (fits, fits[::-1]) and a.shape[0] % value.shape[0] == 0:
                found.append((key, f"{module}.{rest[-1]}"))
    if len(found) != 1:
        raise ValueError(f"the expert adapter {wrapper} fits {len(found)} of its module's weights "
                         f"({[k for k, _ in found]}); cannot merge it")
    return found[0]


def _expert_delta(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """peft's ``ParamWrapper.get_delta_weight`` for a 3-D expert weight [E, out, in] (or [E, in, out]): expert e's
    update is B_e A_e, with A [E*r, in] and B [out, E*r] split per expert as peft splits them."""
    experts = weight.shape[0]
    a = a.float().reshape(experts, -1, a.shape[-1])  # [E, r, in]
    b = b.float().reshape(b.shape[0], -1, experts)  # [out, r, E]
    delta = torch.einsum("ore,eri->eoi", b, a) * scaling
    return delta if tuple(weight.shape[1:]) == tuple(delta.shape[1:]) else delta.transpose(1, 2)


def merged_state_dict(state: dict, scaling: float) -> dict:
    """A LoRA model's state dict with each adapter merged into its base weight (W + scaling * B A; per expert for
    the fused expert weights), in the base model's own key names: loadable into the model without peft."""
    wrapped = {w: _wrapped_parameter(state, w) for w in _wrapper_prefixes(state)}
    out = {k: v for k, v in state.items() if ".lora_" not in k and ".base_layer." not in k}
    for prefix in _lora_prefixes(state):
        base = state[f"{prefix}.base_layer.weight"]
        a, b = state[f"{prefix}.lora_A.{ADAPTER}.weight"], state[f"{prefix}.lora_B.{ADAPTER}.weight"]
        out[f"{prefix}.weight"] = (base.float() + scaling * (b.float() @ a.float())).to(base.dtype)
        if f"{prefix}.base_layer.bias" in state:
            out[f"{prefix}.bias"] = state[f"{prefix}.base_layer.bias"]
    for wrapper, (key, merged) in wrapped.items():
        base = state[key]
        delta = _expert_delta(base, state[f"{wrapper}.lora_A.{ADAPTER}.weight"],
                              state[f"{wrapper}.lora_B.{ADAPTER}.weight"], scaling)
        out[merged] = (base.float() + delta).to(base.dtype)
    adapted = {k for k, _ in wrapped.values()}
    for key, value in state.items():  # other parameters of a wrapped module (none in Qwen's experts)
        if ".base_layer." in key and key not in adapted and not key.endswith(
                (".base_layer.weight", ".base_layer.bias")) and ".lora_" not in key:
            out.setdefault(key.replace(".base_layer", ""), value)
    return out


def save_adapter(state: dict, lora_cfg, out_dir: str | Path, base_path: str) -> Path:
    """The adapter alone in peft's format (adapter_config.json + adapter_model.safetensors): loadable with
    ``peft.PeftModel.from_pretrained(base_model, out_dir)``. Adapters on fused expert weights go in as peft writes
    them (``target_parameters`` naming each adapted weight; the nested wrappers' keys as they are)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wrappers = _wrapper_prefixes(state)
    weights = {}
    for prefix in _lora_prefixes(state) + wrappers:
        for kind in ("lora_A", "lora_B"):
            weights[f"base_model.model.{prefix}.{kind}.weight"] = state[f"{prefix}.{kind}.{ADAPTER}.weight"].contiguous()
    save_file(weights, str(out / "adapter_model.safetensors"))
    LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout, bias="none",
               target_modules=_lora_prefixes(state) or None,
               target_parameters=[_wrapped_parameter(state, w)[1] for w in wrappers] or None,
               base_model_name_or_path=str(base_path)).save_pretrained(str(out))
    (out / "README.md").write_text("LoRA adapter written by prefix-grpo; base model: " + json.dumps(str(base_path))
                                   + "\n")
    return out


def scaling(lora_cfg) -> float:
    return lora_cfg.alpha / lora_cfg.rank
