"""Reading answers: what a completion (or a record's solution) says, and how one answer scores against the truth,
per problem type. Pure text functions: the record schema (``app.data``) validates solutions with them, the rewards
and the evaluation protocols score with them.

- ``reading``: the ``<answer>`` tag, option letters, numbers, OCR and free-form metrics, regression (relative error,
  MRA);
- ``grounding``: time intervals and boxes in answers, IoU, whether a grounding record can be scored;
- ``problems``: the problem types and the metric of each (``ACCURACY_BY_PROBLEM_TYPE``).

May import: ``app.common``.
Exports: ``ACCURACY_BY_PROBLEM_TYPE``, ``PROBLEM_TYPES``, ``RewardError``, ``extract_answer``, ``solution_answer``,
``option_letter``, ``parse_number``, ``parse_interval``, ``parse_box``, ``parse_boxes``, ``check_grounding_record``.
"""

from app.answers.grounding import check_grounding_record, parse_box, parse_boxes, parse_interval
from app.answers.problems import ACCURACY_BY_PROBLEM_TYPE, PROBLEM_TYPES
from app.answers.reading import RewardError, extract_answer, option_letter, parse_number, solution_answer

__all__ = ["ACCURACY_BY_PROBLEM_TYPE", "PROBLEM_TYPES", "RewardError", "check_grounding_record", "extract_answer",
           "option_letter", "parse_box", "parse_boxes", "parse_interval", "parse_number", "solution_answer"]
