"""The vision tower split by frames across the ranks of a sequence-parallel group (``sequence_parallel``): each
video's temporal patches in contiguous ranges (whole images round-robin), each rank running the tower on its share,
the embeddings summed into the full table on every rank (the pieces are disjoint). Exact because Qwen's vision
attention never crosses a temporal patch (Qwen2-VL and Qwen3-VL blocks attend within one temporal patch, Qwen2.5-VL's
windowed and full-attention blocks too) and their position embeddings repeat per temporal patch. A frozen tower runs
under ``no_grad``; a rank without a share makes a dummy call that adds exactly 0 (ZeRO-3 gathers per module call).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from app.grouping.layout import LayoutError
from app.grouping.media import local_share
from app.grouping.modules import text_config, unwrap


def shard_bounds(total: int, size: int) -> list[tuple[int, int]]:
    """Contiguous near-equal shards of ``total`` tokens over ``size`` ranks (the first ones one longer)."""
    if total < size:
        raise LayoutError(f"a packed row of {total} tokens cannot be split over {size} sequence-parallel ranks "
                          f"(train.sequence_parallel_size={size}: fewer ranks, or longer rows)")
    base, extra = divmod(total, size)
    bounds, start = [], 0
    for r in range(size):
        end = start + base + (r < extra)
        bounds.append((start, end))
        start = end
    return bounds


class _SumPieces(torch.autograd.Function):
    """Forward: the SP group's sum of disjoint pieces (each rank's tower output placed in the full table).
    Backward: the SUM of every rank's gradient of the table, since each rank used a different part of it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _tower_output(result):
    """(merged embeddings, deepstack list or None) from a vision tower's output (transformers 5.x or a tuple)."""
    if hasattr(result, "pooler_output"):
        return result.pooler_output, getattr(result, "deepstack_features", None)
    if isinstance(result, tuple):
        return result[0], (list(result[1]) if len(result) > 1 else None)
    return result, None


def _modality_embeddings(model, pixels, grid, sp, split_time: bool, held: bool = False):
    """The tower's embeddings of every item of one modality (and Qwen3-VL's deepstack features), computed with
    each rank running its share: temporal patches split across ranks for videos, whole items for images.
    ``held``: ``pixels`` holds only this rank's share already (``media.keep_share``)."""
    visual = unwrap(model).model.visual
    merge = visual.spatial_merge_size
    total_tokens = int((grid.prod(-1) // (merge * merge)).sum())
    share = local_share(pixels, grid, sp.rank, sp.size, split_time=split_time, merge=merge, held=held)
    trains = any(p.requires_grad for p in visual.parameters())
    hidden = text_config(model).hidden_size
    dtype = next(visual.parameters()).dtype
    table = pixels.new_zeros(total_tokens, hidden, dtype=dtype)
    deep_tables = None
    with torch.set_grad_enabled(trains and torch.is_grad_enabled()):
        if share is not None:
            local_pixels, local_grid, token_rows = share
            embeds, deep = _tower_output(visual(local_pixels.to(dtype), grid_thw=local_grid))
        else:  # no share here (fewer temporal patches or images than ranks): the tower still runs once, on a
            # minimal dummy input whose output enters as exactly 0, so every rank makes the same module calls
            # (ZeRO-3 gathers parameters per call) and the backward reaches the tower on every rank
            from app.grouping.vision.calls import _zero_of
            from app.grouping.vision.passes import dummy_vision_input

            dummy_pixels, dummy_grid = dummy_vision_input(visual)
            zero = _zero_of(visual(dummy_pixels.to(pixels.device, dtype), grid_thw=dummy_grid.to(grid.device)))
            if zero is not None:
                table = table + zero.to(table.dtype)
    if share is not None:
        table = table.to(embeds.dtype)
        index = torch.cat([torch.arange(t.start, t.stop, device=embeds.device) for t in token_rows])
        table = table.index_copy(0, index, embeds)
        if deep is not None:
            deep_tables = [table.new_zeros(total_tokens, d.shape[-1]).index_copy(0, index, d) for d in deep]
    deep_count = _deepstack_count(visual)
    if deep_tables is None and deep_count:
        deep_tables = [table.new_zeros(total_tokens, hidden) for _ in range(deep_count)]
    if trains and torch.is_grad_enabled():  # a rank without frames still joins the backward's all-reduce
        table = table if table.requires_grad else table.requires_grad_()
        deep_tables = deep_tables and [d if d.requires_grad else d.requires_grad_() for d in deep_tables]
    table = _SumPieces.apply(table, sp.group)
    if deep_tables is not None:
        deep_tables = [_SumPieces.apply(d, sp.group) for d in deep_tables]
    return table, deep_tables


def _deepstack_count(visual) -> int:
    return len(getattr(visual, "deepstack_visual_indexes", None) or getattr(visual.config, "deepstack_visual_indexes", None) or [])


def insert_vision(model, prompts, input_ids, shard: tuple[int, int], embeds, sp):
    """The shard's placeholder tokens (positions ``shard`` = (start, end) of the row) replaced by their tower
    embeddings (computed frame-sharded); for Qwen3-VL also the shard's deepstack inputs."""
    from app.grouping.media import per_occurrence, share_of

    start, end = shard
    inner = unwrap(model)
    config = inner.config
    local = input_ids[start:end]
    masks, deep_parts = {}, {}
    embeds = embeds[0]
    for kind, token_key, pixel_key, grid_key in (("image", "image_token_id", "pixel_values", "image_grid_thw"),
                                                 ("video", "video_token_id", "pixel_values_videos", "video_grid_thw")):
        if prompts.get(grid_key) is None:
            continue
        table, deep = _modality_embeddings(model, per_occurrence(prompts, pixel_key), prompts[grid_key], sp,
                                           split_time=kind == "video", held=share_of(prompts, pixel_key) is not None)
        token = getattr(config, token_key)
        before = int((input_ids[:start] == token).sum())
        mask = local == token
        count = int(mask.sum())
        if int((input_ids == token).sum()) != table.shape[0]:
            raise LayoutError(f"the packed row has {int((input_ids == token).sum())} {kind} tokens but the tower "
                              f"gave {table.shape[0]} embeddings")
        rows = table[before : before + count].to(embeds.dtype)
        embeds = embeds.masked_scatter(mask[:, None], rows)
        masks[kind] = mask
        if deep is not None:
            deep_parts[kind] = [d[before : before + count] for d in deep]
    extra = {}
    if deep_parts:
        visual = torch.zeros_like(local, dtype=torch.bool)
        for mask in masks.values():
            visual = visual | mask
        layers = len(next(iter(deep_parts.values())))
        joint = []
        for layer in range(layers):
            rows = embeds.new_zeros(int(visual.sum()), embeds.shape[-1])
            for kind, parts in deep_parts.items():
                rows[masks[kind][visual]] = parts[layer].to(rows.dtype)
            joint.append(rows)
        extra = {"visual_pos_masks": visual[None], "deepstack_visual_embeds": joint}
    return embeds[None], extra
