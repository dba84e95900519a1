"""Records in the shapes real files ship: list paths, missing data_type, root-relative leading "/", frame folders,
one-frame videos, paths outside the root. Each is used as intended or skipped with a named reason; none crashes and
none silently changes modality."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from app.data.records import build_conversation, check_record, encode_record
from app.data.video import write_mp4
from app.runtime.models import build_tiny_checkpoint, load_processor

DATA = SimpleNamespace(fps=2.0, max_frames=4, min_pixels=3136, max_pixels=3136, image_min_pixels=3136,
                       image_max_pixels=3136, prompt_template="video_r1", system_prompt="template",
                       max_prompt_length=4096, frame_folder_fps=3.0, frame_folder_sampling="fps")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("records")
    rng = np.random.default_rng(0)
    for name, frames in (("a.mp4", 6), ("b.mp4", 4), ("one.mp4", 1)):
        write_mp4(root / "MMVU" / "videos" / name, rng.integers(0, 255, (frames, 56, 56, 3), dtype=np.uint8), fps=4)
    for name in ("x.png", "y.jpg"):
        Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)).save(root / name)
    (root / "frames").mkdir()  # a frame-folder video, named so that text order is wrong (frame_10 < frame_2)
    for i in range(1, 13):
        Image.fromarray(np.full((56, 56, 3), i * 20, dtype=np.uint8)).save(root / "frames" / f"frame_{i}.jpg")
    (root / "oneframe").mkdir()
    Image.fromarray(np.zeros((56, 56, 3), dtype=np.uint8)).save(root / "oneframe" / "0001.jpg")
    return root


def record(**fields) -> dict:
    return {"problem_id": 1, "problem": "Which?", "problem_type": "multiple choice", "options": ["A. a", "B. b"],
            "solution": "<answer>A</answer>", "_where": "test:1", **fields}


@pytest.mark.parametrize(("fields", "kind", "media"), [
    ({"data_type": "video", "path": ["MMVU/videos/a.mp4", "MMVU/videos/b.mp4"]}, "video", 2),
    ({"data_type": "image", "path": ["x.png", "y.jpg"]}, "image", 2),
    ({"path": "MMVU/videos/a.mp4"}, "video", 1),  # no data_type: inferred from the file, never text
    ({"path": "x.png"}, "image", 1),
    ({"data_type": "video", "path": "/MMVU/videos/a.mp4"}, "video", 1),  # re-hosted: "/" meant under the root
    ({"data_type": "video", "path": "./MMVU/videos/b.mp4"}, "video", 1),
    ({"data_type": "video", "path": "frames"}, "video", 1),  # a frame folder
    ({"path": "frames"}, "video", 1),
])
def test_shapes_that_are_used(root, fields, kind, media):
    rec = record(**fields)
    assert check_record(rec, root) is None
    assert rec["data_type"] == kind
    content = build_conversation(rec, root, DATA)[-1]["content"]
    assert [c["type"] for c in content] == [kind] * media + ["text"]


@pytest.mark.parametrize(("fields", "reason"), [
    ({"data_type": "video", "path": ["MMVU/videos/a.mp4", 3]}, "must be a string or a list of strings"),
    ({"path": "notes.txt"}, "does not say video or image (set data_type)"),
    ({"path": ["MMVU/videos/a.mp4", "x.png"]}, "does not say video or image"),
    ({"data_type": "video", "path": "oneframe"}, "frame folder with 1 image file(s)"),
    ({"data_type": "image", "path": "frames"}, "image path is a directory"),
    ({"data_type": "video", "path": "../outside.mp4"}, "path outside the data root"),
    ({"data_type": "video", "path": "MMVU/videos/missing.mp4"}, "video file not found"),
])
def test_shapes_that_are_skipped_with_a_reason(root, fields, reason):
    assert reason in check_record(record(**fields), root)


def test_encoding_multi_video_and_a_one_frame_video(root, tmp_path):
    processor = load_processor(build_tiny_checkpoint(tmp_path / "tiny", "qwen2_5_vl", seed=0))
    two = record(data_type="video", path=["MMVU/videos/a.mp4", "MMVU/videos/b.mp4"])
    assert check_record(two, root) is None
    prompt, reason = encode_record(processor, two, root, DATA)
    assert reason == "" and prompt.inputs["video_grid_thw"].shape[0] == 2
    one = record(data_type="video", path="MMVU/videos/one.mp4")
    prompt, reason = encode_record(processor, one, root, DATA)
    assert prompt is None and "has 1 frame; qwen-vl-utils needs at least 2" in reason


def test_frame_folders_sample_in_frame_order_at_their_rate(root, tmp_path):
    from app.data.video import frame_files, frame_folder_element

    assert [p.name for p in frame_files(root / "frames")][:3] == ["frame_1.jpg", "frame_2.jpg", "frame_3.jpg"]
    # 12 frames recorded at 3 fps are 4 s: 8 frames at 2 fps; at 6 fps they are 2 s: 4 frames.
    element = frame_folder_element({"video": str(root / "frames"), "fps": 2.0, "folder_fps": 3.0})
    assert len(element["video"]) == 8 and element["raw_fps"] == 3.0 and element["sample_fps"] == 2.0
    assert element["video"][0].endswith("frame_1.jpg") and element["video"][-1].endswith("frame_12.jpg")
    assert len(frame_folder_element({"video": str(root / "frames"), "fps": 2.0, "folder_fps": 6.0})["video"]) == 4
    capped = frame_folder_element({"video": str(root / "frames"), "fps": 2.0, "folder_fps": 1.0, "max_frames": 6})
    assert len(capped["video"]) == 6
    # Through the processor: the record's own fps wins over data.frame_folder_fps.
    processor = load_processor(build_tiny_checkpoint(tmp_path / "tiny", "qwen2_5_vl", seed=0))
    data = SimpleNamespace(**{**vars(DATA), "max_frames": 16, "frame_folder_fps": 3.0})
    grids = []
    for fields in ({}, {"fps": 6.0}):
        rec = record(data_type="video", path="frames", **fields)
        assert check_record(rec, root) is None
        prompt, reason = encode_record(processor, rec, root, data)
        assert reason == ""
        grids.append(int(prompt.inputs["video_grid_thw"][0, 0]))
    assert grids == [4, 2]  # 8 and 4 frames, two per temporal patch


def _stream(tmp_path, lookahead):
    """A stream over 6 good video records and one corrupt video, drawn 3 at a time for 5 draws (wraps epochs)."""
    from app.config.loading import Config
    from app.data.stream import load_stream
    from app.data.synthetic import generate

    files = generate(tmp_path / "data", train=6, heldout=0, seed=1)
    (tmp_path / "data" / "videos" / "corrupt.mp4").write_bytes(bytes(range(256)) * 8)
    lines = files["train"].read_text().splitlines()
    lines.insert(2, lines[0].replace('"path": "', '"path": "videos/corrupt.mp4", "was": "'))
    files["train"].write_text("\n".join(lines) + "\n")
    cfg = Config().data
    cfg.train_file, cfg.max_skip_fraction, cfg.max_frames = str(files["train"]), 0.5, 4
    processor = load_processor(build_tiny_checkpoint(tmp_path / "tiny", "qwen2_5_vl"))
    return load_stream(cfg, processor, seed=3, rank=0, world_size=1, lookahead=lookahead)


def test_prefetch_keeps_order_skips_and_resume(tmp_path, caplog):
    import torch

    def draws(stream, count, start=0):
        stream.position = start
        out = []
        for _ in range(count):
            out.append([(p.record["problem_id"], p.inputs["pixel_values_videos"].sum().item())
                        for p in stream.next_prompts(3)])
        return out, stream.position, sum(stream.skipped.values())

    plain = _stream(tmp_path / "plain", 0)
    ahead = _stream(tmp_path / "ahead", 5)
    want = draws(plain, 5)
    got = draws(ahead, 5)
    assert got == want
    corrupt_draws = sum("corrupt" in plain._record_at(p)["path"] for p in range(want[1]))
    assert want[2] == corrupt_draws >= 2  # drawn in several epochs: counted once per draw, not per encode
    named = [r for r in caplog.records if "skipping" in r.getMessage() and "corrupt.mp4" in r.getMessage()]
    assert len(named) == 2  # one warning per stream (plain, ahead) for the record, however often it is drawn
    assert sum(ahead.take_skips().values()) == corrupt_draws and not ahead.take_skips()
    assert len(ahead._pending) == 5  # bounded: the next 5 positions, no more
    # Resume: a fresh stream set to a saved position draws what the uninterrupted one drew from there.
    resumed = _stream(tmp_path / "resumed", 5)
    resumed.prefetch()  # work already under way for positions before the resume point is dropped
    tail = draws(resumed, 2, start=9)
    plain.position, plain.skipped = 9, plain.skipped.__class__()
    assert tail[0] == draws(plain, 2, start=9)[0]
    assert all(p >= resumed.position for p in resumed._pending)
    ahead.close()
    resumed.close()
    assert torch.is_tensor(ahead.next_prompts(1)[0].inputs["input_ids"])  # closed: still works, synchronously


def test_options_are_labelled_and_many_options_work():
    from app.data.prompts import labelled_options, question_text
    from app.rewards.rules import accuracy_of

    assert labelled_options(["A. red", "B. blue"]) == ["A. red", "B. blue"]
    assert labelled_options(["(A) red", "(B) blue"]) == ["(A) red", "(B) blue"]
    assert labelled_options(["red", "blue"]) == ["A. red", "B. blue"]
    twelve = [f"option {i}" for i in range(12)]
    text = question_text(record(options=twelve))
    assert "L. option 11\n" in text and "A. option 0\n" in text
    rec = record(options=twelve, solution="<answer>L</answer>")
    assert accuracy_of("<think>x</think><answer>L</answer>", rec) == 1.0
    assert accuracy_of("<think>x</think><answer>(l)</answer>", rec) == 1.0


def test_a_records_frame_sampling_and_a_templates_fields_are_checked_by_name(root):
    from app.data.prompts import question_text

    assert "unknown frame_sampling 'every_other' (known: fps, videochat_r1_track)" in check_record(
        record(data_type="video", path="frames", frame_sampling="every_other"), root)
    assert "frame_sampling 'videochat_r1_track' applies to frame folders only" in check_record(
        record(data_type="video", path="MMVU/videos/a.mp4", frame_sampling="videochat_r1_track"), root)
    with pytest.raises(ValueError, match="prompt template 'videochat_r1_track' needs the record field 'object'"):
        question_text(record(problem_type="object tracking", solution="<answer>[[0, 0, 1, 1]]</answer>"),
                      "videochat_r1_track")


@pytest.mark.slow  # a 2,000-frame video through qwen-vl-utils: about a minute of decoding and resizing
def test_a_long_videos_frames_get_the_pixels_the_config_asks_for_and_the_planner_counts_them(tmp_path, caplog):
    """2,000 frames of 320 x 320 at 1 fps through encode_record with the 7B LoRA config and data.max_pixels=100352:
    every frame gets max_pixels' resize (308 x 308, 11 x 11 tokens a frame pair), not qwen-vl-utils' own budget
    (which would give 280 x 280 above 1,800 frames); the planner, told the frames' size, counts the same visual
    tokens; the log states the video's tokens once; a nonzero data.video_total_pixels still caps the frames."""
    import logging
    from pathlib import Path

    from app.config.loading import load_config
    from app.planning.planner import World, plan

    root = Path(__file__).resolve().parents[1]
    rng = np.random.default_rng(0)
    frames = np.repeat(rng.integers(0, 255, (20, 320, 320, 3), dtype=np.uint8), 100, axis=0)
    write_mp4(tmp_path / "long.mp4", frames, fps=1)
    checkpoint = build_tiny_checkpoint(tmp_path / "tiny", "qwen2_5_vl", max_pixels=12845056)  # the 7B's bound
    processor = load_processor(checkpoint)
    overrides = ["data.max_frames=2000", "data.fps=1", "data.max_pixels=100352", "data.video_total_pixels=0",
                 "data.max_prompt_length=262144"]
    cfg = load_config(root / "configs/qwen2_5_vl_7b_video_lora.yaml", overrides)
    record = {"problem_id": 1, "problem": "What happens?", "problem_type": "free-form", "solution": "x",
              "data_type": "video", "path": "long.mp4", "_where": "long.jsonl:1"}
    from app.data.records import say_video_tokens

    with caplog.at_level(logging.INFO, logger="app.data.records"):
        prompt, reason = encode_record(processor, record, tmp_path, cfg.data)
        say_video_tokens({**record, "problem_id": 2}, prompt.inputs, processor)  # a second video of that shape
    assert reason == ""
    grid = prompt.inputs["video_grid_thw"].tolist()
    assert grid == [[1000, 22, 22]]  # 308 / 14 = 22 patches a side: 11 x 11 merged tokens a frame pair
    tokens = int((prompt.inputs["input_ids"] == 151656).sum()) or 1000 * 121
    assert tokens == 1000 * 121
    planned = plan(cfg, World(), "qwen2_5_vl_7b", video_size=(320, 320))["workload"]["visual"]
    assert planned == 1000 * 121
    said = [r.message for r in caplog.records if "visual tokens" in r.message]
    assert len(said) == 1 and "2000 frames -> 1000 frame pairs x 121 tokens (308x308 pixels a frame)" in said[0]
    # the cap at a tenth of the frames and a tenth of the budget (the same pixels a frame; one decode of 2,000 frames
    # is what the test above needs, a second would only cost its half a minute again)
    budget = load_config(root / "configs/qwen2_5_vl_7b_video_lora.yaml",
                         ["data.max_frames=200", *overrides[1:3], "data.video_total_pixels=5017600",
                          "data.max_prompt_length=262144"])
    capped, _ = encode_record(processor, record, tmp_path, budget.data)
    t, h, w = capped.inputs["video_grid_thw"].tolist()[0]
    assert t == 100 and h * w * 14 * 14 <= 5017600 / 200 * 2 and h * w < 22 * 22
    assert plan(budget, World(), "qwen2_5_vl_7b", video_size=(320, 320))["workload"]["visual"] == t * h * w // 4
