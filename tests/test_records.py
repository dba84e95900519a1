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
from app.models import build_tiny_checkpoint, load_processor

DATA = SimpleNamespace(fps=2.0, max_frames=4, min_pixels=3136, max_pixels=3136, image_min_pixels=3136,
                       image_max_pixels=3136, prompt_template="video_r1", system_prompt="template",
                       max_prompt_length=4096)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("records")
    rng = np.random.default_rng(0)
    for name, frames in (("a.mp4", 6), ("b.mp4", 4), ("one.mp4", 1)):
        write_mp4(root / "MMVU" / "videos" / name, rng.integers(0, 255, (frames, 56, 56, 3), dtype=np.uint8), fps=4)
    for name in ("x.png", "y.jpg"):
        Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)).save(root / name)
    (root / "frames").mkdir()
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
    ({"data_type": "video", "path": "frames"}, "frame folders are not supported yet"),
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
