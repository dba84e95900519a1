"""A sequence-parallel rank's prompt holding only its share of each video (``data.decode_shares``).

Under S > 1 a rank's frame-split tower reads only its contiguous temporal patches of each video
(``app.grouping.media.local_share``), so the data path decodes and processes only those frames
(``app.data.video.decode_share``: read from the keyframe before them, resized to the size the whole video gets).
The prompt is still the whole video's: its token layout, its grid and its timestamps come from the whole video's
frame indices, which the container gives without decoding (``video.sampled_frames``). The processor runs on the
share's frames with the whole video's metadata, and ``WholeGrids`` hands it each video's whole grid, so the text is
expanded for the whole video while the pixels are the share's rows: bitwise those ``media.keep_share`` cuts from a
whole decode. The prompt says whose share it holds (``media.SHARE``); collating, the tower and the vision cache read
it as they read a batch cut by ``keep_share``. A rollout that runs a whole family on one rank makes its prompts whole
again from the group's shares (``app.rollout.base.whole_media``).
"""

from __future__ import annotations

import copy

import torch


def shares_decoded(cfg, sp_size: int, reads_shares: bool = True) -> bool:
    """Whether a run's ranks decode only their shares of each video: S > 1, ``data.decode_shares``, a recipe whose
    batches are collated with the rank's share (``reads_shares``: the GRPO recipe's are), the grouped engine (the
    one that spreads a rollout), a split that may spread (``rollout.sp_split`` not ``families``) and no recording
    of the rollouts (``rollout.record``: a record is named by its prompt's whole pixels, ``prompt_identity``)."""
    return (sp_size > 1 and reads_shares and getattr(cfg.data, "decode_shares", True)
            and cfg.rollout.engine == "grouped" and getattr(cfg.rollout, "sp_split", "auto") != "families"
            and not getattr(cfg.rollout, "record", False))


class WholeGrids:
    """A video processor whose output names each video's whole grid: the inner processor runs on a share's frames
    (its pixel rows are the share's), and the grid's temporal size becomes the whole video's frames over the
    temporal patch, so the processor around it expands each placeholder for the whole video."""

    def __init__(self, inner, whole_frames: list[int]):
        self._inner, self._whole_frames = inner, whole_frames

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __call__(self, videos, **kwargs):
        budget = frame_budget(self._inner)
        if budget is not None:  # its resize weighs the frame count: resized here as the whole video would be
            videos = [budget(frames, whole) for frames, whole in zip(videos, self._whole_frames)]
            kwargs["do_resize"] = False
        out = self._inner(videos, **kwargs)
        grid = out["video_grid_thw"]
        temporal = int(getattr(self._inner, "temporal_patch_size", 2) or 2)
        whole = torch.as_tensor(grid).clone()
        if len(self._whole_frames) != whole.shape[0]:
            raise ValueError(f"{whole.shape[0]} videos processed, {len(self._whole_frames)} whole frame counts given")
        whole[:, 0] = torch.tensor([-(-n // temporal) for n in self._whole_frames], dtype=whole.dtype)
        out["video_grid_thw"] = whole if isinstance(grid, torch.Tensor) else whole.tolist()
        return out


def frame_budget(video_processor):
    """For a video processor whose resize budgets pixels over the whole video (Qwen3-VL's and Qwen3.5's: its
    module's ``smart_resize`` takes ``num_frames``), a function (share's frames, the whole video's frame count) ->
    the frames resized to the size the processor gives the whole video (the same resize call when it differs from
    theirs, none when it does not, as the processor's own resize returns a same-size video unchanged); None for a
    processor that sizes each frame alone (Qwen2-VL's, Qwen2.5-VL's): the share's frames get the whole's size."""
    import inspect
    import sys

    from transformers.image_processing_backends import TorchvisionBackend
    from transformers.image_utils import SizeDict

    resize = getattr(sys.modules.get(type(video_processor).__module__), "smart_resize", None)
    if resize is None or "num_frames" not in inspect.signature(resize).parameters:
        return None
    size = video_processor.size
    size = size if isinstance(size, SizeDict) else SizeDict(**dict(size))
    factor = video_processor.patch_size * video_processor.merge_size

    def as_whole(frames: torch.Tensor, whole: int) -> torch.Tensor:
        height, width = frames.shape[-2:]
        target = resize(num_frames=whole, height=height, width=width, factor=factor,
                        temporal_factor=video_processor.temporal_patch_size, min_pixels=size.shortest_edge,
                        max_pixels=size.longest_edge)
        if tuple(target) == (height, width):
            return frames
        return TorchvisionBackend.resize(video_processor, frames[None], SizeDict(height=target[0], width=target[1]),
                                         resample=video_processor.resample)[0]

    return as_whole


def with_whole_grids(processor, whole_frames: list[int]):
    """A shallow copy of ``processor`` whose video processor reports each video's whole grid (``WholeGrids``);
    the processor itself is left alone (prefetch threads share it)."""
    mine = copy.copy(processor)
    mine.video_processor = WholeGrids(processor.video_processor, whole_frames)
    return mine


def share_marker(rank: int, size: int) -> dict:
    """The key a prompt's processor output carries when it holds only rank ``rank``'s share of its videos."""
    from app.grouping.media import SHARE

    return {SHARE["pixel_values_videos"]: torch.tensor([rank, size])}
