"""Grounding answers: a time interval in seconds (temporal grounding), a box (spatial grounding) or one box per
sampled frame (object tracking), parsed in the forms models write, scored by IoU against the reference; the metrics
grounding papers report (mIoU, R@0.3/0.5/0.7), and the check that a grounding record can be scored at all. Pure
Python.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from app.answers.reading import _MINUS, solution_answer

# ---- grounding: a time interval in seconds, or a box; IoU against the reference -----------------------------------
_CLOCK = re.compile(r"(?<![\d.:])(\d+):([0-5]\d)(?::([0-5]\d(?:\.\d+)?))?(?![\d:])")  # m:ss, h:mm:ss(.s)
_SECONDS = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?|\.\d+)\s*(?:s|sec|secs|second|seconds)?(?![\w.])", re.IGNORECASE)
_BOX_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+(?:\.\d+)?|\.\d+)(?![\w.])")
BOX_FORMATS = {"pixel": None, "normalized": 1.0, "normalized_1000": 1000.0}  # record["box_format"] -> coordinate range


def _clock_seconds(match: re.Match) -> float:
    a, b, c = match.groups()
    return int(a) * 3600 + int(b) * 60 + float(c) if c is not None else int(a) * 60 + int(b)


def parse_interval(text: str) -> tuple[float, float] | None:
    """A time span in seconds from what a model writes: "[3.2, 7.5]", "3.2 - 7.5", "from 3.2s to 7.5s", "3.2 to
    7.5 seconds", "(7.5, 3.2)" (ends swapped: put in order), "0:03 - 1:15" (clock times). None when it is not
    exactly two times (one number, three, a list of spans), or a time is negative or not finite."""
    text = text.translate(_MINUS)
    if re.search(r"(?<![\w])-\s*\d", text.replace(" - ", " to ").replace("–", " to ")):
        return None  # a negative time
    values, rest = [], text
    for match in _CLOCK.finditer(text):
        values.append(_clock_seconds(match))
    rest = _CLOCK.sub(" ", rest)
    values += [float(m.group(1)) for m in _SECONDS.finditer(rest)]
    if len(values) != 2 or not all(math.isfinite(v) for v in values):
        return None
    start, end = sorted(values)
    return start, end


def temporal_iou(prediction: tuple[float, float], truth: tuple[float, float]) -> float:
    """Intersection over union of two spans (0 when they do not meet; two equal points: 1)."""
    inter = max(0.0, min(prediction[1], truth[1]) - max(prediction[0], truth[0]))
    union = max(prediction[1], truth[1]) - min(prediction[0], truth[0]) if inter > 0 else \
        (prediction[1] - prediction[0]) + (truth[1] - truth[0])
    if union <= 0:
        return float(prediction == truth)
    return inter / union


def parse_box(text: str, limit: float | None = None) -> tuple[float, float, float, float] | None:
    """A box [x1, y1, x2, y2] from what a model writes: brackets or parentheses or none, commas or spaces,
    corners in either order (put in order per axis). None unless exactly four coordinates, each >= 0 and, for a
    normalised ``limit`` (1 or 1000), at most it: a box of 5 numbers, two boxes, or pixel values where the record
    asks normalised ones are refused, not guessed."""
    numbers = [float(n) for n in _BOX_NUMBER.findall(text.translate(_MINUS))]
    if len(numbers) != 4 or not all(math.isfinite(v) and v >= 0 for v in numbers):
        return None
    if limit is not None and any(v > limit for v in numbers):
        return None
    x1, x2 = sorted(numbers[0::2])
    y1, y2 = sorted(numbers[1::2])
    return x1, y1, x2, y2


def box_iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    inter = max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else float(a == b)


_BOX_GROUP = re.compile(r"[\[(]([^\[\]()]*)[\])]")  # an innermost bracketed or parenthesised group


def parse_boxes(text: str, limit: float | None = None) -> list[tuple[float, float, float, float]] | None:
    """One box per frame from what a model writes: "[[x1, y1, x2, y2], [..], ...]", "(x1, y1, x2, y2), (..)", or
    one box per line. Each box as ``parse_box`` reads it (corners put in order, in the ``limit``'s range). None
    when any group is not exactly one box, or there is none: a flat run of numbers is not split into boxes by
    guessing."""
    text = text.translate(_MINUS)
    groups = _BOX_GROUP.findall(text)
    if not groups:
        groups = [line for line in text.splitlines() if line.strip()]
        if len(groups) < 2:  # one line of numbers: a single box is spatial grounding's answer, not a track
            return None
    boxes = [parse_box(group, limit) for group in groups]
    return boxes if all(box is not None for box in boxes) else None


def _temporal_grounding(pred: str, truth: str, record: dict | None = None) -> float:
    p, t = parse_interval(pred), parse_interval(truth)
    if p is None or t is None:
        return 0.0
    duration = (record or {}).get("duration")
    if duration:  # the video's length: a span past its end counts to the end (asking for more gains nothing)
        p = (min(p[0], float(duration)), min(p[1], float(duration)))
    return temporal_iou(p, t)


def _spatial_grounding(pred: str, truth: str, record: dict | None = None) -> float:
    limit = BOX_FORMATS[(record or {}).get("box_format", "pixel")]
    p, t = parse_box(pred, limit), parse_box(truth, limit)
    return box_iou(p, t) if p is not None and t is not None else 0.0


def _object_tracking(pred: str, truth: str, record: dict | None = None) -> float:
    """The mean IoU over the frames of the answer's boxes with the reference boxes, frame by frame (VideoChat-R1's
    average overlap); 0 unless the answer has exactly one box per reference frame."""
    limit = BOX_FORMATS[(record or {}).get("box_format", "pixel")]
    p, t = parse_boxes(pred, limit), parse_boxes(truth, limit)
    if p is None or t is None or len(p) != len(t):
        return 0.0
    return sum(box_iou(a, b) for a, b in zip(p, t)) / len(t)


GROUNDING_TYPES = ("temporal grounding", "spatial grounding", "object tracking")
RECALL_THRESHOLDS = (0.3, 0.5, 0.7)  # R@IoU the grounding papers report, beside mIoU


def grounding_metrics(ious: Sequence[float]) -> dict[str, float]:
    """mIoU and R@0.3/0.5/0.7 (the fraction with IoU >= the threshold) of a set of predictions."""
    n = max(len(ious), 1)
    out = {"mIoU": sum(ious) / n}
    out.update({f"R@{t}": sum(iou >= t for iou in ious) / n for t in RECALL_THRESHOLDS})
    return out


def check_grounding_record(record: dict) -> str | None:
    """Why a grounding record cannot be scored (its solution does not parse, an unknown box_format), or None."""
    kind = record.get("problem_type")
    truth = solution_answer(str(record.get("solution", "")))
    evidence = record.get("evidence")  # grounded QA: the time spans that support the answer
    if evidence is not None and not (isinstance(evidence, list) and all(
            isinstance(span, list) and len(span) == 2 and all(isinstance(v, (int, float)) and math.isfinite(v)
                                                              and v >= 0 for v in span) and span[0] <= span[1]
            for span in evidence)):
        return f"evidence {str(evidence)[:80]} is not a list of [start, end] spans in seconds"
    if kind == "temporal grounding":
        span = parse_interval(truth)
        if span is None:
            return f"temporal grounding solution {truth!r} is not one [start, end] in seconds"
        duration = record.get("duration")
        if duration is not None and (not isinstance(duration, (int, float)) or span[1] > float(duration) + 1e-6):
            return f"temporal grounding solution {truth!r} ends past the record's duration {duration!r}"
    elif kind in ("spatial grounding", "object tracking"):
        box_format = record.get("box_format", "pixel")
        if box_format not in BOX_FORMATS:
            return f"unknown box_format {box_format!r} (known: {', '.join(BOX_FORMATS)})"
        if kind == "spatial grounding" and parse_box(truth, BOX_FORMATS[box_format]) is None:
            return f"spatial grounding solution {truth!r} is not one [x1, y1, x2, y2] box in {box_format} coordinates"
        if kind == "object tracking" and parse_boxes(truth, BOX_FORMATS[box_format]) is None:
            return (f"object tracking solution {truth[:80]!r} is not a list of [x1, y1, x2, y2] boxes (one per frame) "
                    f"in {box_format} coordinates")
    return None
