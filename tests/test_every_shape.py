"""One data file with a record of every shape real Video-R1 training and benchmark files ship (generated media):
GRPO trains on it for 2 steps and evaluation runs over it, with no crash, every unusable record skipped with its
named reason, and no record changing modality on the way."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.data.records import check_record, encode_record
from app.data.video import write_mp4
from app.runtime.models import build_tiny_checkpoint, load_processor
from tests.test_records import DATA

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.distributed

MC = {"problem_type": "multiple choice", "options": ["A. red", "B. blue", "C. green", "D. white"],
      "solution": "<answer>B</answer>"}
USABLE = {  # problem_id -> (fields, the modality it must keep)
    "one-video": ({**MC, "data_type": "video", "path": "./videos/a.mp4"}, "video"),
    "two-videos": ({**MC, "data_type": "video", "path": ["videos/a.mp4", "videos/b.mp4"]}, "video"),
    "two-images": ({**MC, "data_type": "image", "path": ["images/x.png", "images/y.jpg"]}, "image"),
    "no-type-video": ({**MC, "path": "videos/b.mp4"}, "video"),
    "no-type-image": ({**MC, "path": "images/x.png"}, "image"),
    "rehosted": ({**MC, "data_type": "video", "path": "/MMVU/videos/c.mp4"}, "video"),
    "frame-folder": ({**MC, "data_type": "video", "path": "frames/clip", "fps": 4}, "video"),
    "twelve-unlabelled": ({"problem_type": "multiple choice", "options": [f"choice {i}" for i in range(12)],
                           "solution": "<answer>K</answer>", "data_type": "video", "path": "videos/a.mp4"}, "video"),
    "numerical": ({"problem_type": "numerical", "solution": "<answer>3</answer>", "data_type": "video",
                   "path": "videos/a.mp4"}, "video"),
    "regression": ({"problem_type": "regression", "solution": "<answer>2.5</answer>", "data_type": "video",
                    "path": "videos/b.mp4", "original_question_type": "object_size"}, "video"),
    "free-form": ({"problem_type": "free-form", "solution": "<answer>a red square</answer>", "data_type": "image",
                   "path": "images/x.png"}, "image"),
    "ocr": ({"problem_type": "OCR", "solution": "<answer>STOP</answer>", "data_type": "image",
             "path": "images/y.jpg"}, "image"),
    "text-only": ({**MC, "data_type": "text"}, "text"),
}
SKIPPED = {  # problem_id -> (fields, words of the reason)
    "one-frame": ({**MC, "data_type": "video", "path": "videos/one.mp4"}, "needs at least 2"),
    "corrupt-image": ({**MC, "data_type": "image", "path": "images/bad.png"}, "could not build the prompt"),
    "outside-root": ({**MC, "data_type": "video", "path": "../elsewhere.mp4"}, "path outside the data root"),
    "missing": ({**MC, "data_type": "video", "path": "videos/nowhere.mp4"}, "video file not found"),
    "unknown-suffix": ({**MC, "path": "notes.txt"}, "does not say video or image"),
}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    rng = np.random.default_rng(0)
    for name, frames in (("videos/a.mp4", 6), ("videos/b.mp4", 8), ("MMVU/videos/c.mp4", 4), ("videos/one.mp4", 1)):
        write_mp4(root / name, rng.integers(0, 255, (frames, 56, 56, 3), dtype=np.uint8), fps=4)
    (root / "images").mkdir()
    for name in ("x.png", "y.jpg"):
        Image.fromarray(rng.integers(0, 255, (56, 84, 3), dtype=np.uint8)).save(root / "images" / name)
    (root / "images" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    (root / "frames" / "clip").mkdir(parents=True)
    for i in range(1, 11):
        Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8)).save(root / "frames" / "clip" / f"{i}.jpg")
    (root / "notes.txt").write_text("not media")
    lines = [json.dumps({"problem_id": pid, "problem": f"Question {pid}?", "data_source": "shapes", **fields})
             for pid, (fields, _) in {**USABLE, **SKIPPED}.items()]
    (root / "every_shape.jsonl").write_text("\n".join(lines) + "\n")
    return {"root": root, "file": root / "every_shape.jsonl",
            "checkpoint": build_tiny_checkpoint(root / "tiny", "qwen2_5_vl", seed=0)}


def test_no_modality_change(shapes):
    processor = load_processor(shapes["checkpoint"])
    data = type(DATA)(**{**vars(DATA), "max_frames": 4})
    for pid, (fields, kind) in USABLE.items():
        record = {"problem_id": pid, "problem": "Q?", "_where": pid, **fields}
        assert check_record(record, shapes["root"]) is None, pid
        prompt, reason = encode_record(processor, record, shapes["root"], data)
        assert reason == "", (pid, reason)
        has = {"video": "pixel_values_videos" in prompt.inputs, "image": "pixel_values" in prompt.inputs}
        assert has == {"video": kind == "video", "image": kind == "image"}, pid


def test_trains_two_steps_and_evaluates(shapes, tmp_path, monkeypatch, caplog):
    """Training then evaluation on every record shape, in this process (the launchers have their own tests)."""
    import logging

    from app.evaluation.evaluate import evaluate
    from app.training.trainer import main
    from tests.helpers import world_of_one

    common = ["data.max_frames=4", "data.min_pixels=3136", "data.max_pixels=3136", "data.image_max_pixels=6272",
              "data.max_skip_fraction=0.5", "data.prompt_template=video_r1"]
    monkeypatch.chdir(ROOT)
    with world_of_one(monkeypatch), caplog.at_level(logging.INFO):
        main(["configs/demo_cpu.yaml", f"model.path={shapes['checkpoint']}",
              f"data.train_file={shapes['file']}", f"train.output_dir={tmp_path / 'run'}", "train.max_steps=2",
              f"train.prompts_per_rank={len(USABLE)}", f"train.groups_per_micro_batch={len(USABLE)}",
              "rollout.group_size=2", "rollout.max_completion_length=6", "train.save_every=0",
              "logging.wandb_mode=disabled", "logging.progress_bar=false", "data.shuffle=false", *common])
    log = caplog.text
    for pid, (_, words) in SKIPPED.items():
        assert f"(problem_id {pid})" in log and words in log, pid
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()

    evaluate(tmp_path / "run" / "final", [shapes["file"]],
             [f"eval.output_dir={tmp_path / 'eval'}", "eval.max_new_tokens=6", "eval.batch_size=4", *common])
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["overall"]["count"] == len(USABLE)
    assert summary["skipped_total"] == len(SKIPPED)
    assert set(summary["by_problem_type"]) == {"multiple choice", "numerical", "regression", "free-form", "OCR"}
