"""A batch's pixels held once per media item, however many prompts show it.

Questions that share a video (a family) hold the very same pixel tensors on the host (the stream splices their
prompts onto one processor output). ``collate`` keeps one copy of such tensors in the batch: the pixel rows of
each distinct tensor once, and ``ROWS[pixel key]`` ([items, 2]: each occurrence's first and last + 1 pixel row),
beside the grids, which stay one row per occurrence (positions and placeholders read them). A batch without a
repeated tensor has no rows key and is the processor's format exactly.

Readers: ``item_rows`` (where each occurrence's pixels are), ``distinct`` (each distinct item once: what the tower
must encode), and ``expanded`` (the processor's format, a copy per occurrence: for the paths that hand the batch to
the model's own forward, the repeated layout and HF generate among them).

Under sequence parallelism a rank's tower reads only its share of each item (``local_share``: a
video's temporal patches in a contiguous range, whole images round-robin): ``keep_share`` cuts the batch to those
rows (``SHARE[pixel key]`` = [rank, S] says so). Its occurrences' rows then point into the share, its grids stay
whole (positions and placeholders read them), and what encodes it (``vision.frames``) takes the rows as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

PIXELS = {"pixel_values": "image_grid_thw", "pixel_values_videos": "video_grid_thw"}  # pixel key -> grid key
ROWS = {key: f"{key}_rows" for key in PIXELS}  # the batch key of each pixel key's occurrence rows
SHARE = {key: f"{key}_share" for key in PIXELS}  # [rank, S]: the batch holds only that rank's share of the pixels
PER_OCCURRENCE = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")


def collate(items: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The vision tensors of single-prompt processor outputs, joined: grids (and frame timing) per occurrence,
    pixels once per distinct tensor (the same object in several prompts), with ``ROWS`` when any repeats. Items
    that hold only one rank's share of their videos' pixels (``SHARE``: the data path decoded that share alone)
    give a batch holding that share (``keep_share``'s layout); an item beside them that holds whole videos is cut
    to the same share first."""
    batch: dict[str, torch.Tensor] = {}
    for key in PER_OCCURRENCE:
        parts = [item[key] for item in items if item.get(key) is not None]
        if parts:
            batch[key] = torch.cat(parts)
    for key, grid_key in PIXELS.items():
        present = [item for item in items if item.get(key) is not None]
        if not present:
            continue
        held = {share_of(item, key) for item in present} - {None}
        if len(held) > 1:
            raise ValueError(f"prompts holding different ranks' shares of their pixels in one batch: {sorted(held)}")
        share = held.pop() if held else None
        if share is not None:
            present = [item if share_of(item, key) else keep_share(dict(item), *share) for item in present]
        seen: dict[int, int] = {}  # id of a pixel tensor -> its first row in the batch
        distinct, rows, start = [], [], 0
        for item in present:
            pixels = item[key]
            if id(pixels) not in seen:
                seen[id(pixels)] = start
                distinct.append(pixels)
                start += pixels.shape[0]
            offset = seen[id(pixels)]
            counts = held_counts(item[grid_key], *share) if share else item[grid_key].prod(-1).tolist()
            for before, count in zip([0, *torch.tensor(counts).cumsum(0).tolist()], counts):
                rows.append((offset + before, offset + before + count))
        batch[key] = distinct[0] if len(distinct) == 1 and len(present) == 1 else torch.cat(distinct)
        if len(distinct) < len(present) or share is not None:
            batch[ROWS[key]] = torch.tensor(rows, dtype=torch.long).reshape(-1, 2)
        if share is not None:
            batch[SHARE[key]] = torch.tensor(list(share))
    return batch


def held_counts(grid: torch.Tensor, rank: int, size: int) -> list[int]:
    """The pixel rows rank ``rank`` of ``size`` holds of each video of ``grid`` (``keep_share``'s rule: its
    contiguous temporal patches of a video of at least ``size`` of them, the whole of a shorter one)."""
    counts = []
    for t, h, w in grid.tolist():
        if t >= size:
            base, extra = divmod(t, size)
            t = base + (rank < extra)
        counts.append(t * h * w)
    return counts


def whole_from_shares(shares: Sequence[torch.Tensor], grid: torch.Tensor) -> torch.Tensor:
    """One prompt's video pixels whole again from every rank's share of them (rank order; each ``keep_share``'s
    layout of the videos of ``grid``): a split video's shares one after another in time, a short one as rank 0
    holds it (every rank holds it whole)."""
    size = len(shares)
    cursors, out = [0] * size, []
    for one in grid.tolist():
        item = torch.tensor([one])
        for rank in range(size) if one[0] >= size else [0]:
            count = held_counts(item, rank, size)[0]
            out.append(shares[rank][cursors[rank] : cursors[rank] + count])
        for rank in range(size):
            cursors[rank] += held_counts(item, rank, size)[0]
    return torch.cat(out)


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


def share_of(prompts: Mapping, key: str) -> tuple[int, int] | None:
    """(rank, S) when the batch holds only that rank's share of ``key``'s pixels, else None."""
    held = prompts.get(SHARE[key])
    return None if held is None else (int(held[0]), int(held[1]))


def keep_share(batch: dict, rank: int, size: int) -> dict:
    """``batch`` with only this rank's share of its videos' pixels: each video of at least S temporal patches keeps
    the rows ``local_share`` gives this rank, other items stay whole (they go to one rank each, by
    their place in whichever call encodes them); each occurrence's rows point into what is kept, ``SHARE`` says
    whose share it is. S = 1, or a batch without videos: the batch as it is."""
    key = "pixel_values_videos"
    if size <= 1 or batch.get(key) is None:
        return batch
    if share_of(batch, key) is not None:  # already held (the data path decoded this rank's share alone)
        if share_of(batch, key) != (rank, size):
            raise ValueError(f"this batch holds rank/size {share_of(batch, key)}'s share of its pixels, not "
                             f"{(rank, size)}'s")
        return batch
    out = dict(batch)
    pixels, grid = distinct(batch, key)
    starts = sorted({start for start, _ in item_rows(batch, key)})
    kept, moved, cursor = [], {}, 0
    for start, item in zip(starts, grid.tolist()):
        one = local_share(pixels[start:], torch.tensor([item]), rank, size, split_time=True, merge=1) \
            if item[0] >= size else None
        rows = one[0] if one is not None else (pixels[start : start + item[0] * item[1] * item[2]]
                                               if item[0] < size else pixels[:0])
        moved[start] = (cursor, cursor + rows.shape[0])
        kept.append(rows)
        cursor += rows.shape[0]
    out[key] = torch.cat(kept)
    out[ROWS[key]] = torch.tensor([moved[a] for a, _ in item_rows(batch, key)], dtype=torch.long).reshape(-1, 2)
    out[SHARE[key]] = torch.tensor([rank, size])
    return out


def per_occurrence(prompts: Mapping, key: str) -> torch.Tensor:
    """``key``'s pixel rows of every occurrence in grid order (the tensor itself when nothing repeats; of a batch
    that holds a rank's share, that share's rows)."""
    if prompts.get(ROWS[key]) is None:
        return prompts[key]
    return torch.cat([prompts[key][a:b] for a, b in item_rows(prompts, key)])


def expanded(prompts: Mapping) -> Mapping:
    """The batch in the processor's format (a pixel copy per occurrence), or ``prompts`` itself when it has none to
    make. A batch holding only a rank's share of the pixels cannot be: that is said by name."""
    if any(prompts.get(held) is not None for held in SHARE.values()):
        raise ValueError("this batch holds only one sequence-parallel rank's share of its pixels (media.keep_share); "
                         "only the frame-split tower reads it")
    if not any(prompts.get(rows) is not None for rows in ROWS.values()):
        return prompts
    out = {k: v for k, v in prompts.items() if k not in ROWS.values()}
    for key, rows in ROWS.items():
        if prompts.get(rows) is not None:
            out[key] = per_occurrence(prompts, key)
    return out


def local_share(pixels: torch.Tensor, grid: torch.Tensor, rank: int, size: int, *, split_time: bool, merge: int,
                held: bool = False):
    """This rank's share of a tower call's items over ``size`` ranks (``vision.frames``): each video's temporal
    patches in contiguous ranges (the first ranks one more) when it has at least ``size`` of them, other items
    whole, round-robin. Returns (its pixel rows: a view when it is one piece, its grid rows, the token rows of the
    whole call's table they fill) or None when it has no share. ``held``: ``pixels`` already holds only this rank's
    rows of the split videos (``media.keep_share``), other items whole. One rule for the frame-split tower, the
    batch cut to a rank's share and what the vision cache counts and keeps."""
    pieces, patch, token = [], 0, 0
    for i, (t, h, w) in enumerate(grid.tolist()):
        split = split_time and t >= size
        if split:
            base, extra = divmod(t, size)
            start = rank * base + min(rank, extra)
            end = start + base + (rank < extra)
        elif rank == i % size:
            start, end = 0, t
        else:
            start = end = 0
        per_t = h * w
        first = patch + (0 if held and split else start * per_t)
        if end > start:
            pieces.append((slice(first, first + (end - start) * per_t), [end - start, h, w],
                           slice(token + start * per_t // merge**2, token + end * per_t // merge**2)))
        patch += (end - start if held and split else t) * per_t
        token += t * per_t // merge**2
    if not pieces:
        return None
    rows = pixels[pieces[0][0]] if len(pieces) == 1 else torch.cat([pixels[r] for r, _, _ in pieces])
    return rows, torch.tensor([g for _, g, _ in pieces], dtype=grid.dtype, device=grid.device), \
        [t for _, _, t in pieces]
