"""Writing mp4 files (PyAV) and decoding videos through qwen-vl-utils with the decord backend."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import torch

import app  # noqa: F401  (sets FORCE_QWENVL_VIDEO_READER=decord before qwen_vl_utils is imported)


class SettingError(ValueError):
    """A video could not be sampled because of a setting (data.max_frames, data.fps), not because of the file: the
    run stops naming the setting instead of skipping every video as undecodable."""


class VideoDecodeError(RuntimeError):
    """A video that could not be read or has no frames."""


def write_mp4(path: str | Path, frames, fps: float = 8.0, *, keyframe_interval: int = 0, crf: int = 18,
              preset: str = "ultrafast") -> Path:
    """Write uint8 frames [T, H, W, 3] (H, W even) to an H.264 mp4 at ``fps`` (a fraction such as 29.97 is kept as
    30000/1001); ``keyframe_interval`` > 0: a keyframe every that many frames (x264's default otherwise, 250).
    ``frames`` may also be an iterator of [H, W, 3] frames, made one at a time (a long clip never sits in memory);
    ``crf`` and ``preset``: x264's."""
    import itertools
    from fractions import Fraction

    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if hasattr(frames, "__next__"):
        first = np.asarray(next(frames), dtype=np.uint8)
        height, width = first.shape[:2]
        frames = itertools.chain([first], frames)
    else:
        frames = np.asarray(frames, dtype=np.uint8)
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"frames must be [T, H, W, 3] uint8, got shape {frames.shape}")
        height, width = frames.shape[1], frames.shape[2]
    tmp = path.with_suffix(".partial.mp4")
    with av.open(str(tmp), mode="w") as container:
        rate = int(round(fps)) if float(fps).is_integer() else Fraction(fps).limit_denominator(1001)
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf), "preset": preset,
                          **({"g": str(keyframe_interval), "keyint_min": str(keyframe_interval), "sc_threshold": "0"}
                             if keyframe_interval else {})}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.asarray(frame, dtype=np.uint8),
                                                                   format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    os.replace(tmp, path)
    return path


NO_VIDEO_BUDGET = 10**15  # a whole-video pixel budget no video reaches: each frame gets its max_pixels


def video_element(path: str | Path, fps: float = 2.0, max_frames: int | None = None, min_pixels: int | None = None,
                  max_pixels: int | None = None, *, total_pixels: int = 0) -> dict:
    """A qwen-vl-utils message element; always carries min_pixels with max_pixels (its defaults assert otherwise).
    ``total_pixels`` > 0: a budget for the whole video instead of ``max_pixels`` per frame (qwen-vl-utils then caps
    each frame at total_pixels / frames x 2, at least 1.05 x min_pixels). 0 with ``max_pixels``: every frame gets
    ``max_pixels`` at any length: qwen-vl-utils 0.0.14 otherwise applies a budget of its own (MODEL_SEQ_LEN, 128,000
    tokens from the environment, x 28^2 x 0.9), which above 1,800 frames gives each frame less (an hour at 1 fps:
    half), so the element carries a budget no video reaches (``NO_VIDEO_BUDGET``)."""
    element: dict = {"type": "video", "video": str(path), "fps": fps}
    if max_frames is not None:
        element["max_frames"] = max_frames
    if total_pixels:
        element["total_pixels"] = total_pixels
        element["min_pixels"] = min_pixels if min_pixels is not None else 4 * 28 * 28
    elif max_pixels is not None:
        element["max_pixels"] = max_pixels
        element["min_pixels"] = min_pixels if min_pixels is not None else min(max_pixels, 4 * 28 * 28)
        element["total_pixels"] = NO_VIDEO_BUDGET
    elif min_pixels is not None:
        element["min_pixels"] = min_pixels
    return element


FRAME_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


def frame_files(folder: str | Path) -> list[Path]:
    """A frame folder's images in frame order (natural order: frame_2 before frame_10)."""
    def key(path: Path):
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]

    return sorted((p for p in Path(folder).iterdir() if p.suffix.lower() in FRAME_SUFFIXES), key=key)


def _sample_at_fps(folder: str | Path, element: dict, image_patch_size: int = 14) -> dict:
    """The frames of a folder recorded at ``folder_fps``, sampled at ``fps`` (at most ``max_frames``, evenly
    spaced, an even count as qwen-vl-utils samples videos), with the sampling and source rates qwen-vl-utils passes
    on to the processor as the video's metadata."""
    frames = frame_files(folder)
    native = float(element.get("folder_fps", 3.0))
    wanted = len(frames) / native * float(element.get("fps", 2.0))
    count = min(int(element.get("max_frames", len(frames))), len(frames), max(2, round(wanted)))
    count = max(2, count - count % 2)
    index = np.linspace(0, len(frames) - 1, count).round().astype(int)
    return {"video": [str(frames[i]) for i in index], "sample_fps": count / (len(frames) / native), "raw_fps": native}


def _sample_videochat_r1_track(folder: str | Path, element: dict, image_patch_size: int = 14) -> dict:
    """VideoChat-R1's GOT-10k tracking evaluation (src_eval/evaluate_track.py): of the folder's ``.jpg`` files in
    name order, the first, ``int(i * (n - 1) / 6)`` for i = 1..5 and the last: 7 frames, which qwen-vl-utils makes
    8 (an even count) by repeating the last, for the 8 boxes its prompt asks for. Each is sized as the
    qwen-vl-utils 0.0.10 it pins sizes a list of frames, as images (its ``min_pixels``, at most 16384 x 28 x 28
    pixels, no whole-video budget), and it reads as 2 fps (0.0.10's default for a list)."""
    from PIL import Image
    from qwen_vl_utils.vision_process import smart_resize

    files = sorted(str(p) for p in Path(folder).iterdir() if p.name.endswith(".jpg"))
    if not files:
        raise VideoDecodeError(f"{folder}: no .jpg frames (data.frame_folder_sampling=videochat_r1_track reads .jpg "
                               "files only, as VideoChat-R1's script does)")
    step = (len(files) - 1) / 6
    chosen = [files[0]] + [files[int(i * step)] for i in range(1, 6)] + [files[-1]]
    with Image.open(chosen[0]) as first:
        width, height = first.size
    factor = image_patch_size * 2
    resized_height, resized_width = smart_resize(height, width, factor=factor,
                                                 min_pixels=element.get("min_pixels", 4 * 28 * 28),
                                                 max_pixels=16384 * 28 * 28)
    return {"video": chosen, "sample_fps": 2.0, "raw_fps": 2.0, "resized_height": resized_height,
            "resized_width": resized_width}


FRAME_FOLDER_SAMPLING = {  # data.frame_folder_sampling -> (folder, element, image_patch_size) -> element updates
    "fps": _sample_at_fps,
    "videochat_r1_track": _sample_videochat_r1_track,
}


def frame_folder_element(element: dict, image_patch_size: int = 14) -> dict:
    """The element for a folder of frames: the frames its ``folder_sampling`` picks (``FRAME_FOLDER_SAMPLING``;
    default ``fps``: sampled at ``fps`` from a folder recorded at ``folder_fps``) as a list of image paths, with the
    sampling and source rates qwen-vl-utils passes on to the processor as the video's metadata."""
    frames = frame_files(element["video"])
    if len(frames) < 2:
        raise VideoDecodeError(f"{element['video']}: frame folder with {len(frames)} image file(s); need at least 2")
    sampling = element.get("folder_sampling", "fps")
    if sampling not in FRAME_FOLDER_SAMPLING:
        raise SettingError(f"unknown data.frame_folder_sampling {sampling!r} (known: "
                           f"{', '.join(FRAME_FOLDER_SAMPLING)})")
    picked = FRAME_FOLDER_SAMPLING[sampling](element["video"], element, image_patch_size)
    out = {k: v for k, v in element.items()
           if k not in ("video", "fps", "max_frames", "folder_fps", "folder_sampling")}
    if "resized_height" in picked:  # the frames' size is fixed: no pixel budget applies
        out = {k: v for k, v in out.items() if k not in ("total_pixels", "max_pixels")}
    out.update(picked)
    return out


def default_decode_threads(ranks_per_node: int, prefetch_workers: int) -> int:
    """``data.decode_threads`` = 0: the cores this process may use, shared by the node's ranks and the prefetch
    threads that decode videos side by side (at least 1)."""
    from app.compat import usable_cores

    return max(1, usable_cores() // max(1, ranks_per_node) // max(1, prefetch_workers))


def pieces_at_keyframes(indices: list[int], keyframes: list[int], threads: int) -> list[list[int]]:
    """``indices`` (sorted frame numbers to read) cut into at most ``threads`` contiguous pieces, each starting at a
    keyframe's segment so that no two pieces decode the same frames, balanced by the frames each must decode (from
    its first segment's keyframe to its last index)."""
    if threads <= 1 or len(indices) < 2:
        return [list(indices)]
    import bisect

    starts = sorted(set(keyframes) | {0})
    segments: dict[int, list[int]] = {}  # keyframe -> the indices that decoding reaches from it
    for i in indices:
        segments.setdefault(starts[bisect.bisect_right(starts, i) - 1], []).append(i)
    groups = list(segments.items())
    if len(groups) < 2:
        return [list(indices)]
    cost = [idx[-1] - key + 1 for key, idx in groups]
    parts = min(threads, len(groups))
    total, pieces, current, spent = sum(cost), [], [], 0.0
    for (_, idx), c in zip(groups, cost):
        # a new piece once this segment's middle passes the next even share of the decoding
        if current and spent + c / 2 > total * (len(pieces) + 1) / parts and len(pieces) < parts - 1:
            pieces.append(current)
            current = []
        current += idx
        spent += c
    pieces.append(current)
    return pieces


CHUNK_FRAMES = 16  # frames a piece decodes and hands to ``then`` at a time (read_frames)


def read_frames(path: str, indices: list[int], threads: int = 1, then=None) -> torch.Tensor:
    """Frames ``indices`` of ``path`` as uint8 [T, 3, H, W], decoded by decord in pieces cut at keyframes
    (``pieces_at_keyframes``), one reader per piece on ``threads`` threads: the pixels are those of one reader
    (H.264 decoding is exact). A piece that fails names the file, its frames and time range, and decord's error.
    ``then``: a function of uint8 frames [t, 3, H, W] applied to each ``CHUNK_FRAMES`` of a piece in the piece's
    thread as soon as they are decoded (the resize: its work spread over the threads too, and only a chunk of
    source-size frames held at a time); the result is its outputs joined."""
    from concurrent.futures import ThreadPoolExecutor

    import decord

    reader = decord.VideoReader(str(path), num_threads=1)
    fps = float(reader.get_avg_fps()) or 1.0
    pieces = pieces_at_keyframes(indices, list(reader.get_key_indices()) if threads > 1 else [], threads)

    def piece(frames: list[int], own=None):
        r = own or decord.VideoReader(str(path), num_threads=1)
        step = CHUNK_FRAMES if then is not None else max(1, len(frames))
        out = []
        for at in range(0, len(frames), step):
            chunk = frames[at : at + step]
            try:
                batch = torch.from_numpy(r.get_batch(chunk).asnumpy()).permute(0, 3, 1, 2)
            except Exception as error:  # decord raises its own error types
                raise VideoDecodeError(f"{path}: frames {chunk[0]}-{chunk[-1]} ({chunk[0] / fps:.2f}-"
                                       f"{chunk[-1] / fps:.2f} s) could not be decoded ({type(error).__name__}: "
                                       f"{str(error).splitlines()[0] if str(error) else ''})") from error
            out.append(batch if then is None else then(batch))
        return out[0] if len(out) == 1 else torch.cat(out)

    if len(pieces) == 1:
        parts = [piece(pieces[0], reader)]
    else:
        with ThreadPoolExecutor(max_workers=len(pieces)) as pool:
            parts = list(pool.map(piece, pieces))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def sampled_frames(element: dict) -> tuple[list[int], int, float]:
    """The frame numbers qwen-vl-utils samples from a file (its own ``calculate_video_frame_range`` and
    ``smart_nframes``, as its decord reader does), the file's frame count and rate: from the container, no frame
    decoded."""
    import decord
    from qwen_vl_utils import vision_process as qv

    reader = decord.VideoReader(str(element["video"]), num_threads=1)
    total, video_fps = len(reader), reader.get_avg_fps()
    start, end, total = qv.calculate_video_frame_range(element, total, video_fps)
    nframes = qv.smart_nframes(element, total_frames=total, video_fps=video_fps)
    return torch.linspace(start, end, nframes).round().long().tolist(), total, video_fps


def temporal_share(frames: int, rank: int, size: int, temporal_patch: int = 2) -> tuple[int, int]:
    """The sampled frames [first, end) of rank ``rank``'s share of a video over ``size`` ranks: contiguous temporal
    patches, the first ranks one more (``app.grouping.media.local_share``'s rule); the whole video when it has
    fewer temporal patches than ranks (it then goes whole to one rank)."""
    patches = -(-frames // temporal_patch)
    if size <= 1 or patches < size:
        return 0, frames
    base, extra = divmod(patches, size)
    first = rank * base + min(rank, extra)
    return first * temporal_patch, min(frames, (first + base + (rank < extra)) * temporal_patch)


def decode_in_pieces(element: dict, image_patch_size: int, threads: int, share: tuple[int, int] | None = None,
                     sampled: tuple[list[int], int, float] | None = None) -> tuple[torch.Tensor, dict]:
    """qwen-vl-utils' ``fetch_video`` for a file on the decord backend (its frame indices, resize and metadata, its
    own helpers), with the frames read and resized by ``read_frames`` on ``threads`` threads, a chunk at a time:
    the same tensor. ``share``
    (first, end): only those of the sampled frames are read and resized, to the size the whole video gets (its
    pixel budget counts every sampled frame): bitwise ``frames[first:end]`` of the whole decode, with the whole
    video's metadata. ``sampled``: ``sampled_frames(element)`` when the caller has it already."""
    import time

    from qwen_vl_utils import vision_process as qv
    from torchvision.transforms import InterpolationMode, functional

    path = element["video"]
    began = time.time()
    idx, total, video_fps = sampled or sampled_frames(element)
    nframes = len(idx)
    first, end = share or (0, nframes)
    factor = image_patch_size * qv.SPATIAL_MERGE_SIZE
    min_pixels = element.get("min_pixels", qv.VIDEO_MIN_TOKEN_NUM * factor * factor)
    total_pixels = element.get("total_pixels", qv.MODEL_SEQ_LEN * factor * factor * 0.9)
    max_pixels = max(min(qv.VIDEO_MAX_TOKEN_NUM * factor * factor, total_pixels / nframes * qv.FRAME_FACTOR),
                     int(min_pixels * 1.05))
    max_pixels = min(element.get("max_pixels", max_pixels), max_pixels)

    def resized(frames: torch.Tensor) -> torch.Tensor:  # qwen-vl-utils' resize, a chunk of frames at a time
        height, width = frames.shape[2:]
        if "resized_height" in element and "resized_width" in element:
            size = qv.smart_resize(element["resized_height"], element["resized_width"], factor=factor)
        else:
            size = qv.smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
        return functional.resize(frames, list(size), interpolation=InterpolationMode.BICUBIC, antialias=True).float()

    video = read_frames(path, idx[first:end], threads, then=resized)
    qv.logger.info(f"decord:  video_path={path!r}, total_frames={total}, video_fps={video_fps}, "
                   f"time={time.time() - began:.3f}s ({threads} threads"
                   + (f", frames {first}-{end} of {nframes}" if share else "") + ")")  # qwen-vl-utils' own line
    metadata = {"fps": video_fps, "frames_indices": idx, "total_num_frames": total, "video_backend": "decord"}
    return video, metadata


def decode_share(element: dict, rank: int, size: int, image_patch_size: int = 14, temporal_patch: int = 2,
                 threads: int | None = None) -> tuple[torch.Tensor, dict, tuple[int, int]]:
    """Rank ``rank``'s share of a video file over ``size`` sequence-parallel ranks (``temporal_share``), decoded
    alone: only its frames are read (from the keyframe before them) and resized, bitwise the same rows as that share
    of a whole decode, with the whole video's metadata (so the grid, the token layout and the timestamps stay the
    whole video's); also which sampled frames it holds. The file is checked as ``decode_video`` checks it (the
    same errors); ``threads`` as there. The data path's share decoding (``app.data.shares``)."""
    threads = int(element.get("decode_threads", 1)) if threads is None else threads
    element = {k: v for k, v in element.items() if k != "decode_threads"}
    checked_file(element)
    sampled = sampled_frames(element)
    share = temporal_share(len(sampled[0]), rank, size, temporal_patch)
    frames, metadata = decode_in_pieces(element, image_patch_size, threads, share, sampled)
    return frames, metadata, share


def checked_file(element: dict) -> None:
    """A video file decord opens, with at least 2 frames, that qwen-vl-utils can sample with the element's
    settings; else ``VideoDecodeError`` naming the file (or ``SettingError`` naming the settings).

    The file is opened with decord first: when decord fails, qwen-vl-utils silently retries a torchvision reader
    that no longer exists, and its error would hide the real cause."""
    import decord
    from qwen_vl_utils.vision_process import smart_nframes

    path = element["video"]
    if not Path(path).is_file():
        raise VideoDecodeError(f"{path}: video file not found")
    try:
        reader = decord.VideoReader(str(path), num_threads=1)
        frame_count, native_fps = len(reader), float(reader.get_avg_fps())
    except Exception as error:  # decord raises its own error types
        raise VideoDecodeError(f"{path}: decord could not open the video ({error})") from error
    if frame_count == 0:
        raise VideoDecodeError(f"{path}: the video has no frames")
    if frame_count < 2:  # qwen-vl-utils samples at least FRAME_FACTOR (2) frames and then fails confusingly
        raise VideoDecodeError(f"{path}: the video has {frame_count} frame; qwen-vl-utils needs at least 2 "
                               "(a still picture belongs in an image record)")
    try:  # qwen-vl-utils' own frame arithmetic: the file has >= 2 frames, so a failure here is the settings'
        smart_nframes(element, total_frames=frame_count, video_fps=native_fps)
    except ValueError as error:
        raise SettingError(f"qwen-vl-utils cannot sample {path} ({frame_count} frames at {native_fps:g} fps) with "
                           f"fps={element.get('fps')} and max_frames={element.get('max_frames')} ({error}); check "
                           "data.fps and data.max_frames (at least 2)") from error


def decode_video(element: dict, image_patch_size: int = 14, threads: int | None = None) -> tuple[torch.Tensor, dict]:
    """Decode one video element through qwen-vl-utils (decord backend): frames [T, 3, H, W] float and metadata.
    A file is checked first (``checked_file``), then read as qwen-vl-utils' ``fetch_video`` reads it, bitwise the
    same frames and metadata, a chunk of frames at a time (``decode_in_pieces``: only a chunk of source-size frames
    is held, where ``fetch_video`` holds every sampled frame at the source's size and a float32 copy while it
    resizes: at an hour of 720p at 1 fps, some 50 GB); ``threads`` (default: the element's ``decode_threads``, set
    from ``data.decode_threads``, else 1) > 1: in pieces cut at keyframes, side by side.
    """
    from qwen_vl_utils import fetch_video

    threads = int(element.get("decode_threads", 1)) if threads is None else threads
    element = {k: v for k, v in element.items() if k != "decode_threads"}
    path = element["video"]
    if Path(path).is_dir():
        try:
            (frames, metadata), _ = fetch_video(frame_folder_element(element, image_patch_size),
                                                image_patch_size=image_patch_size, return_video_sample_fps=True,
                                                return_video_metadata=True)
        except (VideoDecodeError, SettingError):
            raise
        except Exception as error:  # PIL on a corrupt frame, ...
            raise VideoDecodeError(f"{path}: frame folder could not be read ({type(error).__name__}: {error})") \
                from error
        return frames, dict(metadata)
    checked_file(element)
    return decode_in_pieces(element, image_patch_size, threads)
