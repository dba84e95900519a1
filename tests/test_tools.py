"""Tools in rollouts (app.rollout.tools): Qwen's <tool_call> protocol, the built-in video tools decoding the record's own
video, custom tools from path.py:function, and every bad call turned into a counted error observation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.data.prompts import encode_observation, observation_text
from app.rollout.tools import (
    ToolContext,
    ToolError,
    ToolLimits,
    ToolSetupError,
    ToolStats,
    build_tools,
    parse_call,
    run_call,
)


def call(name, **arguments):
    return f'<think>I need a closer look.</think><tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    from app.data.video import write_mp4

    root = tmp_path_factory.mktemp("tools")
    frames = np.random.default_rng(0).integers(0, 255, (40, 64, 96, 3), dtype=np.uint8)  # 10 s at 4 fps
    path = write_mp4(root / "long.mp4", frames, fps=4)
    return ToolContext({"problem": "What digit?"}, path, 10.0, ToolLimits(max_frames=4, min_pixels=3136,
                                                                         max_pixels=6272, zoom_max_pixels=12544))


def test_the_protocol_is_qwens_tool_call():
    assert parse_call("no call here") is None
    assert parse_call('<tool_call>{"name": "zoom", "arguments": {"frame_time": 1}}</tool_call>').arguments == \
        {"frame_time": 1}
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>{"name": "b"}</tool_call>'
    assert parse_call(two).name == "b"  # the call that ends the turn
    assert parse_call('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>').arguments == {"x": 1}
    for bad in ("<tool_call>zoom(1)</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                '<tool_call>{"name": "a", "arguments": [1]}</tool_call>'):
        with pytest.raises(ToolError) as error:
            parse_call(bad)
        assert error.value.kind == "malformed"


def test_get_frames_decodes_the_window_within_the_budget(context):
    tools = build_tools(["get_frames", "zoom"])
    result = run_call(call("get_frames", start=2.0, end=6.0, fps=4), tools, context)
    assert result.error is None
    text, video = result.content
    assert "2.0 s to 6.0 s" in text["text"] and video["type"] == "video"
    assert (video["video_start"], video["video_end"], video["nframes"]) == (2.0, 6.0, 4)  # capped at max_frames
    from app.data.video import decode_video

    frames, meta = decode_video(video)
    assert frames.shape[0] == 4 and frames.shape[2] * frames.shape[3] <= 6272


def test_zoom_crops_one_frame(context):
    tools = build_tools(["zoom"])
    result = run_call(call("zoom", frame_time=3.0, box=[0.5, 0.0, 1.0, 0.5]), tools, context)
    assert result.error is None
    image = result.content[1]["image"]
    assert image.size == (48, 32)  # the right half, top half of a 96 x 64 frame


@pytest.mark.parametrize(("text", "kind", "says"), [
    (call("get_frames", start=8.0, end=12.0), "out_of_range", "not inside the video"),
    (call("get_frames", start=5.0, end=5.0), "out_of_range", "start before end"),
    (call("get_frames", start=1.0), "bad_arguments", "missing a required argument: 'end'"),
    (call("get_frames", start="one", end=2.0), "bad_arguments", "must be a number"),
    (call("get_frames", start=1.0, end=2.0, speed=3), "bad_arguments", "unexpected keyword argument 'speed'"),
    (call("zoom", frame_time=11.0, box=[0, 0, 1, 1]), "out_of_range", "frame_time 11"),
    (call("zoom", frame_time=1.0, box=[0.5, 0.5, 0.2, 1]), "out_of_range", "not inside the frame"),
    (call("zoom", frame_time=1.0, box="top left"), "bad_arguments", "box must be"),
    (call("crop", x=1), "unknown_tool", "there is no tool 'crop'"),
    ("<tool_call>{'name': 'zoom'}</tool_call>", "malformed", "not JSON"),
])
def test_bad_calls_become_error_observations(text, kind, says, context):
    stats = ToolStats()
    result = run_call(text, build_tools(["get_frames", "zoom"]), context)
    stats.add(result)
    assert result.error == kind and says in result.content[0]["text"]
    assert result.content[0]["text"].startswith("Tool error:")
    metrics = stats.metrics()
    assert metrics["tools/calls"] == 1 and metrics[f"tools/{kind}"] == 1 and metrics["tools/valid"] == 0


def test_custom_tools_load_by_path_and_a_raising_tool_is_survived(tmp_path, context):
    plugin = tmp_path / "my_tools.py"
    plugin.write_text("def count_frames(context, every=1):\n    return f'{int(context.duration * 4 // every)} frames'\n"
                      "def broken(context):\n    raise RuntimeError('disk on fire')\n")
    tools = build_tools([f"{plugin}:count_frames", f"{plugin}:broken", "zoom"])
    assert set(tools) == {"count_frames", "broken", "zoom"}
    assert run_call(call("count_frames", every=2), tools, context).content == [{"type": "text", "text": "20 frames"}]
    broken = run_call(call("broken"), tools, context)
    assert broken.error == "tool_error" and "RuntimeError: disk on fire" in broken.content[0]["text"]
    no_video = run_call(call("zoom", frame_time=1, box=[0, 0, 1, 1]), tools, ToolContext({}, None, None))
    assert no_video.error == "tool_error" and "no video" in no_video.content[0]["text"]
    for bad, says in (("crop", "a built-in"), (f"{tmp_path}/none.py:f", "not found"),
                      (f"{plugin}:missing", "has no function 'missing'"), ("zoom", "twice")):
        with pytest.raises(ToolSetupError, match=says):
            build_tools(["zoom", bad] if bad == "zoom" else [bad])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_observations_encode_as_a_user_turn_with_media(family, tiny_checkpoints, context):
    """A tool's result becomes tokens as Qwen's template writes a user turn: the same ids the chat template and the
    processor give that turn, the placeholders expanded, the pixels alongside."""
    from app.runtime.models import load_processor

    processor = load_processor(tiny_checkpoints[family])
    tools = build_tools(["get_frames", "zoom"])
    for text in (call("get_frames", start=0.0, end=4.0), call("zoom", frame_time=2.0, box=[0, 0, 0.5, 0.5])):
        content = run_call(text, tools, context).content
        observation = encode_observation(processor, content)
        kind = "video" if content[1]["type"] == "video" else "image"
        pad = processor.tokenizer.convert_tokens_to_ids(f"<|{kind}_pad|>")
        assert int((observation["input_ids"] == pad).sum()) > 1
        assert f"pixel_values{'_videos' if kind == 'video' else ''}" in observation
        rendered = processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "x"}]},
                                                  {"role": "assistant", "content": [{"type": "text", "text": "y"}]},
                                                  {"role": "user", "content": content}], add_generation_prompt=True,
                                                 tokenize=False)
        assert rendered.endswith("y<|im_end|>\n" + observation_text(content).removeprefix("<|im_end|>\n"))
