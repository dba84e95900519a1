"""The vision tower run item by item: one media item per pass, or one pass per ``chunk_frames`` temporal patches of
it (a long video's activations are then one chunk's), the outputs (or the outputs of the blocks the projector reads)
concatenated in order. Exact: Qwen's vision attention and its 2-D positions never cross a temporal patch
(``app.grouping.sequence_parallel`` names the blocks; tested there and in tests/test_vision_cache.py). Also the
blocks' recording and serving (a frozen tower whose projector trains) and the smallest input a tower accepts (the
dummy passes ZeRO-3 ranks make to keep in step). What is kept and for how long is ``app.grouping.vision.cache``.
"""

from __future__ import annotations

import contextlib

import torch

from app.grouping.modules import patched


def item_passes(frames: int, chunk_frames: int) -> int:
    """Tower passes one item of ``frames`` temporal patches takes (``chunk_frames`` at a time; 0: one pass)."""
    return -(-frames // chunk_frames) if chunk_frames else 1


def cached_blocks(visual) -> list[int]:
    """The blocks whose outputs the projector reads: the last one and any deepstack layer (Qwen3-VL)."""
    return sorted({len(visual.blocks) - 1, *getattr(visual, "deepstack_visual_indexes", ())})


def encode_item(visual, rows: torch.Tensor, grid: torch.Tensor, kwargs: dict, *, plan: str, chunk_frames: int):
    """One item through the tower (a module call of its own per ``chunk_frames`` temporal patches), without
    gradient (nothing before what is kept trains): its output (``plan`` ``outputs``), or the outputs of the blocks
    the projector reads (``blocks``), the chunks' concatenated in order."""
    t, h, w = grid[0].tolist()
    step = chunk_frames or t
    parts = []
    with torch.no_grad():
        for start in range(0, t, step):
            frames = min(step, t - start)
            piece = rows[start * h * w : (start + frames) * h * w]
            piece_grid = grid.new_tensor([[frames, h, w]])
            if plan == "outputs":
                parts.append(drop_unused(visual(piece, grid_thw=piece_grid, **kwargs)))
                continue
            with blocks_recording(visual) as recorded:
                visual(piece, grid_thw=piece_grid, **kwargs)
            parts.append(dict(recorded))
    if plan == "outputs":
        return concat(parts)
    return {b: torch.cat([part[b] for part in parts]) if len(parts) > 1 else parts[0][b] for b in parts[0]}


def dummy_vision_input(visual) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest input the tower accepts: one frame of spatial_merge_size x spatial_merge_size patches."""
    config = visual.config
    channels = getattr(config, "in_channels", None) or getattr(config, "in_chans", 3)
    merge = getattr(config, "spatial_merge_size", 2)
    width = channels * getattr(config, "temporal_patch_size", 2) * config.patch_size ** 2
    device = next(visual.parameters()).device
    return (torch.zeros(merge * merge, width, device=device),
            torch.tensor([[1, merge, merge]], device=device))


# ---- outputs, item by item ---------------------------------------------------------------------------------------
def drop_unused(output):
    """The pre-merger hidden states are not what the language model reads; keeping them would double the memory."""
    if hasattr(output, "pooler_output") and getattr(output, "last_hidden_state", None) is not None:
        output["last_hidden_state"] = None  # item and attribute (setting the attribute to None keeps the item)
    return output


def concat(items: list):
    first = items[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(items) if len(items) > 1 else first
    if first is None:
        return None
    if isinstance(first, (list, tuple)) and not hasattr(first, "keys"):
        return type(first)(concat([item[j] for item in items]) for j in range(len(first)))
    return type(first)(**{k: concat([item[k] for item in items]) for k in first.keys()})


# ---- blocks: record their outputs, or hand them back -------------------------------------------------------------
@contextlib.contextmanager
def blocks_recording(visual):
    recorded: dict[int, torch.Tensor] = {}
    hooks = []
    for b in cached_blocks(visual):
        def hook(module, args, output, b=b):
            recorded[b] = (output[0] if isinstance(output, tuple) else output).detach()
        hooks.append(visual.blocks[b].register_forward_hook(hook))
    try:
        yield recorded
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def blocks_serving(visual, served: dict[int, torch.Tensor]):
    """Within the block, block b returns ``served[b]`` and every other block returns its input unchanged: the
    values that the projector reads are those the blocks would compute, without computing them."""
    with contextlib.ExitStack() as stack:
        for b, block in enumerate(visual.blocks):
            value = served.get(b)
            stack.enter_context(patched(block, "forward", (lambda hidden_states, *a, _v=value, **k: _v)
                                        if value is not None else (lambda hidden_states, *a, **k: hidden_states)))
        yield
