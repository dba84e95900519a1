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
from app.grouping.vision_cache import cache_of, tower_of, uncached

MODALITIES = ("image", "video")  # the order in which Qwen-VL forwards call the vision tower
_PIXEL_KEYS = {"image": "pixel_values", "video": "pixel_values_videos"}


def present_vision_calls(prompts: Mapping, model=None) -> tuple[str, ...]:
    """The tower calls a forward of these prompts makes, in order; with ``model`` given and a ``VisionCache``
    attached to its tower, only those with an item not cached yet (a fully cached call skips the tower)."""
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
    return visual, language, language.get_input_embeddings()


def dummy_vision_input(visual) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest input the tower accepts: one frame of spatial_merge_size x spatial_merge_size patches."""
    config = visual.config
    channels = getattr(config, "in_channels", None) or getattr(config, "in_chans", 3)
    merge = getattr(config, "spatial_merge_size", 2)
    width = channels * getattr(config, "temporal_patch_size", 2) * config.patch_size ** 2
    device = next(visual.parameters()).device
    return (torch.zeros(merge * merge, width, device=device),
            torch.tensor([[1, merge, merge]], device=device))


def _zero_of(output) -> torch.Tensor | None:
    """0 * (sum of every floating tensor in the tower's output): exactly zero, connected to all of it."""
    total = None
    stack = [output]
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
    """Within the block, a forward of ``prompts`` makes the tower calls in ``required`` (see module doc; a
    modality listed k times is k tower passes, as a ``VisionCache`` that encodes item by item makes them)."""
    parts = _parts(model)
    present = present_vision_calls(prompts, model)
    required = tuple(required or ())
    missing = [m for m in MODALITIES for _ in range(required.count(m) - present.count(m))]
    if parts is None or not missing:
        yield
        return
    unknown = [m for m in MODALITIES if present.count(m) > required.count(m)]
    if unknown:
        raise ValueError(f"this batch calls the vision tower for {list(present)}, more than the agreed calls "
                         f"{list(required)}: agree on the most over ranks")
    visual, language, embed = parts
    zeros: list[torch.Tensor] = []
    state = {"embedded": False, "done": False}  # one forward: decode steps after it must not run dummies

    def run_dummies(modalities):
        pixels, grid = dummy_vision_input(visual)
        for _ in modalities:
            with uncached(model):  # a real tower call, whatever is cached: it is there for its collectives
                zero = _zero_of(visual(pixels, grid_thw=grid))
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

    handles = [embed.register_forward_hook(after_embedding),
               language.register_forward_pre_hook(before_decoder, with_kwargs=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
