"""What a run holds beside the model: the prompts' pixels on the device (one copy of a family's video, in the
tower's dtype) and on the host (the step's and the prefetch's, the decode at work, ZeRO's offload), per rank and per
node; and its checkpoints on disk (``disk``)."""

from __future__ import annotations

import math

from app.planning.costs import GiB, Shape, Workload


def pixel_bytes(shape: Shape, patches: int, dtype_bytes: int = 4) -> float:
    """A video's pixel values: 3 x temporal_patch x patch^2 per patch, in the tower's dtype (the data stream keeps
    them in it: ``data.stream.pixels_in``; float32 in a float32 run)."""
    return float(patches * 3 * shape.temporal_patch * shape.patch**2 * dtype_bytes)


def cached_outputs(shape: Shape, work: Workload, videos: int, dtype_bytes: int) -> float:
    """The tower's outputs of ``videos`` videos, kept for the step (forward.vision_cache step or run, a frozen
    tower): a rank of a spread rollout keeps its share."""
    return videos * work.visual * shape.hidden * dtype_bytes


def distinct_videos(prompts: float, questions: int) -> int:
    """Videos among ``prompts`` prompts in families of ``questions`` (held once each: ``app.grouping.media``)."""
    return max(1, math.ceil(prompts / max(1, questions)))


HOST_WORKERS_FLOAT32 = 2  # float32 copies of a video per prefetch worker: its resized frames, the processor's output
SOURCE_FRAME_BYTES = 1280 * 720 * 3  # a source frame as decord gives it (uint8), 720p: the planner's default source
IN_FLIGHT_BYTES = 5  # per source byte while a chunk is resized: decord's uint8 and the resize's float32 copy


def share_of_video(cfg) -> int:
    """How many ranks share each video's decoding: S when they decode shares (``app.data.shares``), else 1."""
    from app.data.shares import shares_decoded

    size = cfg.train.sequence_parallel_size
    return size if shares_decoded(cfg, size) else 1


def host_memory(cfg, shape: Shape, work: Workload, world, states: dict, b: int, *, tables: int = 0) -> dict:
    """Host (CPU) memory per node while a step runs: per rank, the step's and the prefetch's prompts' pixels (a
    family's video once, in the tower's dtype), each prefetch worker's decode at work (each decoding thread's chunk
    of source frames, ``app.data.video.CHUNK_FRAMES``, as decord gives them and as the resize copies them; the
    resized frames and the processor's output, float32, before the cast), and what ZeRO offloads to the host; times
    the ranks of a node; plus ``tables`` parameters kept in host memory once per node (Qwen3.8-Flash-Next's PLE
    n-gram tables, memory-mapped by every rank: one copy). Ranks that decode their shares (``share_of_video``) hold
    1/S of each video.
    ``data.decode_threads`` = 0 is counted as 1 thread (the host's cores are not known here)."""
    from app.data.video import CHUNK_FRAMES

    k = max(1, min(getattr(cfg.data, "questions_per_video", 1), cfg.train.prompts_per_rank))
    lookahead = cfg.data.prefetch * cfg.train.prompts_per_rank
    held = distinct_videos(cfg.train.prompts_per_rank + lookahead, k)
    size = share_of_video(cfg)
    part = -(-work.temporal // size) / work.temporal if work.temporal else 1.0  # the largest share
    video = pixel_bytes(shape, work.patches, b) * part
    sampled = -(-work.temporal // size) * shape.temporal_patch if work.temporal else 0
    threads = max(1, getattr(cfg.data, "decode_threads", 1) or 1)
    in_flight = threads * min(CHUNK_FRAMES, sampled) * SOURCE_FRAME_BYTES * IN_FLIGHT_BYTES
    workers = min(getattr(cfg.data, "prefetch_workers", 2), max(1, held)) if cfg.data.prefetch else 1
    decode = workers * (in_flight + pixel_bytes(shape, work.patches, 4) * part * HOST_WORKERS_FLOAT32)
    rank = {"pixels": held * video, "decoding": decode, "offload": states.get("host", 0.0)}
    rank["total"] = sum(rank.values())
    per_node = rank["total"] * world.gpus_per_node + tables * b
    usable = world.headroom * world.host_memory_gib * GiB
    return {"rank": rank, "node": per_node, "tables": tables * b, "usable": usable, "fits": per_node <= usable}


def disk(cfg, counts, trainable: int, b: int, stage: int, lora: bool) -> dict:
    """What a checkpoint and the final export take on disk (``checkpoint.save_bytes``, the trainer's own
    estimate), and the free bytes where train.output_dir is (or would be)."""
    from app.runtime.checkpoint import free_bytes, save_bytes

    adapter = trainable if lora else 0
    sizes = save_bytes(counts.total, trainable, b, stage, adapter=adapter, save_adapter=lora and cfg.lora.save_adapter)
    try:
        free = free_bytes(cfg.train.output_dir)
    except OSError:
        free = None
    need = sizes["checkpoint"] * (cfg.train.keep_checkpoints + 1) + (sizes["export"] if cfg.train.export_hf else 0)
    return {**sizes, "keep": cfg.train.keep_checkpoints, "need": need, "free": free,
            "output_dir": cfg.train.output_dir}


def video_tokens(shape: Shape, frames: int, max_pixels: int, *, size: tuple[int, int] | None = None,
                 min_pixels: int = 0) -> tuple[int, int, int]:
    """(merged visual tokens, tower patches, temporal patches) of a video of ``frames`` frames at most
    ``max_pixels`` pixels per frame: with the source frames' ``size`` (width, height) as qwen-vl-utils resizes them
    (``smart_resize``: each side to the grid, within [min_pixels, max_pixels]); without it the upper bound (frames
    that fill max_pixels exactly)."""
    temporal = max(1, -(-frames // shape.temporal_patch))
    if size is None:
        per_temporal = max(1, max_pixels // shape.pixels_per_token)
    else:
        factor = shape.patch * shape.merge
        height, width = smart_resize(size[1], size[0], factor, min_pixels, max_pixels)
        per_temporal = (height // factor) * (width // factor)
    tokens = temporal * per_temporal
    return tokens, tokens * shape.merge**2, temporal


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """A frame's size after qwen-vl-utils' resize: each side rounded to a multiple of ``factor``, the area brought
    within [min_pixels, max_pixels] keeping the aspect (qwen_vl_utils.vision_process.smart_resize)."""
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def frame_pixels(max_pixels: int, min_pixels: int, frames: int, total_pixels: int, factor: int) -> int:
    """The most pixels a frame gets, as the data path asks qwen-vl-utils (``app.data.video.video_element``):
    ``max_pixels``, or with a whole-video budget ``total_pixels`` > 0 the budget over the frames x 2, at least
    1.05 x min_pixels, at most 768 tokens' worth (qwen-vl-utils' own per-frame ceiling)."""
    if not total_pixels:
        return max_pixels
    frames = max(2, -(-frames // 2) * 2)
    ceiling = 768 * factor * factor
    return min(max_pixels, max(min(ceiling, total_pixels / frames * 2), int(min_pixels * 1.05)))


# ---------------------------------------------------------------------------------------------------- activations
ATTENTION_BACKENDS = ("split", "flash", "flex", "packed", "paper", "repeated")
