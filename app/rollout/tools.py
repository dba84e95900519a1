"""Tools a model may call inside a rollout: the call protocol, the built-in video tools, custom tools, and the rule
that a bad call becomes a short error observation, never a crash.

Protocol (Qwen's own, as its chat templates write function calls): the model writes
``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>``; the engine stops the sample at ``</tool_call>``
(``STOP``), runs the tool, and appends its result as the next turn (text, images or a video clip: a list of
conversation content items, encoded by ``app.data.prompts.encode_observation``), then lets the model continue.

Built-in tools (``rollout.tools: [get_frames, zoom]``), both reading the record's own video:
- ``get_frames(start, end, fps=2)``: the window [start, end] seconds, decoded with decord through qwen-vl-utils at
  ``fps`` (at most ``tools.max_frames`` frames, ``tools.max_pixels`` per frame);
- ``zoom(frame_time, box)``: the frame at ``frame_time`` seconds, cropped to ``box`` = [x1, y1, x2, y2] in 0-1
  coordinates of the frame, at up to ``tools.zoom_max_pixels``.
Custom tools: ``rollout.tools: [path/to/file.py:function]``, called as ``function(context, **arguments)`` and
returning a string or a list of content items; the function's name is the tool's name.

Every failure is an observation the model reads (``ToolResult.error`` names its kind, counted in the metrics as
``tools/<kind>``): ``malformed`` (no JSON object, no name, arguments not an object), ``unknown_tool``,
``bad_arguments`` (missing, extra or mistyped), ``out_of_range`` (a window or frame outside the video, a box outside
the frame) and ``tool_error`` (anything the tool raised).
"""

from __future__ import annotations

import inspect
import json
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from app.common.plugins import load_function

START, STOP = "<tool_call>", "</tool_call>"
# A tool's result is a user turn wrapping <tool_response>, as Qwen's templates render a "tool" message.
RESPONSE_OPEN = "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
RESPONSE_CLOSE = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "out_of_range", "tool_error")
_CALL = re.compile(re.escape(START) + r"(.*?)" + re.escape(STOP), re.S)


class ToolError(Exception):
    """A call the tool refuses; ``kind`` is one of ERROR_KINDS, the message is what the model is shown."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class ToolSetupError(ValueError):
    """A tool list that cannot be built (unknown built-in, a plugin that does not load): names the entry."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolLimits:
    """What the built-in tools may decode (config ``tools.*``)."""

    max_frames: int = 8
    min_pixels: int = 3136
    max_pixels: int = 50176
    zoom_max_pixels: int = 200704


@dataclass
class ToolContext:
    """What a tool may read: the record, its video's path and duration, the limits."""

    record: Mapping
    video: Path | None
    duration: float | None
    limits: ToolLimits = field(default_factory=ToolLimits)


def context_for(record: Mapping, root: Path, limits: ToolLimits) -> ToolContext:
    """A record's tool context: its video (``root`` / path) and that video's duration (the record's
    ``duration``, else the file's frame count over its frame rate); no video for image and text records."""
    if record.get("data_type") != "video" or not record.get("path"):
        return ToolContext(record, None, None, limits)
    video = Path(record["path"]) if Path(record["path"]).is_absolute() else Path(root) / record["path"]
    duration = record.get("duration")
    if duration is None and video.is_file():
        import decord

        reader = decord.VideoReader(str(video), num_threads=1)
        duration = len(reader) / float(reader.get_avg_fps())
    return ToolContext(record, video, None if duration is None else float(duration), limits)


@dataclass
class ToolResult:
    content: list[dict]  # conversation content items: {"type": "text", ...}, image or video elements
    error: str | None = None  # one of ERROR_KINDS, or None for a valid call


def parse_call(text: str) -> ToolCall | None:
    """The last complete ``<tool_call>...</tool_call>`` in ``text``; None when there is none. A call that is not
    ``{"name": str, "arguments": {...}}`` raises ToolError("malformed")."""
    found = _CALL.findall(text)
    if not found:
        return None
    body = found[-1].strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        raise ToolError("malformed", f"the tool call is not JSON ({error.msg} at character {error.pos})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolError("malformed", 'a tool call is {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ToolError("malformed", "the tool call's arguments are not a JSON object") from None
    if not isinstance(arguments, dict):
        raise ToolError("malformed", "the tool call's arguments are not a JSON object")
    return ToolCall(call["name"], arguments)


def _number(arguments: dict, name: str, default=None) -> float:
    value = arguments.get(name, default)
    if value is None:
        raise ToolError("bad_arguments", f"missing argument {name!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ToolError("bad_arguments", f"argument {name!r} must be a number, got {value!r}")
    return float(value)


def _video_of(context: ToolContext) -> tuple[Path, float]:
    if context.video is None or context.duration is None:
        raise ToolError("tool_error", "this question has no video to look at")
    return context.video, context.duration


def get_frames(context: ToolContext, start, end, fps=2.0) -> list[dict]:
    """Frames of the record's video from ``start`` to ``end`` seconds at ``fps``."""
    video, duration = _video_of(context)
    arguments = {"start": start, "end": end, "fps": fps}
    start, end, fps = (_number(arguments, k) for k in ("start", "end", "fps"))
    if not 0 <= start < end <= duration + 1e-6:
        raise ToolError("out_of_range", f"the window [{start:g}, {end:g}] s is not inside the video (0 to "
                                        f"{duration:.2f} s, start before end)")
    if fps <= 0:
        raise ToolError("bad_arguments", f"fps must be > 0, got {fps:g}")
    limits = context.limits
    frames = max(2, min(limits.max_frames, round((end - start) * fps)))
    frames += frames % 2  # qwen-vl-utils samples an even count
    element = {"type": "video", "video": str(video), "video_start": start, "video_end": end, "nframes": frames,
               "min_pixels": limits.min_pixels, "max_pixels": limits.max_pixels}
    return [{"type": "text", "text": f"Frames from {start:.1f} s to {end:.1f} s:"}, element]


def zoom(context: ToolContext, frame_time, box) -> list[dict]:
    """The frame at ``frame_time`` seconds, cropped to ``box`` ([x1, y1, x2, y2] in 0-1 of the frame)."""
    import decord
    from PIL import Image

    video, duration = _video_of(context)
    time = _number({"frame_time": frame_time}, "frame_time")
    if not 0 <= time <= duration:
        raise ToolError("out_of_range", f"frame_time {time:g} s is not inside the video (0 to {duration:.2f} s)")
    if not (isinstance(box, (list, tuple)) and len(box) == 4
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box)):
        raise ToolError("bad_arguments", f"box must be [x1, y1, x2, y2] (numbers in 0-1), got {box!r}")
    x1, y1, x2, y2 = (float(v) for v in box)
    if not (0 <= x1 < x2 <= 1 and 0 <= y1 < y2 <= 1):
        raise ToolError("out_of_range", f"box {list(box)} is not inside the frame (0-1, x1 < x2, y1 < y2)")
    reader = decord.VideoReader(str(video), num_threads=1)
    index = min(len(reader) - 1, int(round(time * float(reader.get_avg_fps()))))
    frame = Image.fromarray(reader[index].asnumpy())
    width, height = frame.size
    crop = frame.crop((int(x1 * width), int(y1 * height), max(int(x1 * width) + 1, int(round(x2 * width))),
                       max(int(y1 * height) + 1, int(round(y2 * height)))))
    limits = context.limits
    return [{"type": "text", "text": f"The frame at {time:.1f} s, zoomed:"},
            {"type": "image", "image": crop, "min_pixels": limits.min_pixels, "max_pixels": limits.zoom_max_pixels}]


BUILTIN = {"get_frames": get_frames, "zoom": zoom}


def load_tool(spec: str) -> Callable:
    """``path/to/file.py:function`` -> the function (its name is the tool's name)."""
    return load_function(spec, "rollout.tools entry", ToolSetupError,
                         f"a built-in ({', '.join(BUILTIN)}) or path/to/file.py:function")


def build_tools(names: Sequence[str]) -> dict[str, Callable]:
    """The configured tools by name: built-ins and ``path.py:function`` plugins."""
    tools = {}
    for entry in names:
        fn = BUILTIN.get(entry) or load_tool(entry)
        name = entry if entry in BUILTIN else entry.rpartition(":")[2]
        if name in tools:
            raise ToolSetupError(f"rollout.tools lists the tool {name!r} twice")
        tools[name] = fn
    return tools


def run_call(text: str, tools: Mapping[str, Callable], context: ToolContext) -> ToolResult | None:
    """Run the tool call that ends ``text`` (None when it has none). Never raises for what the model wrote or the
    tool did: every failure is an error observation."""
    try:
        call = parse_call(text)
        if call is None:
            return None
        fn = tools.get(call.name)
        if fn is None:
            raise ToolError("unknown_tool", f"there is no tool {call.name!r}; the tools are {', '.join(tools)}")
        try:
            inspect.signature(fn).bind(context, **call.arguments)
        except TypeError as error:
            raise ToolError("bad_arguments", f"{call.name}: {error}") from None
        content = fn(context, **call.arguments)
    except ToolError as error:
        return ToolResult([{"type": "text", "text": f"Tool error: {error}"}], error.kind)
    except Exception as error:  # a tool that fails: the run goes on, the model reads why
        return ToolResult([{"type": "text", "text": f"Tool error: {type(error).__name__}: {error}"}],
                          "tool_error")
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    return ToolResult(list(content))


@dataclass
class ToolStats:
    """Counts for the metrics: calls, valid calls, and each error kind."""

    counts: Counter = field(default_factory=Counter)

    def add(self, result: ToolResult) -> None:
        self.counts["calls"] += 1
        self.counts[result.error or "valid"] += 1

    def metrics(self) -> dict[str, float]:
        return {f"tools/{k}": float(self.counts.get(k, 0)) for k in ("calls", "valid", *ERROR_KINDS)}
