"""The tool-needing demo's pieces (app.demo_tools, the synthetic ``glimpse`` task): the answer is in the video only
inside its window, the overview shows the cue but only a faded square, a get_frames call on the window shows it
whole, and the warm start's targets are well-formed calls that run (or answers), independent of the video."""

from __future__ import annotations

import json

import numpy as np
import pytest
from qwen_vl_utils import fetch_video

from app.config import load_config
from app.data.synthetic import COLOURS, generate
from app.demo_tools import CONFIG, call_syntax_sft_data
from app.tools import ToolLimits, build_tools, context_for, parse_call, run_call


@pytest.fixture(scope="module")
def glimpse(tmp_path_factory):
    out = tmp_path_factory.mktemp("glimpse")
    generate(out, train=8, heldout=2, seed=0, tasks=("glimpse",), frames=32, size=112, fps=4, shuffle_options=False)
    return out, [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]


def _frames(element: dict):
    video = fetch_video(element)
    return (video[0] if isinstance(video, tuple) else video).float()  # [T, 3, H, W]


def _saturation(frames) -> float:
    return float((frames.max(1).values - frames.min(1).values).max())


def test_the_overview_shows_the_cue_and_the_window_shows_the_colour(glimpse):
    import decord

    out, records = glimpse
    cfg = load_config(CONFIG, [f"data.train_file={out / 'train.jsonl'}"])
    for record in records:
        path = out / record["path"]
        start, end = record["glimpse"]
        reader = decord.VideoReader(str(path))
        clip = reader.get_batch(list(range(len(reader)))).asnumpy()  # [T, H, W, 3] at full resolution
        letter = record["solution"].removeprefix("<answer>").removesuffix("</answer>")
        colour = np.array(COLOURS[record["options"]["ABCD".index(letter)].split(". ")[1]])
        shown = [bool((np.abs(frame.astype(int) - colour).sum(-1) < 40).any()) for frame in clip]
        inside = [start * 4 <= t < end * 4 for t in range(len(clip))]
        assert shown == inside and record["duration"] == 8.0  # the answer exists only inside the window
        overview = _frames({"type": "video", "video": str(path), "fps": cfg.data.fps, "max_frames": cfg.data.max_frames,
                            "min_pixels": cfg.data.min_pixels, "max_pixels": cfg.data.max_pixels})
        window = _frames({"type": "video", "video": str(path), "video_start": start, "video_end": end, "fps": 4.0,
                          "max_frames": cfg.rollout.tool_max_frames, "min_pixels": cfg.data.min_pixels,
                          "max_pixels": cfg.rollout.tool_max_pixels})
        assert overview[:, :, :2].mean(dim=(1, 2, 3)).max() > 200  # the white bar shows in the overview
        assert _saturation(overview) < 0.7 * _saturation(window)  # the square's colour fades at its pixels


def test_the_warm_start_writes_a_call_that_runs_then_a_random_answer(glimpse, tmp_path):
    out, records = glimpse
    targets = [json.loads(line) for line in
               call_syntax_sft_data(out / "train.jsonl", tmp_path / "sft.jsonl", seed=0).read_text().splitlines()]
    tools = build_tools(["get_frames"])
    letters = set()
    for record, target in zip(records, targets):
        assert {k: v for k, v in target.items() if k != "turns"} == record
        first, second = target["turns"]
        call = parse_call(first)
        assert call.name == "get_frames" and call.arguments["end"] - call.arguments["start"] == 2
        result = run_call(first, tools, context_for(record, out, ToolLimits(max_frames=4)))
        assert result.error is None and [item["type"] for item in result.content] == ["text", "video"]
        assert parse_call(second) is None and second.endswith("</answer>")
        letters.add(second[-10])
    assert len(letters) > 1  # random letters, not the solutions


@pytest.mark.slow
def test_the_demo_runs_end_to_end_and_writes_its_comparison(tmp_path, monkeypatch):
    """A small run of the whole demo (warm start, evaluations, GRPO with tools through scripts/train.sh)."""
    from app import demo_tools

    monkeypatch.chdir(demo_tools.ROOT)
    result = demo_tools.main(["--out", str(tmp_path / "out"), "--data", str(tmp_path / "data"), "--train-size", "16",
                              "--heldout-size", "6", "--warm-steps", "3", "train.max_steps=2", "train.save_every=0"])
    assert list(result["accuracy"]) == ["untrained, no tools", "warm start, no tools", "warm start, with tools",
                                        "after GRPO, with tools"]
    assert result["heldout_questions"] == 6 and result["tool_calls"]["after GRPO, with tools"] is not None
    assert (tmp_path / "out" / "demo_summary.md").is_file() and (tmp_path / "out" / "heldout_accuracy.png").is_file()
