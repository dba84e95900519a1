"""The problem types a record may have, and the metric that scores one answer of each against the record's truth
(``ACCURACY_BY_PROBLEM_TYPE``): the record schema's list (``app.data.records`` refuses other types) and the rewards'
table are this one.
"""

from __future__ import annotations

from collections.abc import Callable

from app.answers.grounding import GROUNDING_TYPES, _object_tracking, _spatial_grounding, _temporal_grounding
from app.answers.reading import _free_form, _multiple_choice, _numerical, _ocr, _regression

ACCURACY_BY_PROBLEM_TYPE: dict[str, Callable[[str, str], float]] = {
    "multiple choice": _multiple_choice,
    "numerical": _numerical,
    "OCR": _ocr,
    "free-form": _free_form,
    "regression": _regression,
    "temporal grounding": _temporal_grounding,
    "spatial grounding": _spatial_grounding,
    "object tracking": _object_tracking,
}
NEEDS_RECORD = GROUNDING_TYPES  # metrics that read the record (duration, box_format) besides the two answers
PROBLEM_TYPES = tuple(ACCURACY_BY_PROBLEM_TYPE)
