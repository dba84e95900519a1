"""A batch's pixels held once per media item, however many prompts show it.

Questions that share a video (a family) hold the very same pixel tensors on the host (the stream splices their
prompts onto one processor output). ``collate`` keeps one copy of such tensors in the batch: the pixel rows of
each distinct tensor once, and ``ROWS[pixel key]`` ([items, 2]: each occurrence's first and last + 1 pixel row),
beside the grids, which stay one row per occurrence (positions and placeholders read them). A batch without a
repeated tensor has no rows key and is the processor's format exactly.

Readers: ``item_rows`` (where each occurrence's pixels are), ``distinct`` (each distinct item once: what the tower
must encode), and ``expanded`` (the processor's format, a copy per occurrence: for the paths that hand the batch to
the model's own forward, the repeated layout and HF generate among them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

PIXELS = {"pixel_values": "image_grid_thw", "pixel_values_videos": "video_grid_thw"}  # pixel key -> grid key
ROWS = {key: f"{key}_rows" for key in PIXELS}  # the batch key of each pixel key's occurrence rows
PER_OCCURRENCE = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")


def collate(items: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The vision tensors of single-prompt processor outputs, joined: grids (and frame timing) per occurrence,
    pixels once per distinct tensor (the same object in several prompts), with ``ROWS`` when any repeats."""
    batch: dict[str, torch.Tensor] = {}
    for key in PER_OCCURRENCE:
        parts = [item[key] for item in items if item.get(key) is not None]
        if parts:
            batch[key] = torch.cat(parts)
    for key, grid_key in PIXELS.items():
        present = [item for item in items if item.get(key) is not None]
        if not present:
            continue
        seen: dict[int, int] = {}  # id of a pixel tensor -> its first row in the batch
        distinct, rows, start = [], [], 0
        for item in present:
            pixels = item[key]
            if id(pixels) not in seen:
                seen[id(pixels)] = start
                distinct.append(pixels)
                start += pixels.shape[0]
            offset = seen[id(pixels)]
            counts = item[grid_key].prod(-1).tolist()
            for before, count in zip([0, *torch.tensor(counts).cumsum(0).tolist()], counts):
                rows.append((offset + before, offset + before + count))
        batch[key] = distinct[0] if len(distinct) == 1 and len(present) == 1 else torch.cat(distinct)
        if len(distinct) < len(present):
            batch[ROWS[key]] = torch.tensor(rows, dtype=torch.long)
    return batch


def item_rows(prompts: Mapping, key: str) -> list[tuple[int, int]]:
    """(first, last + 1) pixel row of every occurrence of ``key``'s items, in grid order."""
    rows = prompts.get(ROWS[key])
    if rows is not None:
        return [tuple(r) for r in rows.tolist()]
    counts = prompts[PIXELS[key]].prod(-1).tolist()
    starts = [0, *torch.tensor(counts).cumsum(0).tolist()]
    return list(zip(starts[:-1], starts[1:]))


def distinct(prompts: Mapping, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixels, grid) of each distinct item of ``key`` once, in pixel-row order: what the tower must encode."""
    if prompts.get(ROWS[key]) is None:
        return prompts[key], prompts[PIXELS[key]]
    grid, first = prompts[PIXELS[key]], {}
    for i, (start, _) in enumerate(item_rows(prompts, key)):
        first.setdefault(start, i)
    order = [first[s] for s in sorted(first)]
    return prompts[key], grid[order]


def expanded(prompts: Mapping) -> Mapping:
    """The batch in the processor's format (a pixel copy per occurrence), or ``prompts`` itself when it has none to
    make."""
    if not any(prompts.get(rows) is not None for rows in ROWS.values()):
        return prompts
    out = {k: v for k, v in prompts.items() if k not in ROWS.values()}
    for key, rows in ROWS.items():
        if prompts.get(rows) is not None:
            out[key] = torch.cat([prompts[key][a:b] for a, b in item_rows(prompts, key)])
    return out
