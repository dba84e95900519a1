"""The tool-needing demo's pieces (app.demos.tools, the synthetic ``glimpse`` task): the answer is in the video only
on frames of its window the overview does not take, the overview shows the cue and never the colour, a get_frames
call on the window shows it, and the warm start's targets are well-formed calls on random windows that run, then
answers that are what the returned frames show."""

from __future__ import annotations

import json

import numpy as np
import pytest
from qwen_vl_utils import fetch_video

from app.config.loading import load_config
from app.data.synthetic import COLOURS, GLIMPSE_OVERVIEW_FRAMES, generate, overview_indices
from app.demos.tools import CONFIG, call_text, calls_showing_answer, frames_show_colour, warm_start_data
from app.rollout.tools import ToolLimits, build_tools, context_for, parse_call, run_call


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
        hidden = overview_indices(len(clip), GLIMPSE_OVERVIEW_FRAMES)
        inside = [start * 4 <= t < end * 4 and t not in hidden for t in range(len(clip))]
        assert shown == inside and any(shown) and record["duration"] == 8.0  # the answer: inside the window only
        overview = _frames({"type": "video", "video": str(path), "fps": cfg.data.fps, "max_frames": cfg.data.max_frames,
                            "min_pixels": cfg.data.min_pixels, "max_pixels": cfg.data.max_pixels})
        window = _frames({"type": "video", "video": str(path), "video_start": start, "video_end": end, "fps": 4.0,
                          "max_frames": cfg.rollout.tool_max_frames, "min_pixels": cfg.data.min_pixels,
                          "max_pixels": cfg.rollout.tool_max_pixels})
        assert len(overview) == GLIMPSE_OVERVIEW_FRAMES == cfg.data.max_frames
        assert overview[:, :, :2].mean(dim=(1, 2, 3)).max() > 200  # the white bar shows in the overview
        assert _saturation(overview) < 40 < 150 < _saturation(window)  # the colour: never there, clear here


def test_the_warm_start_calls_a_random_window_then_answers_what_its_frames_show(glimpse, tmp_path):
    out, records = glimpse
    limits = ToolLimits(max_frames=4, min_pixels=784, max_pixels=3136)
    targets = [json.loads(line) for line in warm_start_data(out / "train.jsonl", tmp_path / "sft.jsonl", 0, out,
                                                            limits).read_text().splitlines()]
    tools = build_tools(["get_frames"])
    seen = []
    for record, target in zip(records, targets):
        assert {k: v for k, v in target.items() if k not in ("turns", "window_shows_answer")} == record
        first, second = target["turns"]
        call = parse_call(first)
        assert call.name == "get_frames" and call.arguments["end"] - call.arguments["start"] == 2
        result = run_call(first, tools, context_for(record, out, limits))
        assert result.error is None and [item["type"] for item in result.content] == ["text", "video"]
        assert parse_call(second) is None and second.endswith("</answer>")
        if target["window_shows_answer"]:
            assert second.endswith(record["solution"])  # it reads what the frames show
        seen.append(target["window_shows_answer"])
        start, end = record["glimpse"]
        exact = {"name": "get_frames", "arguments": {"start": start, "end": end}}
        own = run_call(f"<tool_call>{json.dumps(exact)}</tool_call>", tools, context_for(record, out, limits))
        assert frames_show_colour(own.content[-1])  # the record's own window shows the colour
        away = (0.0, 1.0) if start >= 2 else (7.0, 8.0)
        miss = run_call(call_text(*away), tools, context_for(record, out, limits))
        assert not frames_show_colour(miss.content[-1])
    assert any(seen) and not all(seen)  # random windows: some catch the colour, some miss it


def test_the_demo_counts_the_calls_whose_frames_show_the_answer(glimpse, tmp_path):
    """calls_showing_answer reads each call's window back from the evaluation's predictions (the tool's own
    observation text) and decodes it again: the record's own window shows the answer, a window away from it does
    not, and a call that failed is not counted."""
    from app.rollout.multiturn import call_summary
    from app.rollout.tools import ToolResult, get_frames

    out, records = glimpse
    limits = ToolLimits(max_frames=4, min_pixels=784, max_pixels=3136)
    heldout = out / "train.jsonl"  # any file of the records the predictions name
    rows = []
    for record in records:
        start, end = record["glimpse"]
        away = (0.0, 1.0) if start >= 2 else (7.0, 8.0)
        samples = [[call_summary(ToolResult(get_frames(context_for(record, out, limits), *window)))]
                   for window in ((start, end), away)]
        samples.append([call_summary(ToolResult([{"type": "text", "text": "error: out_of_range"}], "out_of_range"))])
        rows.append({"problem_id": record["problem_id"], "tool_results": samples})
    (tmp_path / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert calls_showing_answer(tmp_path, heldout, out, limits) == 0.5  # own windows all, away windows none
    assert calls_showing_answer(tmp_path / "missing", heldout, out, limits) is None


@pytest.mark.slow
def test_the_demo_runs_end_to_end_and_writes_its_comparison(tmp_path, monkeypatch):
    """A small run of the whole demo (warm start, evaluations, GRPO with tools through scripts/train.sh)."""
    from app.demos import tools as demo_tools

    monkeypatch.chdir(demo_tools.ROOT)
    result = demo_tools.main(["--out", str(tmp_path / "out"), "--data", str(tmp_path / "data"), "--train-size", "16",
                              "--heldout-size", "6", "--warm-steps", "3", "train.max_steps=2", "train.save_every=0"])
    assert list(result["accuracy"]) == ["untrained, no tools", "warm start, no tools", "warm start, with tools",
                                        "after GRPO, with tools"]
    assert result["heldout_questions"] == 6 and result["tool_calls"]["after GRPO, with tools"] is not None
    assert (tmp_path / "out" / "demo_summary.md").is_file() and (tmp_path / "out" / "heldout_accuracy.png").is_file()
