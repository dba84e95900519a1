"""Evaluation protocols' scoring: how each published evaluation script reads and scores an output (Video-R1's
eval_bench.py, TimeZero's evaluate.py, VideoChat-R1's evaluate_track.py and evaluate_gqa.py, VLM-R1's
test_rec_r1.py), written from a reading of that code so that a preset of configs/eval/ reproduces its numbers,
quirks included where they change a score. ``eval.answer_extraction`` picks one (``ANSWER_EXTRACTION``); "project"
is this project's own reward code. ``IOU_SCORING``: the IoU a protocol reports beside its accuracy. A scorer marked
``needs_image_sizes`` reads ``record["_image_sizes"]``, which evaluation attaches. Pure Python.
"""

from __future__ import annotations

import ast
import math
import re

from app.answers.grounding import parse_box, parse_interval
from app.answers.reading import MRA_THRESHOLDS, RewardError, extract_answer, solution_answer
from app.rewards.rules import accuracy_of, check_problem_type

# ---- Video-R1's evaluation scoring (src/eval_bench.py), for reproducing its published numbers ----------------------
_FIRST_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


def video_r1_eval_answer(text: str) -> str:
    """What Video-R1's evaluation reads as the answer: the FIRST ``<answer>`` content, stripped, else the whole
    output (this project's own scoring takes the last closed tag and nothing without one)."""
    found = _FIRST_ANSWER.search(text)
    return found.group(1).strip() if found else text


def video_r1_eval_accuracy(completion: str, record: dict) -> float:
    """Video-R1's evaluation score of one output, transcribed from its ``reward_fn``: multiple choice by exact
    string equality of the answers; numerical equal after rounding to 2 decimals, and 0 when exactly one of the two
    is written with a decimal point or comma; regression by MRA (relative error against |truth| + 1e-8, thresholds
    0.50-0.95); every other type (OCR, free-form, grounding) 0, as that script scores them."""
    kind = record["problem_type"]
    check_problem_type(kind)
    output = video_r1_eval_answer(completion)
    found = _FIRST_ANSWER.search(str(record.get("solution", "")))
    truth = found.group(1).strip() if found else ""

    def number(text: str) -> float | None:
        try:
            return float(text.replace(",", ""))
        except ValueError:
            return None

    if kind == "multiple choice":
        return float(output.strip() == truth.strip())
    if kind == "numerical":
        if (("." in truth) or ("," in truth)) != (("." in output) or ("," in output)):
            return 0.0
        p, t = number(output), number(truth)
        return float(p is not None and t is not None and round(t, 2) == round(p, 2))
    if kind == "regression":
        p, t = number(output), number(truth)
        if p is None or t is None:
            return 0.0
        relative = abs(p - t) / (abs(t) + 1e-8)
        return sum(relative < 1 - theta for theta in MRA_THRESHOLDS) / len(MRA_THRESHOLDS)
    return 0.0


_TIMEZERO_SPAN = re.compile(r"(\d+\.?\d*) (to|and) (\d+\.?\d*)")
_TIMEZERO_ANSWER = re.compile(r"<answer>(.*?)</answer>")


def timezero_answer(text: str) -> str:
    """The span TimeZero's evaluation reads (evaluate.py parse_timestamp_output): the LAST "a to b" / "a and b" in
    the whole output, else in its first <answer>; "" when there is none."""
    spans = _TIMEZERO_SPAN.findall(text)
    if not spans:
        found = _TIMEZERO_ANSWER.search(text)
        spans = _TIMEZERO_SPAN.findall(found.group(1).strip()) if found else []
    return f"{spans[-1][0]} to {spans[-1][2]}" if spans else ""


def timezero_accuracy(completion: str, record: dict) -> float:
    """TimeZero's score of one output: its IoU with the record's span, as its evaluation computes it (the ends as
    written, not reordered; no clamp to the video's duration; 0 when no span is read, and never below 0)."""
    answer = timezero_answer(completion)
    truth = parse_interval(solution_answer(str(record.get("solution", ""))))
    if not answer or truth is None:
        return 0.0
    sp, _, ep = answer.partition(" to ")
    sp, ep = float(sp), float(ep)
    s, e = truth
    union = max(e, ep) - min(s, sp)
    return max((min(e, ep) - max(s, sp)) / union, 0.0) if union > 0 else 0.0


_FIRST_ANSWER_RAW = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def videochat_r1_answer(text: str) -> str:
    """What VideoChat-R1's tracking and NExT-GQA evaluations read: the first ``<answer>`` content, as written ("" without
    one)."""
    found = _FIRST_ANSWER_RAW.search(text)
    return found.group(1) if found else ""


def _literal_boxes(text: str, count: int | None = None) -> list[list[float]] | None:
    """A Python list literal of ``count`` (None: any number, at least one) lists of 4 numbers (newlines removed
    first), as VideoChat-R1's ``is_valid_list_of_lists`` accepts it; ``ast.literal_eval`` reads literals only,
    never code."""
    try:
        boxes = ast.literal_eval(text.replace("\n", ""))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    if not (isinstance(boxes, list) and boxes and len(boxes) == (count or len(boxes)) and all(isinstance(b, list) and len(b) == 4
                                                                      for b in boxes)):
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for b in boxes for v in b):
        return None  # (VideoChat-R1's script would stop on a string inside a box; here it scores 0)
    return [[float(v) for v in b] for b in boxes]


def _videochat_iou(a: list[float], b: list[float]) -> float:
    """VideoChat-R1's calculate_iou: corners as written (not reordered), 0 when the union is 0."""
    inter = max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union != 0 else 0.0


def videochat_r1_track_accuracy(completion: str, record: dict) -> float:
    """VideoChat-R1's tracking score of one output (src_eval/evaluate_track.py): the first ``<answer>`` must hold
    a list of as many ``[x0, y0, x1, y1]`` lists as the reference (8 in its GOT-10k file); the score is the mean
    over frames of its IoU; anything else 0."""
    kind = record["problem_type"]
    if kind != "object tracking":
        raise RewardError(f"eval.answer_extraction=videochat_r1_track scores 'object tracking' records only "
                          f"(VideoChat-R1's evaluate_track.py); this record's problem_type is {kind!r}")
    reference = solution_answer(str(record.get("solution", "")))
    truth = _literal_boxes(reference)
    if truth is None:
        raise RewardError(f"object tracking solution {reference[:80]!r} is not a list of [x0, y0, x1, y1] boxes")
    boxes = _literal_boxes(videochat_r1_answer(completion), len(truth))
    if boxes is None:
        return 0.0
    return sum(_videochat_iou(p, t) for p, t in zip(boxes, truth)) / len(truth)


_VIDEOCHAT_PREFIXES = ("The best answer is", "The correct answer is", "The answer is", "The answer",
                       "The best option is", "The correct option is", "Best answer:" "Best option:")  # its list
_GLUE = re.compile(r"<glue>(.*?)</glue>", re.DOTALL)
_GLUE_FORMAT = re.compile(r"^\[(\(\d+(\.\d+)?,\s*\d+(\.\d+)?\)(,\s*\(\d+(\.\d+)?,\s*\d+(\.\d+)?\))*(,)?|)\]$")


def videochat_r1_letter(text: str) -> str:
    """VideoChat-R1's extract_characters_regex (evaluate_gqa.py): answer phrases removed, "" for more than 10 words
    without a letter A-G, else the first capital A-G anywhere."""
    text = text.strip()
    for prefix in _VIDEOCHAT_PREFIXES:
        text = text.replace(prefix, "")
    if len(text.split()) > 10 and not re.search("[ABCDEFG]", text):
        return ""
    found = re.search(r"[ABCDEFG]", text)
    return found[0] if found else ""


def videochat_r1_gqa_accuracy(completion: str, record: dict) -> float:
    """VideoChat-R1's NExT-GQA answer score: the letter of its first ``<answer>`` equals the reference's."""
    kind = record["problem_type"]
    if kind != "multiple choice":
        raise RewardError(f"eval.answer_extraction=videochat_r1_gqa scores 'multiple choice' records only "
                          f"(VideoChat-R1's evaluate_gqa.py); this record's problem_type is {kind!r}")
    found = _FIRST_ANSWER_RAW.search(completion)
    truth = videochat_r1_letter(solution_answer(str(record.get("solution", ""))))
    return float(found is not None and videochat_r1_letter(found.group(1)) == truth)


def merged_spans(spans) -> list[list[float]]:
    """Spans sorted by start, overlapping or touching ones merged."""
    merged: list[list[float]] = []
    for start, end in sorted(([float(a), float(b)] for a, b in spans), key=lambda span: span[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def spans_iou(prediction, truth) -> float:
    """The IoU of two sets of time spans, each merged first (VideoChat-R1's compute_iou; 1 when both are empty)."""
    a, b = merged_spans(prediction), merged_spans(truth)
    inter, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        inter += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    union = sum(e - s for s, e in a) + sum(e - s for s, e in b) - inter
    return inter / union if union != 0 else 1.0


def videochat_r1_gqa_evidence(completion: str, record: dict) -> float:
    """VideoChat-R1's NExT-GQA grounding score: the first ``<glue>`` must be a list of (start, end) tuples written as
    its format check wants them ("[(5.2, 10.4), (12, 14)]", starts not after ends); the IoU of its merged spans with
    the record's ``evidence`` spans; else 0."""
    found = _GLUE.search(completion)
    if not found or not _GLUE_FORMAT.match(found.group(1)):
        return 0.0
    try:
        spans = ast.literal_eval(found.group(1))
    except (ValueError, SyntaxError):
        return 0.0
    if not all(isinstance(span, tuple) and len(span) == 2 and span[0] <= span[1] for span in spans):
        return 0.0
    return spans_iou(spans, record["evidence"])


# ---- VLM-R1's referring-expression evaluation (src/eval/test_rec_r1.py): a box in the model's input pixels -------
_VLM_R1_BOX = re.compile(r"\{.*\[(\d+),\s*(\d+),\s*(\d+),\s*(\d+)]\s*.*\}", re.DOTALL)


def vlm_r1_rec_box(text: str) -> list[int]:
    """The box VLM-R1's extract_bbox_answer reads: in the first <answer>, a JSON-like {...} holding [x1, y1, x2, y2]
    in whole numbers (the last such box: its pattern is greedy); [0, 0, 0, 0] when there is none."""
    found = _FIRST_ANSWER_RAW.search(text)
    box = _VLM_R1_BOX.search(found.group(1).strip()) if found else None
    return [int(box.group(i)) for i in range(1, 5)] if box else [0, 0, 0, 0]


def vlm_r1_rec_iou(completion: str, record: dict) -> float:
    """VLM-R1's IoU of the output's box, rescaled from the model's input size (the processor's resized image) to the
    image's own size, with the record's box in the image's pixels; its convention: the intersection counts
    whole pixels inclusive (x2 - 1 ... ), the union does not."""
    sizes = record.get("_image_sizes")
    if not sizes:
        raise RewardError("eval.answer_extraction=vlm_r1_rec rescales boxes from the model's input size: the record "
                          "needs one image (data_type image)")
    image_height, image_width, input_height, input_width = sizes[0]
    b = vlm_r1_rec_box(completion)
    b = [b[0] / input_width * image_width, b[1] / input_height * image_height, b[2] / input_width * image_width,
         b[3] / input_height * image_height]
    reference = solution_answer(str(record.get("solution", "")))
    t = parse_box(reference)
    if t is None:
        raise RewardError(f"spatial grounding solution {reference[:80]!r} is not one [x1, y1, x2, y2] box")
    x1, y1, x2, y2 = max(b[0], t[0]), max(b[1], t[1]), min(b[2] - 1, t[2] - 1), min(b[3] - 1, t[3] - 1)
    inter = (x2 - x1 + 1) * (y2 - y1 + 1) if x1 < x2 and y1 < y2 else 0
    union = (b[2] - b[0]) * (b[3] - b[1]) + (t[2] - t[0]) * (t[3] - t[1]) - inter
    return inter / union if union != 0 else 0.0


def vlm_r1_rec_accuracy(completion: str, record: dict) -> float:
    """VLM-R1's accuracy of one output: its IoU above 0.5 (strictly)."""
    kind = record["problem_type"]
    if kind != "spatial grounding":
        raise RewardError(f"eval.answer_extraction=vlm_r1_rec scores 'spatial grounding' records only (VLM-R1's "
                          f"test_rec_r1.py); this record's problem_type is {kind!r}")
    return float(vlm_r1_rec_iou(completion, record) > 0.5)


vlm_r1_rec_accuracy.needs_image_sizes = True
vlm_r1_rec_iou.needs_image_sizes = True


ANSWER_EXTRACTION = {  # name -> (score of an output, the answer it read)
    # this project's scoring (the trainer's reward code; regression by MRA, as evaluations report it)
    "project": (lambda completion, record: accuracy_of(completion, record, regression="mra"),
                lambda completion: extract_answer(completion) or ""),
    "video_r1": (video_r1_eval_accuracy, video_r1_eval_answer),  # Video-R1's evaluation script, to reproduce it
    "timezero": (timezero_accuracy, timezero_answer),  # TimeZero's temporal-grounding evaluation
    "videochat_r1_track": (videochat_r1_track_accuracy, videochat_r1_answer),  # VideoChat-R1's GOT-10k
    "videochat_r1_gqa": (videochat_r1_gqa_accuracy, videochat_r1_answer),  # VideoChat-R1's NExT-GQA
    "vlm_r1_rec": (vlm_r1_rec_accuracy, lambda completion: str(vlm_r1_rec_box(completion))),  # VLM-R1's RefCOCO
}
# eval.answer_extraction -> the IoU evaluation reports beside an accuracy that is not one: NExT-GQA's evidence spans
# (for records with ``evidence``), VLM-R1's boxes (its accuracy is IoU > 0.5). Other grounding scores are the IoU.
IOU_SCORING = {"videochat_r1_gqa": videochat_r1_gqa_evidence, "vlm_r1_rec": vlm_r1_rec_iou}
