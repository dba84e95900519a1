"""Low-precision equivalence: judge grouped and repeated against a float32 computation of the same function.

In bfloat16 the grouped and the repeated layouts are two different roundings of one function; neither is the
truth, and their difference (0.02-0.1 in log-prob on tiny models) says nothing by itself. The criterion used by
the self-check and the tests: run the same weights in float32 (``float32_forward``: each layer-sized piece of the model is upcast for the
duration of its own forward, so the transient extra memory is one such piece's float32 weights), and
require the grouped layout's error against that reference to be no worse than the repeated layout's error:

    mean |grouped - f32|  <=  MEAN_RATIO * mean |repeated - f32|      (over completion tokens)
    max  |grouped - f32|  <=  MAX_RATIO  * max  |repeated - f32|

Upcasting bf16 weights to float32 is exact, so the reference is the very function both layouts approximate.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from app.grouping.modules import unwrap

# Measured on the five tiny families x every CPU backend (README, "The equivalence guarantee"): correct code gives
# mean ratios 0.96-1.09 and max ratios 0.87-1.27; a +1 position shift or responses that see each other give mean
# ratios above 10. The bounds sit between the two, nearer the correct side.
MEAN_RATIO = 1.5
MAX_RATIO = 2.0


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def upcast_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Disjoint subtrees upcast as one piece: the largest whose parameter count is at most the largest leaf's.

    A module may read a child's weight dtype before calling it (Qwen-VL's patch embedding does), so units are whole
    subtrees (a decoder layer, a vision block, the patch embedding, the LM head) rather than single leaves.
    """
    leaves = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    limit = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in leaves), default=0)
    units = []

    def descend(module):
        size = _numel(module)
        if size == 0:
            return
        container = isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict))  # never called itself
        if not container and (size <= limit or any(True for _ in module.parameters(recurse=False))):
            units.append(module)
            return
        for child in module.children():
            descend(child)

    descend(model)
    return units


def _upcast_hooks(unit: torch.nn.Module):
    swapped: list[tuple[torch.nn.Module, str, torch.Tensor]] = []

    def pre(mod, args):
        for module in unit.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and param.is_floating_point() and param.dtype != torch.float32:
                    swapped.append((module, name, param))
                    module._parameters[name] = param.detach().float()
            if getattr(module, "rows_dtype", torch.float32) != torch.float32:  # a host table's rows (no parameter)
                swapped.append((module, "rows_dtype", module.rows_dtype))
                module.rows_dtype = torch.float32

    def post(mod, args, output):
        for module, name, param in swapped:
            if name == "rows_dtype":
                module.rows_dtype = param
            else:
                module._parameters[name] = param
        swapped.clear()

    return unit.register_forward_pre_hook(pre), unit.register_forward_hook(post, prepend=True)


@contextlib.contextmanager
def float32_forward(model: torch.nn.Module):
    """Within the block, forwards of ``model`` compute in float32 with its (low-precision) weights upcast.

    For reference computations under ``torch.no_grad()``; the model's own parameters are never modified, and the
    extra memory is one unit's float32 copy at a time. The parameters must be materialised (under ZeRO-3, inside
    ``app.runtime.zero.gathered_for_inference``).
    """
    model = unwrap(model)
    handles = []
    try:
        for unit in upcast_units(model):
            handles.extend(_upcast_hooks(unit))
        yield model
    finally:
        for handle in handles:
            handle.remove()


def parameter_dtype(model: torch.nn.Module) -> torch.dtype:
    model = unwrap(model)
    for param in model.parameters():
        # ZeRO-3 partitioned parameters keep their dtype on the (empty) placeholder too.
        return param.dtype
    return torch.float32


@dataclass
class PrecisionComparison:
    """How far each layout is from the float32 reference, over the real completion tokens."""

    grouped_mean: float
    repeated_mean: float
    grouped_max: float
    repeated_max: float
    tokens: int

    @property
    def mean_ratio(self) -> float:
        return self.grouped_mean / max(self.repeated_mean, 1e-12)

    @property
    def max_ratio(self) -> float:
        return self.grouped_max / max(self.repeated_max, 1e-12)

    def passes(self, mean_ratio: float = MEAN_RATIO, max_ratio: float = MAX_RATIO) -> bool:
        return self.mean_ratio <= mean_ratio and self.max_ratio <= max_ratio

    def describe(self) -> str:
        return (f"|grouped - float32| mean {self.grouped_mean:.3g} max {self.grouped_max:.3g}; "
                f"|repeated - float32| mean {self.repeated_mean:.3g} max {self.repeated_max:.3g}; "
                f"ratios mean {self.mean_ratio:.2f} (bound {MEAN_RATIO}), max {self.max_ratio:.2f} "
                f"(bound {MAX_RATIO}) over {self.tokens} tokens")


def compare_to_reference(grouped: torch.Tensor, repeated: torch.Tensor, reference: torch.Tensor,
                         mask: torch.Tensor) -> PrecisionComparison:
    mask = mask.bool()
    grouped_err = (grouped.float() - reference.float()).abs()[mask]
    repeated_err = (repeated.float() - reference.float()).abs()[mask]
    return PrecisionComparison(float(grouped_err.mean()), float(repeated_err.mean()), float(grouped_err.max()),
                               float(repeated_err.max()), int(mask.sum()))


# ---- which layer kind differs (the self-check's diagnosis) ----------------------------------------------------------
LAYER_KINDS = {"full_attention": "attention", "linear_attention": "Gated DeltaNet linear attention",
               "router": "mixture-of-experts router", "experts": "routed experts"}


def decoder_layers(model) -> list[tuple[int, str, torch.nn.Module]]:
    """(index, kind, module) of each decoder layer's parts in the order they run: its token mixer,
    ``full_attention`` (``self_attn``) or, in a hybrid model, ``linear_attention`` (``linear_attn``), as the text
    config's ``layer_types`` says; then in a sparse layer its ``router`` (logits) and its routed ``experts``."""
    from app.grouping.experts.blocks import experts_output_module, router_logits_module, sparse_layers

    inner = unwrap(model)
    body = getattr(inner, "model", inner)
    body = getattr(body, "language_model", body)
    config = getattr(inner.config, "text_config", None) or inner.config
    kinds = getattr(config, "layer_types", None)
    sparse = {layer.index: layer.block for layer in sparse_layers(inner)}
    out = []
    for i, layer in enumerate(body.layers):
        kind = kinds[i] if kinds else "full_attention"
        out.append((i, kind, layer.linear_attn if kind == "linear_attention" else layer.self_attn))
        if i in sparse:
            out += [(i, "router", router_logits_module(sparse[i])), (i, "experts", experts_output_module(sparse[i]))]
    return out


def differing_layers(model, run_grouped, run_repeated, layout, prompt_width: int) -> list[tuple[int, str, float]]:
    """Run both layouts once more with each decoder layer's parts recorded (``decoder_layers``); per part (index,
    kind, largest |grouped - repeated| over the completion tokens relative to the largest |repeated|). ``layout``:
    the grouped row's ``GroupLayout``; the repeated rows hold completion n's token j at ``prompt_width + j``. A
    router's or experts' output comes flattened over the batch ([tokens, ...]) and is read as the rows it was."""
    outputs: dict[str, list] = {"grouped": [], "repeated": []}
    layers = decoder_layers(model)
    current: list = []

    def record(module, args, output):
        current.append((output[0] if isinstance(output, tuple) else output).detach().float())

    handles = [mixer.register_forward_hook(record) for _, _, mixer in layers]
    try:
        for name, run in (("grouped", run_grouped), ("repeated", run_repeated)):
            current.clear()
            run()
            outputs[name] = list(current)
    finally:
        for handle in handles:
            handle.remove()
    if len(outputs["grouped"]) != len(layers) or len(outputs["repeated"]) != len(layers):
        return []
    rows, cols = [], []
    for n, length in enumerate(layout.completion_lens):
        rows += [n] * length
        cols += list(range(length))
    grouped_at = torch.cat([torch.arange(s, s + n) for s, n in zip(layout.response_starts, layout.completion_lens)])
    out = []
    for (i, kind, _), g, r in zip(layers, outputs["grouped"], outputs["repeated"]):
        g = g[None] if g.ndim == 2 else g
        r = r.view(len(layout.completion_lens), -1, r.shape[-1]) if r.ndim == 2 else r
        mine = g[0].index_select(0, grouped_at.to(g.device))
        theirs = r[torch.tensor(rows, device=r.device), prompt_width + torch.tensor(cols, device=r.device)]
        out.append((i, kind, float((mine - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30))))
    return out


def describe_layers(differences: list[tuple[int, str, float]], dtype: torch.dtype) -> tuple[str, str | None]:
    """A sentence naming the first layer whose output differs (relative 1e-4 in float32, 5e-2 below), with the
    largest difference per layer kind; and that layer's kind (None when none stands out)."""
    if not differences:
        return "", None
    bound = 1e-4 if dtype == torch.float32 else 5e-2
    first = next(((i, kind, d) for i, kind, d in differences if d > bound), None)
    worst = {}
    for i, kind, d in differences:
        if kind not in worst or d > worst[kind][1]:
            worst[kind] = (i, d)
    per_kind = "; ".join(f"{LAYER_KINDS.get(k, k)} layers at most {d:.3g} (layer {i})" for k, (i, d) in worst.items())
    if first is None:
        return f" Layer by layer (token-mixer outputs at the completion tokens): {per_kind}.", None
    i, kind, d = first
    name = LAYER_KINDS.get(kind, kind)
    return (f" The first layer whose output differs is layer {i}, {'an' if name[0] in 'aeiou' else 'a'} {name} layer "
            f"({kind}): relative difference {d:.3g} at the completion tokens; {per_kind}.", kind)
