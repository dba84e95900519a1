"""The same vision-tower calls on every rank, whatever mix of images, videos and text each rank's batch holds.

A Qwen-VL forward embeds the tokens, then calls the vision tower once for the batch's images and once for its
videos, then runs the decoder. Under ZeRO-3 every module call all-gathers its parameters collectively, so a rank
with an image and a video (two tower calls) and a rank with videos only (one) or text only (none) issue different
collectives and the job dies (gloo: "collective mismatch") or hangs (NCCL).

``aligned_vision_calls(model, prompts, required)`` makes this forward issue exactly the calls in ``required`` (the
most over ranks, agreed by the caller; with a ``VisionCache`` a modality may take several passes, one per item to
encode, or none when all are cached), in the model's own order: a missing image call runs on a minimal dummy
image right after the token embedding, a missing video call on a minimal dummy video just before the decoder. Each
dummy output is multiplied by zero and added to the decoder input, so the backward also runs through the tower on
every rank while every value and gradient stays exactly what it was (x + 0 * finite == x).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

import torch

from app.grouping.modules import unwrap
from app.grouping.vision.cache import cache_of, tower_of
from app.grouping.vision.passes import drop_unused, dummy_vision_input

MODALITIES = ("image", "video")  # the order in which Qwen-VL forwards call the vision tower
_PIXEL_KEYS = {"image": "pixel_values", "video": "pixel_values_videos"}


def present_vision_calls(prompts: Mapping, model=None) -> tuple[str, ...]:
    """The tower calls a forward of these prompts makes, in order; with ``model`` given and a ``VisionCache``
    attached to its tower, what ``VisionCache.calls_needed`` says (each call, and the item passes inside it)."""
    cache = cache_of(model) if model is not None else None
    if cache is not None:
        return cache.calls_needed(tower_of(model), prompts)
    return tuple(m for m in MODALITIES if prompts.get(_PIXEL_KEYS[m]) is not None)


def _parts(model):
    inner = getattr(unwrap(model), "model", None)
    visual = getattr(inner, "visual", None)
    language = getattr(inner, "language_model", None)
    if visual is None or language is None:
        return None
    return inner, visual, language


def _zero_of(output) -> torch.Tensor | None:
    """0 * (sum of every floating tensor in the tower's output that the model reads): exactly zero, connected to
    all of it. The pre-merger hidden states are left out as the model leaves them out: under ZeRO-3 each output
    tensor the backward reaches is one more module event, and the ranks' traces must match."""
    total = None
    stack = [drop_unused(output)]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.is_floating_point():
                term = item.float().sum()
                total = term if total is None else total + term
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "to_tuple"):
            stack.extend(item.to_tuple())
    return None if total is None else total * 0.0


@contextlib.contextmanager
def aligned_vision_calls(model, prompts: Mapping, required: Sequence[str] | None):
    """Within the block, a forward of ``prompts`` makes the tower calls in ``required`` (see module doc). With a
    ``VisionCache`` that encodes item by item, a modality listed n times is the model's call plus n - 1 item passes
    inside it (``VisionCache.calls_needed``); every rank pads to the agreed count."""
    parts = _parts(model)
    if parts is None or required is None:
        yield
        return
    present = present_vision_calls(prompts, model)
    required = tuple(required)
    unknown = [m for m in MODALITIES if present.count(m) > required.count(m)]
    if unknown:
        raise ValueError(f"this batch asks the vision tower for {list(present)}, more than the agreed calls "
                         f"{list(required)}: agree on the most over ranks")
    cache = cache_of(model)
    item_by_item = cache is not None and cache.item_by_item
    missing = [m for m in MODALITIES for _ in range(required.count(m) - present.count(m))]
    if item_by_item:  # one call per modality (real or dummy), its item passes padded inside it
        missing = [m for m in MODALITIES if m in required and m not in present]
    if not missing and not item_by_item:
        yield
        return
    inner, visual, language = parts
    embed = language.get_input_embeddings()
    zeros: list[torch.Tensor] = []
    state = {"embedded": False, "done": False}  # one forward: decode steps after it must not run dummies

    def run_dummies(modalities):
        pixels, grid = dummy_vision_input(visual)
        for modality in modalities:
            if item_by_item:  # the cache's dummy call: the agreed item passes inside one tower call
                with cache.dummy_call():
                    zero = _zero_of(visual(pixels, grid_thw=grid))
            else:  # through the model's own get_*_features, so the output is consumed as a real call's is (under
                # ZeRO-3 what the backward reaches is part of the module trace the ranks must agree on)
                encode = getattr(inner, f"get_{modality}_features", None) or (lambda p, g: visual(p, grid_thw=g))
                zero = _zero_of(encode(pixels, grid))
            if zero is not None:
                zeros.append(zero)

    def after_embedding(module, args, output):
        if state["embedded"] or state["done"]:
            return
        state["embedded"] = True
        # images come first: the missing image calls go before any real call
        run_dummies([m for m in missing if m == "image"])

    def before_decoder(module, args, kwargs):
        if state["done"]:
            return args, kwargs
        state["done"] = True
        run_dummies([m for m in missing if m != "image"])
        if zeros and kwargs.get("inputs_embeds") is not None:
            total = torch.stack(zeros).sum()
            kwargs["inputs_embeds"] = kwargs["inputs_embeds"] + total.to(kwargs["inputs_embeds"].dtype)
        zeros.clear()
        return args, kwargs

    # prepend: the dummy calls run before DeepSpeed's own hook records the decoder, so that every rank's ZeRO-3
    # module trace reads tower..., decoder (its ranks must record identical traces)
    handles = [embed.register_forward_hook(after_embedding),
               language.register_forward_pre_hook(before_decoder, with_kwargs=True, prepend=True)]
    passes = [required.count(m) - 1 for m in MODALITIES if m in required]
    try:
        with cache.aligned(passes) if item_by_item else contextlib.nullcontext():
            yield
    finally:
        for handle in handles:
            handle.remove()
