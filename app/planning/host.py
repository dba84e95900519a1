"""The host's time per step: decoding each video and the processor's work on its frames, on a rank's cores, beside
the GPU phases (``scripts/plan.sh --host-cores N``).

The data path of one video on one rank (``app.data.records.encode_record``): decord decodes the source frames
(at 1 fps from a 30 fps source nearly every frame, because the frames between keyframes must be decoded to reach the
sampled ones), then qwen-vl-utils resizes the sampled frames and the processor normalises and patchifies them.
Priced as

    CPU seconds = source frames decoded x source pixels x ``decode_ns`` x the bitrate class's factor
                + sampled frames x output pixels x ``process_ns``

with the constants measured (``--measure-video FILE``, or ``MEASURED``: issue 76's clip on the project's 2-core CPU).
Under sequence parallelism each rank decodes and processes only its share of each video (``data.decode_shares``,
``app.data.shares``): 1/S of the sampled frames, plus the run-in from the keyframe before its first one; with the
decoding whole (``data.decode_shares=false``, ``rollout.sp_split=families`` or another engine) every rank reads
whole videos. A step's videos are shared among ``data.prefetch_workers``
threads on the rank's cores, each video's decoding and resizing on ``data.decode_threads`` (pieces cut at
keyframes, each decoded and resized a chunk at a time: ``THREAD_GAIN``); with ``data.prefetch`` >= 1 the next step's data is prepared while this one trains, so
the step takes the longer of the two, else their sum.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

KEYFRAME_INTERVAL = 250  # x264's default GOP (frames between keyframes)
# what each decoding thread of one video beyond the first adds, as a share of one thread's work: 2 threads took
# 0.65-0.72x of one's wall time (scripts/bench.sh host_decode, a 720p clip on this 2-core CPU, whose 2 cores set a
# floor of 0.62-0.67x: one thread keeps 1.4 cores busy, decord decoding ahead while it resizes); more threads on more
# cores are priced alike, unmeasured
THREAD_GAIN = 0.45
BITRATE_CLASSES = {"low": 1.0, "medium": 1.5, "high": 2.5}  # decode cost against the measured clip's: a guess


@dataclass(frozen=True)
class HostRates:
    """CPU nanoseconds per pixel on one core: decoding a source pixel (H.264, the measured clip's bitrate), and the
    resize + processor work per output pixel of a sampled frame."""

    decode_ns: float
    process_ns: float
    source: str


# issue 76's clip on this project's CPU: 2 minutes of 1280 x 720 at 30 fps (x264 veryfast, crf 23, a keyframe every
# 250 frames, 1.1 Mbit/s); decord reading 1 frame a second on one thread: 5.2 s of CPU (all 3,600 frames decoded);
# encode_record (qwen-vl-utils and the processor, data.max_pixels 100,352): 12.4 s, grid [60, 16, 30]
MEASURED = HostRates(decode_ns=5.2e9 / (3600 * 1280 * 720), process_ns=(12.4 - 5.2) * 1e9 / (120 * 224 * 420),
                     source="issue 76's 2-minute 720p30 H.264 clip (1.1 Mbit/s) on the project's 2-core CPU")


@dataclass(frozen=True)
class Source:
    """The source videos: frame rate, frame size, bitrate class, keyframe interval."""

    fps: float = 30.0
    width: int = 1280
    height: int = 720
    bitrate: str = "low"
    keyframe_interval: int = KEYFRAME_INTERVAL

    def check(self) -> None:
        if not self.fps > 0 or self.width < 1 or self.height < 1 or self.keyframe_interval < 1:
            raise ValueError(f"the source video's fps, size and keyframe interval must be positive, got {self}")
        if self.bitrate not in BITRATE_CLASSES:
            raise ValueError(f"bitrate class {self.bitrate!r}: expected one of {sorted(BITRATE_CLASSES)}")


def decoded_frames(sampled: int, sample_fps: float, source: Source) -> float:
    """Source frames decord decodes to reach ``sampled`` frames taken at ``sample_fps``: from each one back to the
    previous sampled frame or, when that is further, to its keyframe (half an interval on average)."""
    step = max(1.0, source.fps / sample_fps)
    return sampled * min(step, max(1.0, source.keyframe_interval / 2))


def data_seconds(cfg, shape, work, source: Source, rates: HostRates, *, videos: int, cores: float) -> dict:
    """One rank's data path for one step: CPU seconds (decoding and processing), and its wall time on ``cores``
    cores with ``data.prefetch_workers`` threads (one video per thread at a time). Under shares
    (``inputs.share_of_video``): the rank's share of the sampled frames (whole temporal patches) and the run-in from the
    keyframe before its first one (half an interval on average, less what the sampling decodes anyway)."""
    from app.planning.inputs import share_of_video

    size = share_of_video(cfg)
    patches = -(-work.temporal // size) if work.temporal else 0  # the largest share's temporal patches
    frames = patches * shape.temporal_patch  # sampled frames
    output_pixels = work.patches / work.temporal * shape.patch**2 if work.temporal else 0.0  # per sampled frame
    decoded = decoded_frames(frames, cfg.data.fps, source)
    if size > 1 and frames:
        decoded += max(0.0, source.keyframe_interval / 2 - max(1.0, source.fps / cfg.data.fps))
    decode = decoded * source.width * source.height * rates.decode_ns * BITRATE_CLASSES[source.bitrate] / 1e9
    process = frames * output_pixels * rates.process_ns / 1e9
    threads = max(1, cfg.data.prefetch_workers) if cfg.data.prefetch else 1
    # data.decode_threads (0: the rank's cores over its prefetch threads, as app.data.records.decode_threads does)
    per_video = getattr(cfg.data, "decode_threads", 1) or max(1, int(cores) // threads)
    side_by_side = max(1.0, min(float(threads), float(videos), cores))
    # the pieces of one video decoded and resized side by side, each thread gaining THREAD_GAIN of one
    usable = max(1.0, min(float(per_video), cores / side_by_side))
    wall = (decode + process) * videos / side_by_side / (1 + (usable - 1) * THREAD_GAIN)
    cpu = (decode + process) * videos
    return {"videos": videos, "share": size, "sampled_frames": frames, "decoded_frames": decoded, "output_pixels": output_pixels,
            "decode_cpu_s": decode * videos, "process_cpu_s": process * videos, "cpu_s": cpu, "cores": cores,
            "threads": threads, "decode_threads": per_video, "wall_s": wall,
            "prefetch": cfg.data.prefetch}


def with_host(phase_seconds: dict, data: dict, size: int = 1) -> dict:
    """The step with the data phase: the longer of the two when prefetched (the next step's data overlaps this
    step), their sum otherwise; whether the host is the limit, and what would change it (the remedies that apply
    here, in that order)."""
    gpu = phase_seconds["step"]
    wall = data["wall_s"]
    step = max(gpu, wall) if data["prefetch"] else gpu + wall
    limit = wall > gpu if data["prefetch"] else wall > 0.25 * gpu
    remedies = []
    if limit:
        if not data["prefetch"]:
            remedies.append("data.prefetch=1 (the next step's data prepared while this one trains)")
        if data["videos"] > data["threads"] and data["cores"] > data["threads"]:
            remedies.append(f"more decoding threads (data.prefetch_workers, now {data['threads']}: "
                            f"{data['videos']} videos on {data['cores']:g} cores)")
        if data["cores"] < min(data["threads"], data["videos"]):
            remedies.append("more host cores per rank (--host-cores is a node's)")
        if data["cores"] > min(data["threads"], data["videos"]) * data["decode_threads"]:
            remedies.append(f"more threads decoding each video (data.decode_threads, now {data['decode_threads']})")
        if size > 1 and data.get("share", 1) == 1:
            remedies.append(f"each of the S = {size} ranks decoding only its share of the frames "
                            "(data.decode_shares=true, rollout.sp_split not families)")
        remedies.append("fewer frames (data.fps, data.max_frames) or smaller ones (data.max_pixels)")
    return {"gpu_step_s": gpu, "data_wall_s": wall, "step_s": step, "host_limits": limit,
            "remedy": "; ".join(remedies)}


def host_plan(cfg, shape, work, phase_seconds: dict, source: Source, rates: HostRates, *, videos: int,
              cores: float) -> dict:
    """The data phase of one rank beside the planned GPU step (``phase_seconds``: ``timing.seconds``)."""
    data = data_seconds(cfg, shape, work, source, rates, videos=videos, cores=cores)
    return {"source": asdict(source), "rates": asdict(rates), **data,
            **with_host(phase_seconds, data, cfg.train.sequence_parallel_size)}


def lines(host: dict) -> list[str]:
    """The data phase beside the GPU step, for the plan's text."""
    share = f"its 1/{host['share']} share of each: " if host.get("share", 1) > 1 else "each "
    out = [f"data on the host, per rank and step ({host['videos']} video(s), {share}{host['sampled_frames']} sampled "
           f"of {host['decoded_frames']:.0f} decoded source frames at {host['source']['width']}x"
           f"{host['source']['height']}, {host['source']['fps']:g} fps, bitrate {host['source']['bitrate']}; "
           f"{host['cores']:g} cores, {host['threads']} prefetch thread(s) x {host['decode_threads']} decoding each):",
           f"    decode {host['decode_cpu_s']:.1f} s + process {host['process_cpu_s']:.1f} s of CPU = "
           f"{host['wall_s']:.1f} s wall, against {host['gpu_step_s']:.1f} s on the GPUs: step "
           f"{host['step_s']:.1f} s ({'prefetched: the longer of the two' if host['prefetch'] else 'not prefetched: the sum'})"]
    if host["host_limits"]:
        out.append(f"    the host is the limit: {host['remedy']}")
    out.append(f"    (rates: decode {host['rates']['decode_ns']:.2f} ns per source pixel, process "
               f"{host['rates']['process_ns']:.0f} ns per output pixel; {host['rates']['source']})")
    return out


def measure_video(path: str, sample_fps: float = 1.0, max_pixels: int = 100352, min_pixels: int = 3136) -> HostRates:
    """The rates on this machine from one video file, at the frames the data path samples
    (``app.data.video.sampled_frames``): decord alone reading them on one thread (``read_frames``), then the data
    path's decode and resize (``decode_video``) with the processor's normalise and patchify; CPU seconds
    (``time.process_time``)."""
    import decord
    import numpy as np
    from transformers import Qwen2VLImageProcessor

    from app.data.video import decode_video, read_frames, sampled_frames, video_element

    element = video_element(path, fps=sample_fps, min_pixels=min(min_pixels, max_pixels), max_pixels=max_pixels)
    indices, count, fps = sampled_frames(element)
    height, width = decord.VideoReader(str(path), num_threads=1)[0].shape[:2]
    start = time.process_time()
    read_frames(path, indices)
    decode = time.process_time() - start
    start = time.process_time()
    frames, _ = decode_video(element, threads=1)
    flat = frames.numpy().astype(np.float32)
    Qwen2VLImageProcessor()(images=list(flat[: len(flat) - len(flat) % 2]), do_resize=False, return_tensors="pt")
    process = max(0.0, time.process_time() - start - decode)
    sampled, out_pixels = frames.shape[0], frames.shape[-1] * frames.shape[-2]
    decoded = decoded_frames(len(indices), sample_fps, Source(fps=float(fps), width=width, height=height))
    return HostRates(decode_ns=decode * 1e9 / (decoded * width * height),
                     process_ns=process * 1e9 / (sampled * out_pixels),
                     source=f"measured on {path} ({count} frames of {width}x{height} at {float(fps):g} fps) here")



def data_phase(cfg, shape, work, seconds: dict, ranks_per_node: int, *, host, videos: int | None):
    """The host's decoding and processing per rank and step beside the GPU step, or None without ``--host-cores``
    (``host``: cores per node, ``Source``, ``HostRates``). Each rank of a sequence-parallel group decodes its share
    of its replica's videos, or the whole of them (``inputs.share_of_video``)."""
    if host is None or not work.patches:
        return None
    from app.planning.inputs import distinct_videos

    cores, source, rates = host
    k = max(1, min(getattr(cfg.data, "questions_per_video", 1), cfg.train.prompts_per_rank))
    count = videos or distinct_videos(cfg.train.prompts_per_rank, k)
    return host_plan(cfg, shape, work, seconds, source, rates, videos=count, cores=cores / ranks_per_node)
