"""Benchmark annotation files -> this project's records (JSONL), so evaluation and training read them as they read
Video-R1's.

    python -m app.data.convert FORMAT ANNOTATION.json --videos DIR --out records.jsonl

``charades_sta`` / ``activitynet_captions``: the temporal-grounding test annotations as TimeZero (www-Ye/TimeZero,
dataset/charades-sta/*.json, dataset/activitynet/test.json) and its successors ship them,
``{video_id: {"duration": s, "timestamps": [[start, end], ...], "sentences": [...]}}``; one record per sentence
(kept verbatim, leading space included, as TimeZero puts it into its prompt), ``problem_type: "temporal
grounding"``, the span as its solution, the video's duration (the reward reads it), the video found as
``DIR/<video_id>.mp4`` (or .mkv, .webm, as TimeZero looks for it).

``videochat_r1_got10k``: GOT-10k tracking as VideoChat-R1 (OpenGVLab/VideoChat-R1, Annotations/Got/got_val.json)
ships it, ``[{"path": ".../GOT-10k_Val_000010", "object": "sloth", "gt": [[x0, y0, x1, y1] x 8]}]`` with
normalised boxes; one record per entry, ``problem_type: "object tracking"``, the boxes as its solution, the first
one as its ``initial_box``, the frame folder found as ``DIR/<last part of path>``, and ``frame_sampling:
"videochat_r1_track"``: its 8 boxes belong to the 8 frames VideoChat-R1's script picks from the folder.

``videochat_r1_nextgqa``: NExT-GQA grounded QA as VideoChat-R1 ships it (Annotations/NextGQA/nextgqa_test.json),
``[{"id", "video": "1101/2574374895.mp4", "question", "options": ["(A) ...", ...], "duration", "glue": [[s, e],
...], "type", "answer": "(C)"}]``; one ``multiple choice`` record per entry, the answer's letter as its solution, the
glue spans (seconds) as its ``evidence``, the question type (TN, CW, ...) as ``original_question_type``.

``vlm_r1_rec``: a referring-expression file as VLM-R1 ships them (rec_jsons_processed/refcoco_val.json, ...),
``[{"image": "train2014/COCO_....jpg", "problem": "...", "solution": [x1, y1, x2, y2], ...}]`` with the box in the
image's pixels; one ``spatial grounding`` image record per entry. Its evaluation shuffles the list with
``random.seed(42)`` and keeps the first 2,000 (``--sample``, 0 keeps all): the records are that subset, in that
order.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

VIDEO_EXTENSIONS = ("mp4", "mkv", "webm")


class ConvertError(ValueError):
    """An annotation file that cannot be converted (the message names the file and the entry)."""


def read_annotation(annotation: Path, kind: type, what: str):
    """The annotation file's JSON, which must be a ``kind`` (dict or list); else an error naming the file."""
    try:
        data = json.loads(annotation.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConvertError(f"{annotation}: cannot be read as JSON ({error})") from None
    if not isinstance(data, kind):
        raise ConvertError(f"{annotation}: expected {what}")
    return data


def temporal_grounding(annotation: Path, videos: Path, source: str) -> tuple[list[dict], list[str]]:
    """(records, the video ids whose file is missing: their sentences are left out, as TimeZero leaves them)."""
    data = read_annotation(annotation, dict, "an object of video id -> annotation")
    records, missing = [], []
    for vid, entry in data.items():
        where = f"{annotation}: video {vid!r}"
        try:
            duration = float(entry.get("duration", entry.get("video_duration")))
            spans, sentences = entry["timestamps"], entry["sentences"]
        except (AttributeError, KeyError, TypeError, ValueError):
            raise ConvertError(f"{where} lacks duration, timestamps or sentences") from None
        if len(spans) != len(sentences):
            raise ConvertError(f"{where} has {len(spans)} timestamps but {len(sentences)} sentences")
        path = next((f"{vid}.{ext}" for ext in VIDEO_EXTENSIONS if (videos / f"{vid}.{ext}").is_file()), None)
        if path is None:
            missing.append(vid)
            continue
        for i, (span, sentence) in enumerate(zip(spans, sentences)):
            if not (isinstance(span, list) and len(span) == 2):
                raise ConvertError(f"{where}, sentence {i}: timestamp {span!r} is not [start, end]")
            start, end = (float(v) for v in span)
            if not isinstance(sentence, str) or not sentence.strip():
                raise ConvertError(f"{where}, sentence {i}: {sentence!r} is not a sentence")
            records.append({"problem_id": f"{vid}_{i}", "problem": sentence,
                            "problem_type": "temporal grounding", "data_type": "video", "path": path,
                            "solution": f"<answer>[{start}, {end}]</answer>", "duration": duration,
                            "data_source": source})
    return records, missing


def videochat_r1_tracking(annotation: Path, videos: Path, source: str = "got10k") -> tuple[list[dict], list[str]]:
    """(records, the frame folders not found under ``videos``: their entries are left out)."""
    data = read_annotation(annotation, list, "a list of {path, object, gt} entries")
    records, missing = [], []
    for i, entry in enumerate(data):
        where = f"{annotation}[{i}]"
        try:
            folder, name, boxes = Path(str(entry["path"])).name, entry["object"], entry["gt"]
        except (KeyError, TypeError):
            raise ConvertError(f"{where} lacks path, object or gt") from None
        if not isinstance(name, str) or not name.strip():
            raise ConvertError(f"{where} ({folder}): object {name!r} is not a name")
        if not (isinstance(boxes, list) and boxes and all(
                isinstance(b, list) and len(b) == 4 and all(isinstance(v, (int, float)) and 0 <= v <= 1 for v in b)
                for b in boxes)):
            raise ConvertError(f"{where} ({folder}): gt is not a list of normalised [x0, y0, x1, y1] boxes")
        if not (videos / folder).is_dir():
            missing.append(folder)
            continue
        records.append({"problem_id": folder,
                        "problem": f'Track the "{name}" in the video, starting from its box {boxes[0]} in the first '
                                   "frame (normalised coordinates).",
                        "problem_type": "object tracking", "data_type": "video", "path": folder,
                        "solution": f"<answer>{json.dumps(boxes)}</answer>", "box_format": "normalized",
                        "object": name, "initial_box": boxes[0], "frame_sampling": "videochat_r1_track",
                        "data_source": source})
    return records, missing


def videochat_r1_grounded_qa(annotation: Path, videos: Path, source: str = "nextgqa") -> tuple[list[dict], list[str]]:
    """(records, the videos not found under ``videos``: their questions are left out)."""
    import re

    data = read_annotation(annotation, list, "a list of NExT-GQA entries")
    records, missing = [], []
    for i, entry in enumerate(data):
        where = f"{annotation}[{i}]"
        try:
            video, question, options, spans, answer = (entry[k] for k in ("video", "question", "options", "glue",
                                                                          "answer"))
        except (KeyError, TypeError):
            raise ConvertError(f"{where} lacks video, question, options, glue or answer") from None
        letter = re.fullmatch(r"\(?([A-Z])\)?", str(answer).strip())
        if letter is None:
            raise ConvertError(f"{where} ({video}): answer {answer!r} is not an option letter like (C)")
        if not (isinstance(options, list) and len(options) > ord(letter[1]) - 65):
            raise ConvertError(f"{where} ({video}): options {options!r} do not reach the answer {answer!r}")
        if not (isinstance(spans, list) and spans and all(
                isinstance(s, list) and len(s) == 2 and all(isinstance(v, (int, float)) for v in s) and 0 <= s[0] <= s[1]
                for s in spans)):
            raise ConvertError(f"{where} ({video}): glue {spans!r} is not a list of [start, end] spans in seconds")
        if not (videos / video).is_file():
            missing.append(video)
            continue
        records.append({"problem_id": entry.get("id", i), "problem": question, "problem_type": "multiple choice",
                        "options": options, "data_type": "video", "path": video,
                        "solution": f"<answer>{letter[1]}</answer>", "evidence": spans,
                        "duration": entry.get("duration"), "original_question_type": entry.get("type"),
                        "data_source": source})
    return records, missing


def vlm_r1_rec(annotation: Path, images: Path, source: str = "", sample: int = 2000) -> tuple[list[dict], list[str]]:
    """(records, the images not found under ``images``: left out after the subset is drawn, as they would fail
    there)."""
    import random

    data = read_annotation(annotation, list, "a list of {image, problem, solution} entries")
    rng = random.Random(42)  # its random.seed(42); random.shuffle(data); data[:2000]
    order = list(range(len(data)))
    rng.shuffle(order)
    records, missing = [], []
    for i in order[:sample] if sample else order:
        entry, where = data[i], f"{annotation}[{i}]"
        try:
            image, problem, box = entry["image"], entry["problem"], entry["solution"]
        except (KeyError, TypeError):
            raise ConvertError(f"{where} lacks image, problem or solution") from None
        if not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) and v >= 0 for v in box)):
            raise ConvertError(f"{where} ({image}): solution {box!r} is not one [x1, y1, x2, y2] box in pixels")
        if not (images / image).is_file():
            missing.append(image)
            continue
        records.append({"problem_id": i, "problem": problem, "problem_type": "spatial grounding",
                        "data_type": "image", "path": image, "solution": f"<answer>{box}</answer>",
                        "box_format": "pixel", "data_source": source or annotation.stem})
    return records, missing


FORMATS = {name: partial(temporal_grounding, source=name) for name in ("charades_sta", "activitynet_captions")}
FORMATS["vlm_r1_rec"] = vlm_r1_rec
FORMATS["videochat_r1_got10k"] = videochat_r1_tracking
FORMATS["videochat_r1_nextgqa"] = videochat_r1_grounded_qa


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.data.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("format", choices=sorted(FORMATS))
    parser.add_argument("annotation", type=Path)
    parser.add_argument("--videos", "--images", type=Path, required=True,
                        help="the folder of the benchmark's videos (or images)")
    parser.add_argument("--sample", type=int, default=None,
                        help="vlm_r1_rec: how many of the shuffled entries to keep (default 2000, as VLM-R1's "
                             "evaluation; 0 keeps all)")
    parser.add_argument("--out", type=Path, required=True, help="the records file to write (JSONL)")
    args = parser.parse_args(argv)
    try:
        extra = {"sample": args.sample} if args.sample is not None else {}
        if extra and args.format != "vlm_r1_rec":
            raise ConvertError("--sample applies to vlm_r1_rec only")
        records, missing = FORMATS[args.format](args.annotation, args.videos, **extra)
    except ConvertError as error:
        print(f"convert error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"{len(records)} records written to {args.out}" + (f"; {len(missing)} videos not found in {args.videos} "
                                                            f"(their entries left out): {', '.join(missing[:5])}"
                                                            f"{' ...' if len(missing) > 5 else ''}" if missing else ""))


if __name__ == "__main__":
    main()
