"""Evaluation protocols (configs/eval/): the video_r1 preset gives Video-R1's own evaluation prompt, frames, pixels
and scoring on the same record. Video-R1's side is transcribed here from its src/eval_bench.py and the qwen-vl-utils
copy it ships (FPS 2, FPS_MIN_FRAMES 4, FPS_MAX_FRAMES 16, VIDEO_MIN_PIXELS = VIDEO_MAX_PIXELS = 128*28*28), not
imported: the comparison is with an independent reading of that code."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from app.config.loading import ConfigError, load_config
from app.evaluation.evaluate import protocol_file

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
    from app.rewards.protocols import video_r1_eval_accuracy

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
    from app.evaluation.evaluate import evaluate
    from app.runtime.models import build_tiny_checkpoint

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
    from app.rewards.protocols import timezero_accuracy

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

    from app.config.loading import ConfigError, load_config
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

    from app.answers.grounding import check_grounding_record
    from app.data.convert import FORMATS, ConvertError, main

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


def evaluate_converted(tmp_path, fmt: str, annotation, media, protocol: str, *extra: str) -> tuple[dict, list]:
    """python -m app.data.convert FMT ANNOTATION --videos MEDIA, then scripts/eval.sh on a tiny Qwen2.5-VL with
    --protocol PROTOCOL, in process: (summary.json, the prediction rows)."""
    import json

    from app.data.convert import main
    from app.evaluation.evaluate import evaluate
    from app.runtime.models import build_tiny_checkpoint

    main([fmt, str(annotation), "--videos", str(media), "--out", str(tmp_path / "records.jsonl"), *extra])
    checkpoint = build_tiny_checkpoint(tmp_path / "tiny", "qwen2_5_vl", seed=0)
    out = tmp_path / "eval"
    summary = evaluate(checkpoint, [tmp_path / "records.jsonl"], [f"eval.output_dir={out}", "eval.max_new_tokens=4",
                                                                    f"data.data_root={media}"], protocol=protocol)
    assert "answer_extraction:" in (out / "eval_config.yaml").read_text()
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert summary["scored_this_run"] == len(rows)
    return json.loads((out / "summary.json").read_text()), rows


# ---- VideoChat-R1's evaluations (OpenGVLab/VideoChat-R1 src_eval/), transcribed ---------------------------------
# evaluate_grounding.py's GROUND_TEMPLATE_THINK (eval_prompts.py)
VC_GROUND = """To accurately pinpoint the event "[EVENT]" in the video, determine the precise time period of the event.

Output your thought process within the <think> </think> tags, including analysis with either specific timestamps (xx.xx) or time ranges (xx.xx to xx.xx) in <timestep> </timestep> tags.

Then, provide the start and end times (in seconds, precise to two decimal places) in the format "start time to end time" within the <answer> </answer> tags. For example: "12.54 to 17.83"."""
# evaluate_track.py's TRACK_THINK (eval_prompts.py)
VC_TRACK = """Track the "[OBJECT]" in the video based on its initial coordinates "[START]". The output should be a list containing eight sublists. Each sublist includes four normalized coordinates [x0, y0, x1, y1] representing the bounding box of the object at specific time intervals.

Output your thought process within the <think> </think> tags.

Provide your answer within the <answer> </answer> tags as a list of eight sublists, where each sublist contains the normalized coordinates [x0, y0, x1, y1]. For example: <answer>[[0.1, 0.5, 0.3, 0.55], [0.72, 0.25, 0.84, 0.43], ...]</answer>.
"""


def vc_track_frames(path: str) -> list[str]:
    """evaluate_track.py inference(): the .jpg files, sorted; the first, 5 at int(i * (n - 1) / 6), the last: 7
    paths (qwen-vl-utils then repeats the last to make an even count, 8)."""
    import os

    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".jpg"))
    step = (len(files) - 1) / 6
    return [files[0]] + [files[int(i * step)] for i in range(1, 6)] + [files[-1]]


def vc_frame_size(height: int, width: int) -> tuple[int, int]:
    """qwen-vl-utils 0.0.10 fetch_image() on each frame of a list: smart_resize, factor 28, min_pixels from the
    element (16*28*28), max_pixels its default MAX_PIXELS (16384*28*28); total_pixels is not read for a list."""
    min_pixels, max_pixels = 16 * 28 * 28, 16384 * 28 * 28
    h, w = max(28, round(height / 28) * 28), max(28, round(width / 28) * 28)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / 28) * 28, math.floor(width / beta / 28) * 28
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / 28) * 28, math.ceil(width * beta / 28) * 28
    return h, w


def vc_track_iou(output: str, gt: list) -> float:
    """process_work_items(): the first <answer> (DOTALL), is_valid_list_of_lists, average_overlap of calculate_iou."""
    import ast
    import re

    found = re.search(r"<answer>(.*?)</answer>", output, re.DOTALL)
    if not found:
        return 0.0
    glue = found.group(1)
    try:
        data = ast.literal_eval(glue.replace("\n", ""))
        valid = isinstance(data, list) and len(data) == 8 and all(isinstance(e, list) and len(e) == 4 for e in data)
    except Exception:
        valid = False
    if not valid:
        return 0.0
    ious = []
    for (x0, y0, x1, y1), (a0, b0, a1, b1) in zip(data, gt):
        inter = max(0, min(x1, a1) - max(x0, a0)) * max(0, min(y1, b1) - max(y0, b0))
        union = (x1 - x0) * (y1 - y0) + (a1 - a0) * (b1 - b0) - inter
        ious.append(0.0 if union == 0 else inter / union)
    return float(np.mean(ious))


GOT_ENTRY = {  # the first entry of its Annotations/Got/got_val.json (path shortened)
    "path": "/mnt/GOT-10k/val/GOT-10k_Val_000010", "object": "sloth",
    "gt": [[0.093, 0.0, 0.8, 0.797], [0.095, 0.0, 0.8, 0.79], [0.111, 0.093, 0.751, 0.963],
           [0.078, 0.008, 0.642, 0.875], [0.007, 0.003, 0.601, 0.857], [0.051, 0.003, 0.64, 0.831],
           [0.095, 0.093, 0.756, 0.883], [0.127, 0.0, 0.713, 0.799]]}


def got_folder(root, name: str, frames: int, height: int, width: int):
    """A GOT-10k-like folder: 00000001.jpg ... with frame k filled with grey level 2k + 10 (so a decoded frame says
    which file it came from), and the files GOT-10k keeps beside them."""
    from PIL import Image

    folder = root / name
    folder.mkdir(parents=True)
    for k in range(frames):
        Image.new("RGB", (width, height), (2 * k + 10,) * 3).save(folder / f"{k + 1:08d}.jpg", quality=100)
    (folder / "groundtruth.txt").write_text("0,0,1,1\n")
    (folder / "absence.label").write_text("0\n")
    return folder


@pytest.mark.parametrize(("frames", "height", "width"), [(100, 90, 160), (23, 40, 60), (9, 720, 1280)])
def test_the_got10k_preset_takes_videochat_r1s_tracking_frames_at_their_size(tmp_path, frames, height, width):
    from app.data.convert import FORMATS
    from app.data.records import build_conversation, check_record
    from app.data.video import decode_video, frame_folder_element

    folder = got_folder(tmp_path / "val", "GOT-10k_Val_000010", frames, height, width)
    annotation = tmp_path / "got_val.json"
    annotation.write_text(__import__("json").dumps([GOT_ENTRY]))
    (record,), missing = FORMATS["videochat_r1_got10k"](annotation, tmp_path / "val")
    assert missing == [] and check_record(record, tmp_path / "val") is None
    cfg = preset("videochat_r1_got10k")
    conversation = build_conversation(record, tmp_path / "val", cfg.data)
    assert [m["role"] for m in conversation] == ["user"]
    text, video = conversation[0]["content"]
    assert text["text"] == VC_TRACK.replace("[OBJECT]", "sloth").replace("[START]", str(GOT_ENTRY["gt"][0]))
    picked = vc_track_frames(str(folder))
    assert frame_folder_element(video)["video"] == picked
    decoded, _ = decode_video(video)
    assert tuple(decoded.shape) == (8, 3, *vc_frame_size(height, width))
    assert len(picked) == 7  # 7 frames, the last one twice, for 8 boxes
    greys = [int(Path(p).stem) - 1 for p in picked + picked[-1:]]  # frame k's grey level is 2k + 10
    assert decoded.mean(dim=(1, 2, 3)).tolist() == pytest.approx([2 * k + 10 for k in greys], abs=1.5)
    # the records say which frames their boxes belong to: a config with the default sampling still takes these
    assert record["frame_sampling"] == "videochat_r1_track"
    plain = build_conversation(record, tmp_path / "val", load_config(None, ["model.path=m"], training=False).data)
    assert frame_folder_element(plain[-1]["content"][0])["video"] == picked
    assert (cfg.eval.temperature, cfg.eval.max_new_tokens, cfg.eval.answer_extraction) == \
        (0.0, 2048, "videochat_r1_track")


GT = GOT_ENTRY["gt"]


@pytest.mark.parametrize("output", [
    f"<think>it walks left</think><answer>{GT}</answer>",
    "<answer>" + str(GT).replace("], ", "],\n") + "</answer>",  # newlines inside the list
    f"<answer>{[[b[0] + 0.05, b[1], b[2], b[3] - 0.1] for b in GT]}</answer>",  # close
    f"<answer>{[[b[2], b[3], b[0], b[1]] for b in GT]}</answer>",  # corners swapped: negative areas, as written
    f"<answer>{GT[:7]}</answer>",  # 7 boxes
    f"<answer>{[tuple(b) for b in GT]}</answer>",  # tuples, not lists
    f"<answer>{[b + [0.5] for b in GT]}</answer>",  # 5 numbers a box
    f"<answer>{[[0, 0, 1, 1]] * 8}</answer>",  # the whole frame every time
    f"<answer>{[[0.5, 0.5, 0.5, 0.5]] * 8}</answer>",  # empty boxes
    f"<answer>{GT}</answer><answer>{[[0, 0, 1, 1]] * 8}</answer>",  # the first answer counts
    f"{GT}", "<answer>the sloth stays</answer>", "",
])
def test_the_got10k_preset_scores_as_videochat_r1_does(output):
    from app.rewards.protocols import videochat_r1_track_accuracy

    record = {"problem_type": "object tracking", "solution": f"<answer>{GT}</answer>", "box_format": "normalized"}
    assert videochat_r1_track_accuracy(output, record) == pytest.approx(vc_track_iou(output, GT), abs=1e-12)


def test_the_got10k_scoring_names_what_it_cannot_score():
    from app.answers.reading import RewardError
    from app.rewards.protocols import videochat_r1_track_accuracy

    with pytest.raises(RewardError, match="scores 'object tracking' records only.*'multiple choice'"):
        videochat_r1_track_accuracy("<answer>A</answer>", {"problem_type": "multiple choice",
                                                          "solution": "<answer>A</answer>"})
    # a string inside a box stops VideoChat-R1's script; here it scores 0
    assert videochat_r1_track_accuracy(f"<answer>{[['a', 0, 1, 1]] * 8}</answer>",
                                       {"problem_type": "object tracking", "solution": f"<answer>{GT}</answer>"}) == 0


def test_got10k_annotations_convert_to_records_and_bad_entries_are_named(tmp_path):
    import json

    from app.data.convert import FORMATS, ConvertError, main
    from app.rewards.rules import accuracy_of

    got_folder(tmp_path / "val", "GOT-10k_Val_000010", 12, 40, 60)
    annotation = tmp_path / "got_val.json"
    annotation.write_text(json.dumps([GOT_ENTRY, {**GOT_ENTRY, "path": "/x/GOT-10k_Val_000111"}]))
    records, missing = FORMATS["videochat_r1_got10k"](annotation, tmp_path / "val")
    assert missing == ["GOT-10k_Val_000111"] and records[0]["path"] == "GOT-10k_Val_000010"
    assert records[0]["initial_box"] == GT[0] and records[0]["box_format"] == "normalized"
    # this project's own reward reads the same solution: the reference scores 1 with it
    assert accuracy_of(f"<think>x</think><answer>{GT}</answer>", records[0]) == 1.0
    main(["videochat_r1_got10k", str(annotation), "--videos", str(tmp_path / "val"), "--out", str(tmp_path / "r")])
    assert len((tmp_path / "r").read_text().splitlines()) == 1
    annotation.write_text(json.dumps([GOT_ENTRY, {**GOT_ENTRY, "gt": [[0.1, 0.2, 0.3]]}]))
    with pytest.raises(ConvertError, match=r"got_val.json\[1\] \(GOT-10k_Val_000010\): gt is not a list of normalised"):
        FORMATS["videochat_r1_got10k"](annotation, tmp_path / "val")
    annotation.write_text(json.dumps({"a": 1}))
    with pytest.raises(ConvertError, match="expected a list"):
        FORMATS["videochat_r1_got10k"](annotation, tmp_path / "val")


def test_videochat_r1s_charades_protocol_is_timezeros(tmp_path):
    """Its evaluate_grounding.py and my_qwen_utils.py, read beside TimeZero's evaluate.py: the same prompt (checked
    here character for character), video settings, parse and IoU; so its preset extends TimeZero's."""
    from app.data.prompts import question_text

    assert preset("videochat_r1_charades_sta").to_dict() == preset("timezero_charades_sta").to_dict()
    record = {"problem": "person turn a light on.", "problem_type": "temporal grounding",
              "solution": "<answer>[24.3, 30.4]</answer>"}
    assert question_text(record, preset("videochat_r1_charades_sta").data.prompt_template) == \
        VC_GROUND.replace("[EVENT]", record["problem"])


def test_an_evaluation_with_the_got10k_preset_runs_and_reports_tracking_metrics(tmp_path):
    """scripts/eval.sh MODEL got10k.jsonl --protocol videochat_r1_got10k, in process: converted records, frame
    folders, the preset's prompt and scoring; summary.json reports mIoU and R@k for object tracking."""
    import json

    for name in ("GOT-10k_Val_000010", "GOT-10k_Val_000111"):
        got_folder(tmp_path / "val", name, 15, 40, 60)
    (tmp_path / "got_val.json").write_text(json.dumps([GOT_ENTRY, {**GOT_ENTRY, "path": "/x/GOT-10k_Val_000111",
                                                                   "object": "hand truck"}]))
    saved, rows = evaluate_converted(tmp_path, "videochat_r1_got10k", tmp_path / "got_val.json", tmp_path / "val",
                                     "videochat_r1_got10k")
    assert len(rows) == 2 and set(saved["grounding"]["object tracking"]) == {"mIoU", "R@0.3", "R@0.5", "R@0.7"}


# evaluate_gqa.py's GQA_THINK_ANSWER_GLUE (eval_prompts.py), extract_characters_regex, merge_intervals, compute_iou
# and is_valid_two_d_list_format
VC_GQA = """Answer the question: "[QUESTION]" according to the content of the video. Select the answer from :[OPTION].

Output your thought process within the <think> </think> tags, including analysis with either specific timestamps (xx.xx) or time ranges (xx.xx to xx.xx) in <timestep> </timestep> tags.

Then, provide your answer within the <answer> </answer> tags, output the corresponding letter of the option. At the same time, in the <glue> </glue> tags, present the precise time period in seconds of the video clips on which you base your answer to this question in the format of [(s1, e1), (s2, e2), ...]. For example: <answer>A</answer><glue>[(5.2, 10.4)]</glue>.
"""


def vc_letter(s: str) -> str:
    import re

    s = s.strip()
    for prefix in ["The best answer is", "The correct answer is", "The answer is", "The answer",
                   "The best option is", "The correct option is", "Best answer:" "Best option:"]:
        s = s.replace(prefix, "")
    if len(s.split()) > 10 and not re.search("[ABCDEFG]", s):
        return ""
    matches = re.search(r"[ABCDEFG]", s)
    return "" if matches is None else matches[0]


def vc_gqa(output: str, answer: str, glue: list) -> tuple[float, float]:
    """(acc, iou) as process_work_items() computes them; a <glue> that fails the format check scores 0 here (there
    it keeps the previous question's value)."""
    import ast
    import re

    acc = 0.0
    found = re.search(r"<answer>(.*?)</answer>", output, re.DOTALL)
    if found and vc_letter(found.group(1)) == vc_letter(answer):
        acc = 1.0
    iou = 0.0
    found = re.search(r"<glue>(.*?)</glue>", output, re.DOTALL)
    pattern = r'^\[(\(\d+(\.\d+)?,\s*\d+(\.\d+)?\)(,\s*\(\d+(\.\d+)?,\s*\d+(\.\d+)?\))*(,)?|)\]$'
    if found and re.match(pattern, found.group(1)):
        spans = ast.literal_eval(found.group(1))
        if all(isinstance(t, tuple) and len(t) == 2 and t[0] <= t[1] for t in spans):
            def merge(intervals):
                if not intervals:
                    return []
                ordered = sorted([list(i) for i in intervals], key=lambda x: x[0])
                merged = [ordered[0][:]]
                for current in ordered[1:]:
                    if current[0] <= merged[-1][1]:
                        merged[-1][1] = max(merged[-1][1], current[1])
                    else:
                        merged.append(current[:])
                return merged

            a, b = merge(spans), merge(glue)
            inter, i, j = 0, 0, 0
            while i < len(a) and j < len(b):
                start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
                if start < end:
                    inter += end - start
                if a[i][1] < b[j][1]:
                    i += 1
                else:
                    j += 1
            union = sum(e - s for s, e in a) + sum(e - s for s, e in b) - inter
            iou = 1.0 if union == 0 else inter / union
    return acc, iou


GQA_ENTRIES = [  # the first two entries of its Annotations/NextGQA/nextgqa_test.json, and one with two spans
    {"id": "2574374895_8", "video": "1101/2574374895.mp4", "question": "what did the baby do after throwing the "
     "green cup away while on the floor near the end", "options": ["(A) clap proudly", "(B) the lady sitting down",
     "(C) lay on floor", "(D) just picked it up", "(E) crawl"], "duration": 30, "glue": [[23.0, 27.7]],
     "type": "TN", "answer": "(C)"},
    {"id": "3083302557_3", "video": "0067/3083302557.mp4", "question": "what did the lady do while turning back",
     "options": ["(A) walk away", "(B) thumbs up", "(C) put down her club", "(D) applying cream on face",
                 "(E) caressing for the dog"], "duration": 47, "glue": [[10.8, 12.3]], "type": "TC", "answer": "(B)"},
    {"id": "x_1", "video": "0067/3083302557.mp4", "question": "why did the boy's dog bark", "options": [
        "(A) it's hungry", "(B) a cat", "(C) play", "(D) the door", "(E) nothing"], "duration": 47,
     "glue": [[3.0, 6.0], [5.0, 9.0], [20.0, 22.0]], "type": "CW", "answer": "(D)"},
]


@pytest.mark.parametrize("output", [
    "<think>at 23 s</think><answer>C</answer><glue>[(23.0, 27.7)]</glue>",
    "<answer>(C) lay on floor</answer><glue>[(22, 26), (26.5, 30)]</glue>",
    "<answer>The best answer is C</answer><glue>[(20.5, 25.0),]</glue>",
    "<answer>D</answer><glue>[(3, 7), (19, 21)]</glue>", "<answer>c</answer><glue>[]</glue>",
    "<answer>C</answer><glue>[(27.7, 23.0)]</glue>",  # start after end: refused
    "<answer>C</answer><glue>[[23.0, 27.7]]</glue>",  # brackets, not its tuples: refused
    "<answer>C</answer><glue>[(23.0,27.7), (1,2)] </glue>",  # a trailing space: refused
    "<answer>C</answer><glue>[(-1, 3)]</glue>", "<answer>C</answer>", "C 23.0 to 27.7", "",
    "<answer>I think the answer may be the option where the baby lies down on the floor here</answer>",
])
@pytest.mark.parametrize("entry", GQA_ENTRIES[::2])
def test_the_nextgqa_preset_scores_as_videochat_r1_does(output, entry):
    from app.rewards.protocols import videochat_r1_gqa_accuracy, videochat_r1_gqa_evidence

    record = {"problem_type": "multiple choice", "solution": f"<answer>{entry['answer'][1]}</answer>",
              "evidence": entry["glue"]}
    acc, iou = vc_gqa(output, entry["answer"], entry["glue"])
    assert videochat_r1_gqa_accuracy(output, record) == acc
    assert videochat_r1_gqa_evidence(output, record) == pytest.approx(iou, abs=1e-12)


def test_the_nextgqa_preset_writes_videochat_r1s_prompt_and_converts_its_file(tmp_path):
    import json

    from app.data.convert import FORMATS, ConvertError
    from app.data.records import build_conversation, check_record
    from app.data.video import write_mp4

    rng = np.random.default_rng(0)
    write_mp4(tmp_path / "videos" / "0067" / "3083302557.mp4", rng.integers(0, 255, (20, 64, 96, 3), np.uint8), 4)
    annotation = tmp_path / "nextgqa_test.json"
    annotation.write_text(json.dumps(GQA_ENTRIES))
    records, missing = FORMATS["videochat_r1_nextgqa"](annotation, tmp_path / "videos")
    assert missing == ["1101/2574374895.mp4"] and [r["problem_id"] for r in records] == ["3083302557_3", "x_1"]
    assert records[0]["solution"] == "<answer>B</answer>" and records[0]["evidence"] == [[10.8, 12.3]]
    assert records[1]["original_question_type"] == "CW"
    cfg = preset("videochat_r1_nextgqa")
    for record, entry in zip(records, GQA_ENTRIES[1:]):
        assert check_record(record, tmp_path / "videos") is None
        text, video = build_conversation(record, tmp_path / "videos", cfg.data)[0]["content"]
        assert text["text"] == VC_GQA.replace("[QUESTION]", entry["question"]).replace("[OPTION]",
                                                                                      str(entry["options"]))
        assert video["total_pixels"] == 3584 * 28 * 28 and video["min_pixels"] == 16 * 28 * 28
    assert cfg.eval.answer_extraction == "videochat_r1_gqa" and cfg.eval.max_new_tokens == 2048
    assert "evidence [[3, 1]] is not a list of [start, end] spans" in check_record(
        {**records[0], "evidence": [[3, 1]]}, tmp_path / "videos")
    annotation.write_text(json.dumps([{**GQA_ENTRIES[1], "answer": "B or C"}]))
    with pytest.raises(ConvertError, match=r"\[0\] \(0067/3083302557.mp4\): answer 'B or C' is not an option letter"):
        FORMATS["videochat_r1_nextgqa"](annotation, tmp_path / "videos")
    annotation.write_text(json.dumps([{**GQA_ENTRIES[1], "glue": [[5, 2]]}]))
    with pytest.raises(ConvertError, match="glue .* is not a list of \\[start, end\\] spans"):
        FORMATS["videochat_r1_nextgqa"](annotation, tmp_path / "videos")


def test_an_evaluation_with_the_nextgqa_preset_reports_accuracy_and_evidence_iou(tmp_path):
    import json

    from app.data.video import write_mp4

    rng = np.random.default_rng(1)
    write_mp4(tmp_path / "videos" / "0067" / "3083302557.mp4", rng.integers(0, 255, (12, 56, 56, 3), np.uint8), 4)
    (tmp_path / "a.json").write_text(json.dumps(GQA_ENTRIES[1:]))
    saved, rows = evaluate_converted(tmp_path, "videochat_r1_nextgqa", tmp_path / "a.json", tmp_path / "videos",
                                     "videochat_r1_nextgqa")
    assert len(rows) == 2 and set(saved["grounding"]["evidence"]) == {"mIoU", "R@0.3", "R@0.5", "R@0.7"}
    assert set(saved["by_original_question_type"]) == {"TC", "CW"}
    assert all(len(row["ious"]) == 1 for row in rows)


# ---- VLM-R1's referring-expression evaluation (om-ai-lab/VLM-R1 src/eval/test_rec_r1.py), transcribed -------------
VLM_TEMPLATE = ("{Question} First output the thinking process in <think> </think> tags and then output the final "
                "answer in <answer> </answer> tags. Output the final answer in JSON format.")


def vlm_extract(content: str) -> list[int]:
    import re

    found = re.search(r"<answer>(.*?)</answer>", content, re.DOTALL)
    if found:
        box = re.search(r"\{.*\[(\d+),\s*(\d+),\s*(\d+),\s*(\d+)]\s*.*\}", found.group(1).strip(), re.DOTALL)
        if box:
            return [int(box.group(i)) for i in range(1, 5)]
    return [0, 0, 0, 0]


def vlm_iou(box1, box2) -> float:
    inter_x1, inter_y1 = max(box1[0], box2[0]), max(box1[1], box2[1])
    inter_x2, inter_y2 = min(box1[2] - 1, box2[2] - 1), min(box1[3] - 1, box2[3] - 1)
    if inter_x1 < inter_x2 and inter_y1 < inter_y2:
        inter = (inter_x2 - inter_x1 + 1) * (inter_y2 - inter_y1 + 1)
    else:
        inter = 0
    union = (box1[2] - box1[0]) * (box1[3] - box1[1]) + (box2[2] - box2[0]) * (box2[3] - box2[1]) - inter
    return float(inter) / union


def vlm_correct(output: str, truth, input_hw, image_hw) -> tuple[int, float]:
    box = vlm_extract(output)
    box = [box[0] / input_hw[1] * image_hw[1], box[1] / input_hw[0] * image_hw[0],
           box[2] / input_hw[1] * image_hw[1], box[3] / input_hw[0] * image_hw[0]]
    iou = vlm_iou(box, truth)
    return int(iou > 0.5), iou


REC_TRUTH = [103.93, 299.99, 342.53, 480.0]


@pytest.mark.parametrize("output", [
    '<think>the man</think><answer>{"bbox_2d": [104, 300, 343, 480], "label": "man"}</answer>',
    '<answer>```json\n[{"bbox_2d": [90, 280, 330, 470]}]\n```</answer>',  # the last box inside braces
    '<answer>{"bbox_2d": [10, 20, 30, 40]}, {"bbox_2d": [104, 300, 343, 480]}</answer>',  # two boxes: the last
    "<answer>[104, 300, 343, 480]</answer>",  # no braces: [0, 0, 0, 0]
    '<answer>{"bbox_2d": [104.5, 300, 343, 480]}</answer>',  # a decimal: not read
    '<answer>{"bbox_2d": [200, 300, 343, 480]}</answer>', '{"bbox_2d": [104, 300, 343, 480]}', "",
])
@pytest.mark.parametrize(("input_hw", "image_hw"), [((476, 644), (480, 640)), ((336, 448), (480, 640))])
def test_the_refcoco_preset_scores_as_vlm_r1_does(output, input_hw, image_hw):
    from app.rewards.protocols import vlm_r1_rec_accuracy, vlm_r1_rec_iou

    record = {"problem_type": "spatial grounding", "solution": f"<answer>{REC_TRUTH}</answer>",
              "_image_sizes": [(*image_hw, *input_hw)]}
    correct, iou = vlm_correct(output, REC_TRUTH, input_hw, image_hw)
    assert vlm_r1_rec_accuracy(output, record) == correct
    assert vlm_r1_rec_iou(output, record) == pytest.approx(iou, abs=1e-12)


def test_refcoco_files_convert_to_vlm_r1s_subset_and_evaluate_with_its_input_sizes(tmp_path):
    """The converter keeps the 2,000 questions its random.seed(42) shuffle keeps, in that order; an evaluation reads
    each image's input size from the processor's grid (x 14) and the file, as its script does; summary.json has the
    accuracy and the IoUs' mIoU and R@k."""
    import json
    import random

    from PIL import Image

    from app.data.convert import FORMATS, ConvertError
    from app.data.records import build_conversation

    entries = [{"image": f"train2014/img_{i % 3}.jpg", "problem": f"Please provide the bounding box coordinate of the "
                f"region this sentence describes: person {i}.", "solution": [10 + i % 7, 5, 60, 40.5]}
               for i in range(2500)]
    (tmp_path / "coco" / "train2014").mkdir(parents=True)
    for k, (w, h) in enumerate([(150, 100), (97, 61), (80, 120)]):
        Image.new("RGB", (w, h), (40 * k, 90, 200)).save(tmp_path / "coco" / "train2014" / f"img_{k}.jpg")
    (tmp_path / "refcoco_val.json").write_text(json.dumps(entries))
    records, missing = FORMATS["vlm_r1_rec"](tmp_path / "refcoco_val.json", tmp_path / "coco")
    theirs = list(entries)
    random.seed(42)
    random.shuffle(theirs)
    assert missing == [] and [r["problem"] for r in records] == [e["problem"] for e in theirs[:2000]]
    cfg = preset("vlm_r1_refcoco")
    image, text = build_conversation(records[0], tmp_path / "coco", cfg.data)[0]["content"]
    assert image["type"] == "image" and text["text"] == VLM_TEMPLATE.format(Question=theirs[0]["problem"])
    with pytest.raises(ConvertError, match=r"bad.json\[0\] \(x.jpg\): solution \[1, 2\] is not one"):
        (tmp_path / "bad.json").write_text(json.dumps([{"image": "x.jpg", "problem": "p", "solution": [1, 2]}]))
        FORMATS["vlm_r1_rec"](tmp_path / "bad.json", tmp_path / "coco")
    saved, rows = evaluate_converted(tmp_path, "vlm_r1_rec", tmp_path / "refcoco_val.json", tmp_path / "coco",
                                     "vlm_r1_refcoco", "--sample", "3")
    assert len(rows) == 3 and set(saved["grounding"]["spatial grounding"]) == {"mIoU", "R@0.3", "R@0.5", "R@0.7"}
    assert all(len(row["ious"]) == 1 and row["accuracies"][0] == float(row["ious"][0] > 0.5) for row in rows)
    # the input size as its script reads it: process_vision_info on its message, the processor, grid x 14
    from qwen_vl_utils import process_vision_info

    from app.data.records import encode_record
    from app.evaluation.evaluate import image_sizes
    from app.runtime.models import load_processor

    processor = load_processor(tmp_path / "tiny")
    for k, (w, h) in enumerate([(150, 100), (97, 61), (80, 120)]):
        record = {**records[0], "path": f"train2014/img_{k}.jpg", "_root": tmp_path / "coco"}
        prompt, _ = encode_record(processor, record, tmp_path / "coco", cfg.data)
        message = [{"role": "user", "content": [{"type": "image", "image": f"file://{tmp_path / 'coco' / record['path']}"},
                                                 {"type": "text", "text": "x"}]}]
        images, _ = process_vision_info(message)
        grid = processor(text=[processor.apply_chat_template(message, tokenize=False, add_generation_prompt=True)],
                         images=images, return_tensors="pt")["image_grid_thw"][0]
        assert image_sizes(record, prompt, 14) == [(h, w, int(grid[1] * 14), int(grid[2] * 14))]


def test_hedged_answers_per_protocol_this_projects_scoring_refuses_them_published_scripts_as_they_do():
    """An answer that commits to more than one option, span or box: this project's scoring (training rewards and
    eval.answer_extraction=project) gives 0 in every form; each published protocol keeps its script's reading,
    which docs/evaluation.md states: Video-R1's exact match refuses them; VideoChat-R1's NExT-GQA reads the first
    capital A-G anywhere ("Both A and B" reads the B of "Both"); TimeZero reads the last "a to b"; VLM-R1 the last box
    inside {...}."""
    from app.rewards.protocols import ANSWER_EXTRACTION

    def score(protocol, answer, record):
        return ANSWER_EXTRACTION[protocol][0](f"<think>hm</think><answer>{answer}</answer>", record)

    choice = {"problem_type": "multiple choice", "solution": "<answer>B</answer>"}
    for hedge in ("A or B", "Both A and B", "A, B", "A and/or B", "(A) or (B)"):
        assert score("project", hedge, choice) == 0.0, hedge
        assert score("video_r1", hedge, choice) == 0.0, hedge
    assert score("videochat_r1_gqa", "A or B", choice) == 0.0  # its first capital: A
    assert score("videochat_r1_gqa", "Both A and B", choice) == 1.0  # its first capital: the B of "Both"
    span = {"problem_type": "temporal grounding", "solution": "<answer>[24.3, 30.4]</answer>", "duration": 31}
    assert score("project", "0 to 5 or 24.3 to 30.4", span) == 0.0
    assert score("timezero", "0 to 5 or 24.3 to 30.4", span) == pytest.approx(1.0)  # its last span
    box = {"problem_type": "spatial grounding", "solution": "<answer>[10, 20, 110, 220]</answer>"}
    assert score("project", "[0, 0, 5, 5] or [10, 20, 110, 220]", box) == 0.0
    sizes = [(400, 400, 400, 400)]
    assert ANSWER_EXTRACTION["vlm_r1_rec"][0](
        '<answer>{"bbox_2d": [0, 0, 5, 5], "or": [10, 20, 110, 220]}</answer>', {**box, "_image_sizes": sizes}) == 1.0
