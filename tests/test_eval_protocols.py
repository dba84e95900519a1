"""Evaluation protocols (configs/eval/): the video_r1 preset gives Video-R1's own evaluation prompt, frames, pixels
and scoring on the same record. Video-R1's side is transcribed here from its src/eval_bench.py and the qwen-vl-utils
copy it ships (FPS 2, FPS_MIN_FRAMES 4, FPS_MAX_FRAMES 16, VIDEO_MIN_PIXELS = VIDEO_MAX_PIXELS = 128*28*28), not
imported: the comparison is with an independent reading of that code."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from app.config import ConfigError, load_config
from app.evaluate import protocol_file

# ---- Video-R1's evaluation, transcribed ------------------------------------------------------------------------
VR1_QUESTION = (
    "{Question}\n"
    "Please think about this question as if you were a human pondering deeply. "
    "Engage in an internal dialogue using expressions such as 'let me think', 'wait', 'Hmm', 'oh, I see', "
    "'let's break it down', etc, or other natural language thought expressions "
    "It's encouraged to include self-reflection or verification in the reasoning process. "
    "Provide your detailed reasoning between the <think> and </think> tags, and then give your final answer between "
    "the <answer> and </answer> tags."
)
VR1_TYPE = {"multiple choice": " Please provide only the single option letter (e.g., A, B, C, D, etc.) within the "
                               "<answer> </answer> tags.",
            "numerical": " Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags."}
FACTOR, FPS, MIN_FRAMES, MAX_FRAMES = 2, 2.0, 4, 16
VIDEO_MIN_PIXELS = VIDEO_MAX_PIXELS = 128 * 28 * 28
VIDEO_TOTAL_PIXELS = int(128000 * 28 * 28 * 0.9)


def vr1_text(record: dict) -> str:
    if record["problem_type"] == "multiple choice":
        question = record["problem"] + "Options:\n"
        for option in record["options"]:
            question += option + "\n"
    else:
        question = record["problem"]
    return VR1_QUESTION.format(Question=question) + VR1_TYPE[record["problem_type"]]


def vr1_frames(total: int, video_fps: float, height: int, width: int) -> tuple[list[int], tuple[int, int]]:
    """Its smart_nframes (no max_frames in the element: min(FPS_MAX_FRAMES, total)), linspace indices, and the frame
    size from its fetch_video's pixel budget and smart_resize (factor 28)."""
    def floor_by(x, f):
        return math.floor(x / f) * f

    def ceil_by(x, f):
        return math.ceil(x / f) * f

    min_frames = ceil_by(MIN_FRAMES, FACTOR)
    max_frames = floor_by(min(MAX_FRAMES, total), FACTOR)
    n = total / video_fps * FPS
    n = floor_by(min(min(max(n, min_frames), max_frames), total), FACTOR)
    indices = torch.linspace(0, total - 1, n).round().long().tolist()
    max_pixels = max(min(VIDEO_MAX_PIXELS, VIDEO_TOTAL_PIXELS / n * FACTOR), int(VIDEO_MIN_PIXELS * 1.05))
    h, w = max(28, round(height / 28) * 28), max(28, round(width / 28) * 28)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = floor_by(height / beta, 28), floor_by(width / beta, 28)
    elif h * w < VIDEO_MIN_PIXELS:
        beta = math.sqrt(VIDEO_MIN_PIXELS / (height * width))
        h, w = ceil_by(height * beta, 28), ceil_by(width * beta, 28)
    return indices, (h, w)


# ---- ours ------------------------------------------------------------------------------------------------------
def preset(name: str = "video_r1"):
    return load_config(protocol_file(name), ["model.path=m"], training=False)


@pytest.mark.parametrize(("frames", "fps", "height", "width"), [(37, 8, 120, 160), (90, 30, 96, 128),
                                                                  (20, 4, 160, 120), (13, 2, 64, 96)])
def test_the_video_r1_preset_samples_video_r1s_frames_at_its_pixels(tmp_path, frames, fps, height, width):
    from app.data.records import build_conversation
    from app.data.video import decode_video, write_mp4

    rng = np.random.default_rng(frames)
    write_mp4(tmp_path / "clip.mp4", rng.integers(0, 255, (frames, height, width, 3), dtype=np.uint8), fps=fps)
    record = {"problem": "What moves?", "problem_type": "numerical", "data_type": "video", "path": "clip.mp4",
              "solution": "<answer>2</answer>"}
    cfg = preset()
    conversation = build_conversation(record, tmp_path, cfg.data)
    element = next(item for item in conversation[-1]["content"] if item.get("type") == "video")
    decoded, metadata = decode_video(element)
    indices, size = vr1_frames(frames, fps, height, width)
    assert list(metadata["frames_indices"]) == indices
    assert tuple(decoded.shape[-2:]) == size and decoded.shape[0] == len(indices)


def test_the_video_r1_preset_writes_video_r1s_prompt_and_scores_as_it_does(tmp_path):
    from app.data.prompts import question_text
    from app.data.records import build_conversation
    from app.rewards import video_r1_eval_accuracy

    record = {"problem": "Which colour appears first?", "problem_type": "multiple choice", "data_type": "video",
              "options": ["A. red", "B. green", "C. blue", "D. yellow"], "path": "v.mp4",
              "solution": "<answer>B</answer>"}
    cfg = preset()
    assert question_text(record, cfg.data.prompt_template) == vr1_text(record)
    conversation = build_conversation(record, tmp_path, cfg.data)
    assert [m["role"] for m in conversation] == ["user"]  # no system message: Qwen's default applies, as there
    content = conversation[0]["content"]
    assert [item["type"] for item in content] == ["video", "text"] and content[1]["text"] == vr1_text(record)
    assert (cfg.eval.temperature, cfg.eval.top_p, cfg.eval.max_new_tokens) == (0.1, 0.001, 1024)
    # its reward_fn: the first <answer>, else the whole output; exact match; decimal consistency for numbers
    assert video_r1_eval_accuracy("<think>x</think><answer>B</answer><answer>C</answer>", record) == 1.0
    assert video_r1_eval_accuracy("<answer>B.</answer>", record) == 0.0  # exact string match, unlike ours
    assert video_r1_eval_accuracy("B", record) == 1.0  # no tag: the whole output
    numeric = {"problem_type": "numerical", "solution": "<answer>3</answer>"}
    assert video_r1_eval_accuracy("<answer>3.0</answer>", numeric) == 0.0
    assert video_r1_eval_accuracy("<answer>3</answer>", numeric) == 1.0
    assert video_r1_eval_accuracy("<answer>x</answer>", {"problem_type": "OCR", "solution": "<answer>x</answer>"}) \
        == 0.0  # scored 0 there


def test_an_evaluation_records_the_settings_that_reproduce_it(tmp_path):
    """scripts/eval.sh ... --protocol video_r1 writes OUTPUT/eval_config.yaml; that file, given back as the
    protocol, rebuilds the same settings (and so the same run identity)."""
    from app.data.synthetic import generate
    from app.evaluate import evaluate
    from app.models import build_tiny_checkpoint

    checkpoint = build_tiny_checkpoint(tmp_path / "tiny", "qwen2_5_vl", seed=0)
    heldout = generate(tmp_path / "data", train=1, heldout=2, seed=3)["heldout"]
    out = tmp_path / "eval"
    first = evaluate(checkpoint, [heldout], [f"eval.output_dir={out}", "eval.max_new_tokens=4"], protocol="video_r1")
    assert first["scored_this_run"] == 2
    written = out / "eval_config.yaml"
    assert "--protocol" in written.read_text() and "answer_extraction: video_r1" in written.read_text()
    again = load_config(written, [f"model.path={checkpoint}"], training=False)
    want = load_config(protocol_file("video_r1"), [f"model.path={checkpoint}", f"eval.output_dir={out}",
                                                   "eval.max_new_tokens=4"], training=False)
    assert again.data == want.data and again.eval == want.eval
    resumed = evaluate(checkpoint, [heldout], [], protocol=str(written))
    assert resumed["resumed_from_file"] == 2 and resumed["scored_this_run"] == 0


def test_an_unknown_protocol_is_named_with_the_presets():
    with pytest.raises(ConfigError, match=r"unknown evaluation protocol 'video_r2'.*video_r1"):
        protocol_file("video_r2")


# ---- TimeZero's temporal-grounding evaluation (www-Ye/TimeZero evaluate.py), transcribed ---------------------------
TZ_TEMPLATE = """To accurately pinpoint the event "[EVENT]" in the video, determine the precise time period of the event.

Output your thought process within the <think> </think> tags, including analysis with either specific timestamps (xx.xx) or time ranges (xx.xx to xx.xx) in <timestep> </timestep> tags.

Then, provide the start and end times (in seconds, precise to two decimal places) in the format "start time to end time" within the <answer> </answer> tags. For example: "12.54 to 17.83"."""


def tz_parse(output: str):
    import re

    matches = re.findall(r"(\d+\.?\d*) (to|and) (\d+\.?\d*)", output)
    if not matches:
        answer = re.search(r"<answer>(.*?)</answer>", output)
        if answer:
            inner = re.findall(r"(\d+\.?\d*) (to|and) (\d+\.?\d*)", answer.group(1).strip())
            if inner:
                return float(inner[-1][0]), float(inner[-1][2])
        return None, None
    return float(matches[-1][0]), float(matches[-1][2])


def tz_iou(output: str, span) -> float:
    sp, ep = tz_parse(output)
    if sp is None:
        return 0.0
    s, e = span
    return max((min(e, ep) - max(s, sp)) / (max(e, ep) - min(s, sp)), 0)


@pytest.mark.parametrize("output", [
    "<think>it starts around 3.5 to 7.2 <timestep>4.00</timestep></think><answer>12.54 to 17.83</answer>",
    "<answer>24.3 and 30.4</answer>", "the person turns the light on from 20.0 to 31.0 seconds",
    "<answer>[24.3, 30.4]</answer>", "<answer>30.4 to 24.3</answer>", "no answer", "<answer>0 to 5</answer> 26 to 29",
])
def test_the_timezero_preset_scores_as_timezero_does(output):
    from app.rewards import timezero_accuracy

    record = {"problem_type": "temporal grounding", "solution": "<answer>[24.3, 30.4]</answer>", "duration": 30.96}
    assert timezero_accuracy(output, record) == pytest.approx(tz_iou(output, (24.3, 30.4)), abs=1e-12)


def test_the_timezero_preset_writes_its_prompt_text_first_with_its_pixel_budget(tmp_path):
    from qwen_vl_utils import fetch_video

    from app.data.records import build_conversation
    from app.data.video import decode_video, write_mp4

    rng = np.random.default_rng(0)
    write_mp4(tmp_path / "3MSZA.mp4", rng.integers(0, 255, (62, 180, 240, 3), dtype=np.uint8), fps=2)
    record = {"problem": "person turn a light on.", "problem_type": "temporal grounding", "data_type": "video",
              "path": "3MSZA.mp4", "solution": "<answer>[24.3, 30.4]</answer>", "duration": 30.96}
    cfg = preset("timezero_charades_sta")
    conversation = build_conversation(record, tmp_path, cfg.data)
    assert [m["role"] for m in conversation] == ["user"]
    text, video = conversation[0]["content"]
    assert text == {"type": "text", "text": TZ_TEMPLATE.replace("[EVENT]", record["problem"])}
    assert video["total_pixels"] == 3584 * 28 * 28 and video["min_pixels"] == 16 * 28 * 28
    assert "max_pixels" not in video
    ours, _ = decode_video(video)
    theirs = fetch_video({"video": str(tmp_path / "3MSZA.mp4"), "total_pixels": 3584 * 28 * 28,
                          "min_pixels": 16 * 28 * 28})  # the element TimeZero's inference() builds
    assert ours.shape == theirs.shape
    assert (cfg.eval.temperature, cfg.eval.max_new_tokens, cfg.eval.answer_extraction) == (0.0, 2048, "timezero")
    assert cfg.eval.repetition_penalty == 1.05  # HF generate takes it from Qwen2.5-VL-Instruct's generation_config


def test_the_activitynet_preset_is_timezeros_charades_protocol_on_other_files(tmp_path):
    """TimeZero's evaluate.py --dataset activitynet changes only files; the preset extends the Charades one, and
    ActivityNet's sentences reach the prompt verbatim (leading space included, as TimeZero inserts them)."""
    import json

    from app.config import ConfigError, load_config
    from app.data.convert import FORMATS
    from app.data.records import build_conversation

    assert preset("timezero_activitynet").to_dict() == preset("timezero_charades_sta").to_dict()
    (tmp_path / "videos").mkdir()
    (tmp_path / "videos" / "v_uqiMw7tQ1Cc.mp4").write_bytes(b"")
    annotation = tmp_path / "test.json"
    annotation.write_text(json.dumps({"v_uqiMw7tQ1Cc": {
        "duration": 55.15, "timestamps": [[0, 4.14], [4.14, 33.36]],
        "sentences": ["Two men are standing in a gym.", " One man is holding onto a rope."]}}))
    records, _ = FORMATS["activitynet_captions"](annotation, tmp_path / "videos")
    assert records[1]["problem"] == " One man is holding onto a rope." and records[1]["data_source"] == \
        "activitynet_captions"
    text = build_conversation(records[1], tmp_path / "videos", preset("timezero_activitynet").data)[0]["content"][0]
    assert text["text"] == TZ_TEMPLATE.replace("[EVENT]", " One man is holding onto a rope.")
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="'extends' makes a circle"):
        load_config(tmp_path / "a.yaml", ["model.path=m"], training=False)
    (tmp_path / "b.yaml").write_text("extends: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"config file not found: .*missing.yaml \(extended by .*b.yaml\)"):
        load_config(tmp_path / "b.yaml", ["model.path=m"], training=False)


def test_charades_sta_annotations_convert_to_records(tmp_path):
    import json

    from app.data.convert import FORMATS, ConvertError, main
    from app.grounding import check_grounding_record

    (tmp_path / "videos").mkdir()
    (tmp_path / "videos" / "3MSZA.mp4").write_bytes(b"")
    annotation = tmp_path / "charades_test.json"
    annotation.write_text(json.dumps({
        "3MSZA": {"duration": 30.96, "timestamps": [[24.3, 30.4], [24.3, 30.4]],
                  "sentences": ["person turn a light on.", "person flipped the light switch near the door."]},
        "AMT7R": {"duration": 30.08, "timestamps": [[4.3, 12.5]], "sentences": ["a person is putting a picture."]}}))
    charades_sta = FORMATS["charades_sta"]
    records, missing = charades_sta(annotation, tmp_path / "videos")
    assert missing == ["AMT7R"] and [r["problem_id"] for r in records] == ["3MSZA_0", "3MSZA_1"]
    assert records[0]["solution"] == "<answer>[24.3, 30.4]</answer>" and records[0]["duration"] == 30.96
    assert all(check_grounding_record(r) is None for r in records)
    main(["charades_sta", str(annotation), "--videos", str(tmp_path / "videos"), "--out", str(tmp_path / "r.jsonl")])
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 2
    annotation.write_text(json.dumps({"3MSZA": {"duration": 30.96, "timestamps": [[1, 2]], "sentences": []}}))
    with pytest.raises(ConvertError, match="video '3MSZA' has 1 timestamps but 0 sentences"):
        charades_sta(annotation, tmp_path / "videos")
