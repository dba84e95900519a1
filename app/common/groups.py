"""Groups are contiguous runs of rows of any sizes (G per prompt, or fewer after filtering); this is the one place
that walks them. Standard library only: rewards, GRPO maths, the trajectory and the trainer all use it."""

from __future__ import annotations

from collections.abc import Sequence


def group_slices(group_sizes: Sequence[int]) -> list[slice]:
    """The rows of each group: [slice(0, G0), slice(G0, G0 + G1), ...]."""
    out, start = [], 0
    for size in group_sizes:
        out.append(slice(start, start + int(size)))
        start += int(size)
    return out
