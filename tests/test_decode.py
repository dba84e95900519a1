"""Decoding one video on several threads (``data.decode_threads``): the frames cut into pieces at keyframes, each
piece read by its own decord reader, side by side; the pixels bitwise those of qwen-vl-utils' one reader, on real
H.264 files (keyframes inside the range, a frame rate that is not an integer, a frame count the pieces do not
divide, a per-frame cap and a whole-video pixel budget)."""

from __future__ import annotations

import pytest
import torch

from app.data.video import (
    VideoDecodeError,
    decode_share,
    decode_video,
    default_decode_threads,
    pieces_at_keyframes,
    temporal_share,
    video_element,
)

ELEMENTS = {"per frame": dict(fps=8, max_frames=64, min_pixels=3136, max_pixels=12544),
            "whole-video budget": dict(fps=8, max_frames=64, min_pixels=3136, total_pixels=30 * 3136 * 2)}


def fetched(element: dict):
    """qwen-vl-utils' own ``fetch_video`` (decord backend): the frames the data path must give bit for bit."""
    from qwen_vl_utils import fetch_video

    (frames, metadata), _ = fetch_video(element, image_patch_size=14, return_video_sample_fps=True,
                                        return_video_metadata=True)
    return frames, dict(metadata)


@pytest.mark.parametrize("chunk", [3, 16])
@pytest.mark.parametrize("budget", ELEMENTS)
@pytest.mark.parametrize("clip", ["ntsc", "twelve"])
def test_pieces_on_several_threads_give_one_readers_pixels(clips, clip, budget, chunk, monkeypatch):
    """Each piece decoded and resized ``chunk`` frames at a time (``video.CHUNK_FRAMES``: 16; 3 puts several
    chunks in every piece): the pixels of qwen-vl-utils' one reader resizing all frames at once."""
    import decord

    monkeypatch.setattr("app.data.video.CHUNK_FRAMES", chunk)

    element = video_element(clips[clip], **ELEMENTS[budget])
    whole, meta = fetched(element)  # qwen-vl-utils' fetch_video: one reader, every frame resized at once
    keys = list(decord.VideoReader(str(clips[clip])).get_key_indices())
    assert len(keys) > 3  # keyframes inside the range: the pieces are really several
    for threads in (1, 2, 3, 5):
        assert threads == 1 or len(pieces_at_keyframes(meta["frames_indices"], keys, threads)) > 1
        frames, metadata = decode_video(element, threads=threads)
        assert torch.equal(frames, whole), (clip, budget, threads)
        assert metadata == meta
    # the setting reaches it through the element (data.decode_threads, set by records.build_conversation)
    frames, _ = decode_video({**element, "decode_threads": 3})
    assert torch.equal(frames, whole)


def test_pieces_start_at_keyframes_cover_every_frame_once_and_share_the_decoding():
    keys = [0, 7, 14, 21, 28, 35, 42, 49, 56]
    indices = list(range(0, 61, 3))
    pieces = pieces_at_keyframes(indices, keys, 3)
    assert [i for p in pieces for i in p] == indices and len(pieces) == 3
    segment = [max(k for k in keys if k <= p[0]) for p in pieces]  # each piece's first keyframe
    assert all(max(k for k in keys if k <= p[-1]) < segment[n + 1] for n, p in enumerate(pieces[:-1]))  # no overlap
    assert max(map(len, pieces)) - min(map(len, pieces)) <= 3
    assert pieces_at_keyframes(indices, [0], 4) == [indices]  # one keyframe: one piece
    assert pieces_at_keyframes(indices, keys, 1) == [indices]
    assert len(pieces_at_keyframes(indices, keys, 50)) == len(keys)  # at most one piece a keyframe


def test_a_piece_that_fails_names_the_file_its_time_range_and_decords_error(clips, monkeypatch):
    import decord

    real = decord.VideoReader.get_batch

    def broken(self, frames):
        if frames[0] >= 28:
            raise decord.DECORDError("[h264 @ 0x1] Invalid NAL unit size")
        return real(self, frames)

    monkeypatch.setattr(decord.VideoReader, "get_batch", broken)
    element = video_element(clips["ntsc"], **ELEMENTS["per frame"])
    with pytest.raises(VideoDecodeError) as failed:
        decode_video(element, threads=2)
    message = str(failed.value)
    assert str(clips["ntsc"]) in message and "Invalid NAL unit size" in message
    assert " s) could not be decoded" in message and "frames " in message


def test_the_default_shares_the_cores_among_ranks_and_prefetch_threads(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert default_decode_threads(1, 1) == 16 and default_decode_threads(8, 2) == 1
    assert default_decode_threads(2, 2) == 4 and default_decode_threads(32, 2) == 1


@pytest.mark.parametrize("budget", ELEMENTS)
@pytest.mark.parametrize("clip", ["ntsc", "twelve"])
def test_a_ranks_share_decoded_alone_is_its_share_of_the_whole_decode(clips, clip, budget):
    """Each of S = 2, 3, 4 ranks reads only its contiguous temporal patches (from the keyframe before them):
    bitwise the rows of a whole decode, the whole video's metadata, the shares covering every frame once; at
    S = 3 the temporal patches do not divide evenly, and keyframes fall inside shares."""
    import decord

    element = video_element(clips[clip], **ELEMENTS[budget])
    whole, meta = decode_video(element, threads=1)
    keys = set(decord.VideoReader(str(clips[clip])).get_key_indices())
    inside = 0
    for size in (2, 3, 4):
        covered = []
        for rank in range(size):
            frames, metadata, (first, end) = decode_share(element, rank, size, threads=2)
            assert torch.equal(frames, whole[first:end]), (clip, budget, size, rank)
            assert metadata == meta and (end - first) % 2 == 0
            covered += range(first, end)
            inside += any(k in keys for k in meta["frames_indices"][first + 1:end])
        assert covered == list(range(whole.shape[0]))
    assert inside  # some share starts before a keyframe it then passes


def test_shares_follow_the_towers_rule():
    from app.grouping.media import local_share

    for frames in (2, 8, 16, 30):
        for size in (1, 2, 3, 4):
            grid = torch.tensor([[frames // 2, 2, 2]])
            pixels = torch.arange(frames // 2 * 4).unsqueeze(1)  # one row per patch, 4 patches a temporal patch
            for rank in range(size):
                first, end = temporal_share(frames, rank, size)
                piece = local_share(pixels, grid, rank, size, split_time=True, merge=1)
                if frames // 2 >= size:
                    assert piece[1][0, 0].item() * 2 == end - first
                    assert torch.equal(piece[0][:, 0], torch.arange(first // 2 * 4, end // 2 * 4))
                else:
                    assert (first, end) == (0, frames)  # too short to split: it goes whole to one rank


def test_a_shares_pixels_through_the_processor_are_the_wholes_rows(clips, tiny_checkpoints):
    """The processor on a share's frames alone gives the rows ``media.local_share`` takes from the whole video's
    pixels, with the whole video's grid's spatial size."""
    from app.grouping.media import local_share
    from app.runtime.models import load_processor

    processor = load_processor(tiny_checkpoints["qwen2_5_vl"]).video_processor
    element = video_element(clips["twelve"], **ELEMENTS["per frame"])
    whole, _ = decode_video(element)
    out = processor(videos=[whole], return_tensors="pt")
    for rank in range(3):
        frames, _, _ = decode_share(element, rank, 3)
        mine = processor(videos=[frames], return_tensors="pt")
        rows, grid, _ = local_share(out["pixel_values_videos"], out["video_grid_thw"], rank, 3, split_time=True,
                                    merge=1)
        assert torch.equal(mine["pixel_values_videos"], rows) and torch.equal(mine["video_grid_thw"], grid)
