"""The policy's weights as vLLM's in-place reload takes them (``VLLMEngine.sync_weights``): every tensor under its
checkpoint name, one module at a time (under ZeRO-3 each gathered alone), LoRA merged, and after the first push only
the tensors that can have changed (a vLLM layer loads its fused tensors together: ``layer_key``)."""

from __future__ import annotations

# vLLM layers that load several checkpoint tensors at once: a layer must get all of them or none (a partial reload
# leaves the rest uninitialized), so frozen tensors are skipped only when their whole layer is frozen
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def layer_key(name: str) -> str:
    """The vLLM layer a checkpoint tensor loads into: its module, with q/k/v and gate/up fused."""
    module = name.rsplit(".", 1)[0]
    parent, _, last = module.rpartition(".")
    return f"{parent}.{FUSED[last]}" if last in FUSED else module


def _gathered(params: list):
    """Under ZeRO-3, these parameters whole for the block (every rank must enter it, in the same order)."""
    import contextlib

    if any(getattr(p, "ds_id", None) is not None for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def policy_weights(model, frozen: bool = True):
    """(name, tensor) for every weight of the policy as its checkpoint names it, one module at a time, each a copy
    handed on before the next is made: under ZeRO-3 each is gathered alone (every rank in the same order, never the
    whole model). With LoRA each adapted linear goes as its merged weight W + B A * scaling (PEFT's
    ``get_delta_weight``, computed from the gathered tensors; the model itself is not touched) and the adapter
    tensors are not sent. ``frozen=False`` leaves out the tensors that cannot have changed: frozen ones whose whole
    vLLM layer (``layer_key``) is frozen too (a frozen tower, LoRA's unadapted base weights)."""
    from app.grouping.modules import unwrap

    module = unwrap(model)
    base = module.get_base_model() if hasattr(module, "get_base_model") else module  # a PeftModel, else as is
    adapted = {name for name, layer in base.named_modules()
               if hasattr(layer, "base_layer") and hasattr(layer, "lora_A") and hasattr(layer, "get_delta_weight")}
    changing = {layer_key(f"{name}.weight") for name in adapted}
    changing |= {layer_key(name) for name, param in base.named_parameters()
                 if param.requires_grad and "lora_" not in name}
    sent: set[int] = set()
    for name, layer in base.named_modules():
        if name not in adapted:
            continue
        params = list(layer.parameters())
        with _gathered(params):
            weight = layer.base_layer.weight.data.detach().clone()
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    weight += layer.get_delta_weight(adapter).to(weight.dtype)
            yield f"{name}.weight", weight
            if getattr(layer.base_layer, "bias", None) is not None:
                yield f"{name}.bias", layer.base_layer.bias.data.detach().clone()
        sent.update(id(p) for p in params)
    for name, param in base.named_parameters():
        if id(param) in sent or (not frozen and layer_key(name) not in changing):
            continue
        with _gathered([param]):
            yield name, param.data.detach().clone()
