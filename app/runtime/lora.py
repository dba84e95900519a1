"""LoRA adapters (peft) and frozen towers on the policy; the reference as "adapters off"; merged and adapter export.

Adapters are injected in place (``peft.inject_adapter_in_model``): the model keeps its own class and module tree, so
the grouped forward, the rollouts and DeepSpeed see the same model with a few more (trainable) Linear layers, and
every base weight frozen. Which Linear layers get adapters is decided from the module names:
- language model: the projections named in ``lora.target_modules`` (Qwen: q/k/v/o and gate/up/down);
- vision tower (``lora.vision_tower``): every Linear under ``visual`` outside the merger;
- projector (``lora.projector``): the merger(s) that map vision features into the language model.
The output head and the embeddings never get adapters.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

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


def peft_config(model, lora_cfg):
    from peft import LoraConfig

    return LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout, bias="none",
                      target_modules=target_names(model, lora_cfg))


def prepare(model, lora_cfg, model_cfg):
    """The policy as configured: towers frozen (``model.freeze_*``), LoRA adapters injected (``lora.rank`` > 0)."""
    freeze(model, model_cfg.freeze_vision_tower, model_cfg.freeze_projector)
    if lora_cfg.rank:
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


def merged_state_dict(state: dict, scaling: float) -> dict:
    """A LoRA model's state dict with each adapter merged into its base weight (W + scaling * B A), in the base
    model's own key names: loadable into the model without peft."""
    out = {k: v for k, v in state.items() if ".lora_" not in k and ".base_layer." not in k}
    for prefix in _lora_prefixes(state):
        base = state[f"{prefix}.base_layer.weight"]
        a, b = state[f"{prefix}.lora_A.{ADAPTER}.weight"], state[f"{prefix}.lora_B.{ADAPTER}.weight"]
        out[f"{prefix}.weight"] = (base.float() + scaling * (b.float() @ a.float())).to(base.dtype)
        if f"{prefix}.base_layer.bias" in state:
            out[f"{prefix}.bias"] = state[f"{prefix}.base_layer.bias"]
    return out


def save_adapter(state: dict, lora_cfg, out_dir: str | Path, base_path: str) -> Path:
    """The adapter alone in peft's format (adapter_config.json + adapter_model.safetensors): loadable with
    ``peft.PeftModel.from_pretrained(base_model, out_dir)``."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {}
    for prefix in _lora_prefixes(state):
        for kind in ("lora_A", "lora_B"):
            weights[f"base_model.model.{prefix}.{kind}.weight"] = state[f"{prefix}.{kind}.{ADAPTER}.weight"].contiguous()
    save_file(weights, str(out / "adapter_model.safetensors"))
    LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout, bias="none",
               target_modules=_lora_prefixes(state), base_model_name_or_path=str(base_path)).save_pretrained(str(out))
    (out / "README.md").write_text("LoRA adapter written by prefix-grpo; base model: " + json.dumps(str(base_path))
                                   + "\n")
    return out


def scaling(lora_cfg) -> float:
    return lora_cfg.alpha / lora_cfg.rank
