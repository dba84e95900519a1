"""Rule-based rewards: format, accuracy per problem type, plug-ins; group-level length and temporal bonuses.
Pure Python, no model code.

A reward function takes the decoded completions and their records and returns one float per completion:
``fn(completions: list[str], records: list[dict]) -> list[float]``. Custom ones load from
``path/to/file.py:function``. The length and temporal bonuses look at a whole group (Video-R1's rules by default,
``BONUS_RULES``).
"""

from __future__ import annotations

import ast
import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.answers import (
    FORMAT_PATTERN,
    MRA_THRESHOLDS,
    REGRESSION_METRICS,
    RewardError,
    _free_form,
    _multiple_choice,
    _numerical,
    _ocr,
    _regression,
    extract_answer,
    solution_answer,
)
from app.grounding import GROUNDING_TYPES, _object_tracking, _spatial_grounding, _temporal_grounding, parse_interval
from app.groups import group_slices
from app.plugins import load_function

RewardFn = Callable[[list[str], list[dict]], list[float]]

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


def check_problem_type(problem_type: str) -> None:
    if problem_type not in ACCURACY_BY_PROBLEM_TYPE:
        raise RewardError(f"unknown problem_type {problem_type!r}; known: {', '.join(PROBLEM_TYPES)}")


def accuracy_of(completion: str, record: dict, regression: str = "relative_error") -> float:
    """Accuracy of one completion: 0 without a closed ``<answer>`` tag, else the problem type's metric.
    ``regression``: ``relative_error`` (training, Video-R1's reward) or ``mra`` (evaluation, VSI-Bench's MRA)."""
    check_problem_type(record["problem_type"])
    if regression not in REGRESSION_METRICS:
        raise RewardError(f"unknown regression metric {regression!r}; expected one of {sorted(REGRESSION_METRICS)}")
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    truth = solution_answer(record["solution"])
    if not truth or not answer:  # an empty reference is matched by an empty answer only (and vice versa)
        return float(not truth and not answer)
    if record["problem_type"] == "regression":
        return _regression(answer, truth, regression)
    if record["problem_type"] in NEEDS_RECORD:
        return ACCURACY_BY_PROBLEM_TYPE[record["problem_type"]](answer, truth, record)
    return ACCURACY_BY_PROBLEM_TYPE[record["problem_type"]](answer, truth)


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


def videochat_r1_track_answer(text: str) -> str:
    """What VideoChat-R1's tracking evaluation reads: the first ``<answer>`` content, as written ("" without one)."""
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
    boxes = _literal_boxes(videochat_r1_track_answer(completion), len(truth))
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


ANSWER_EXTRACTION = {  # name -> (score of an output, the answer it read)
    # this project's scoring (the trainer's reward code; regression by MRA, as evaluations report it)
    "project": (lambda completion, record: accuracy_of(completion, record, regression="mra"),
                lambda completion: extract_answer(completion) or ""),
    "video_r1": (video_r1_eval_accuracy, video_r1_eval_answer),  # Video-R1's evaluation script, to reproduce it
    "timezero": (timezero_accuracy, timezero_answer),  # TimeZero's temporal-grounding evaluation
    "videochat_r1_track": (videochat_r1_track_accuracy, videochat_r1_track_answer),  # VideoChat-R1's GOT-10k
    "videochat_r1_gqa": (videochat_r1_gqa_accuracy, videochat_r1_track_answer),  # VideoChat-R1's NExT-GQA
}
# eval.answer_extraction -> the IoU of the time spans an output names as its evidence with a record's ``evidence``
# (grounded QA); evaluation reports it beside the accuracy for records that have evidence spans.
EVIDENCE_SCORING = {"videochat_r1_gqa": videochat_r1_gqa_evidence}


def format_reward(completions: list[str], records: list[dict]) -> list[float]:
    return [float(bool(FORMAT_PATTERN.match(c))) for c in completions]


def accuracy_reward(completions: list[str], records: list[dict], regression: str = "relative_error") -> list[float]:
    return [accuracy_of(c, r, regression) for c, r in zip(completions, records)]


def load_plugin(spec: str) -> RewardFn:
    """Load ``path/to/file.py:function``."""
    return load_function(spec, "custom reward", RewardError)


def build_rewards(names: Sequence[str], weights: Sequence[float] = (), regression: str = "relative_error",
                  judge=None) -> list[tuple[str, RewardFn, float]]:
    """Resolve reward names into (name, function, weight); ``regression`` is the accuracy metric of regression
    answers (``REGRESSION_METRICS``); ``judge``: the model judge ``judge`` names (``app.judge``), built by the
    caller (this module loads no model)."""
    weights = list(weights) or [1.0] * len(names)
    if len(weights) != len(names):
        raise RewardError(f"{len(weights)} reward weights for {len(names)} reward functions")
    resolved = []
    for name, weight in zip(names, weights):
        if name == "format":
            fn = format_reward
        elif name == "accuracy":
            fn = functools.partial(accuracy_reward, regression=regression)
        elif name == "judge":
            if judge is None:
                raise RewardError("reward 'judge' needs a judge model (rewards.judge_path)")
            fn = judge
        elif ":" in name:
            fn = load_plugin(name)
        else:
            hint = " (the length bonus is rewards.length=true now)" if name == "length" else ""
            raise RewardError(f"unknown reward function {name!r}; use format, accuracy, judge or file.py:function{hint}")
        resolved.append((name, fn, float(weight)))
    return resolved


def score(rewards: list[tuple[str, RewardFn, float]], completions: list[str], records: list[dict],
          group_sizes: Sequence[int] | None = None) -> dict[str, list[float]]:
    """Per reward name, one value per completion (unweighted). Non-finite values are refused. A function marked
    ``group_aware`` (the judge) also gets the group sizes."""
    out = {}
    for name, fn, _ in rewards:
        if getattr(fn, "group_aware", False):
            values = [float(v) for v in fn(completions, records, list(group_sizes or [len(completions)]))]
        else:
            values = [float(v) for v in fn(completions, records)]
        if len(values) != len(completions):
            raise RewardError(f"reward {name!r} returned {len(values)} values for {len(completions)} completions")
        bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            raise RewardError(f"reward {name!r} returned a non-finite value for completion {bad[0]}")
        out[name] = values
    return out


@dataclass(frozen=True)
class BonusRules:
    """When the group-level bonuses (length, temporal) apply."""

    correct_above: float  # a completion is "correct" when its accuracy exceeds this
    temporal_at_least: bool  # temporal bonus when ordered >= ratio x shuffled (else strictly >)


BONUS_RULES = {
    # Video-R1 (src/r1-v/src/open_r1/trainer/grpo_trainer.py): accuracy > 0.1, `acc_mean >= 0.8 * shuffled_acc_mean`.
    "video_r1": BonusRules(correct_above=0.1, temporal_at_least=True),
    # This project's first rules: partial free-form matches (ROUGE 0.1-0.5) are not "correct"; a tie earns nothing.
    "strict": BonusRules(correct_above=0.5, temporal_at_least=False),
}


def _rules(name: str) -> BonusRules:
    if name not in BONUS_RULES:
        raise RewardError(f"unknown bonus rules {name!r}; expected one of {sorted(BONUS_RULES)}")
    return BONUS_RULES[name]


def length_bonus(accuracy: Sequence[float], lengths: Sequence[int], min_tokens: int, max_tokens: int, bonus: float,
                 rules: str = "video_r1") -> list[float]:
    """Video-R1's length control for ONE group: when more than one completion is correct, each correct one whose
    length (completion tokens, EOS included) lies in [min_tokens, max_tokens] earns ``bonus``."""
    rule = _rules(rules)
    correct = [a > rule.correct_above for a in accuracy]
    if sum(correct) <= 1:
        return [0.0] * len(accuracy)
    return [bonus if ok and min_tokens <= n <= max_tokens else 0.0 for ok, n in zip(correct, lengths)]


def temporal_bonus(ordered_accuracy: Sequence[float], shuffled_accuracy: Sequence[float], alpha: float,
                   ratio: float, rules: str = "video_r1") -> list[float]:
    """T-GRPO for ONE group: when the group answers at least as well with ordered frames as ``ratio`` x its
    accuracy with shuffled frames, each correct ordered completion earns ``alpha``."""
    rule = _rules(rules)
    ordered = sum(ordered_accuracy) / max(len(ordered_accuracy), 1)
    shuffled = sum(shuffled_accuracy) / max(len(shuffled_accuracy), 1)
    earned = ordered >= ratio * shuffled if rule.temporal_at_least else ordered > ratio * shuffled
    return [alpha if earned and a > rule.correct_above else 0.0 for a in ordered_accuracy]


@dataclass
class Scored:
    """One batch of completions scored: accuracy once per completion, every reward and bonus by name (unweighted),
    and the weighted total."""

    accuracy: list[float]
    rewards: dict[str, list[float]]
    total: list[float]


class RewardSet:
    """The configured rewards (``rewards.*``): functions with their weights, the regression metric, and the
    group-level length and temporal bonuses with their rules. Built once; ``score`` is the only call."""

    def __init__(self, cfg, judge=None):
        self.cfg = cfg
        self.functions = build_rewards(cfg.functions, cfg.weights, cfg.regression, judge)
        self.weights = {name: weight for name, _, weight in self.functions}

    def accuracy(self, texts: Sequence[str], records: Sequence[dict]) -> list[float]:
        return [accuracy_of(t, r, self.cfg.regression) for t, r in zip(texts, records)]

    def score(self, texts: Sequence[str], records: Sequence[dict], group_sizes: Sequence[int],
              lengths: Sequence[int], shuffled_texts: dict[int, list[str]] | None = None) -> Scored:
        """``lengths``: completion tokens per row; ``shuffled_texts``: for T-GRPO, group index -> the completions of
        that group's prompt with shuffled frames (groups without video are absent and earn no temporal bonus)."""
        cfg = self.cfg
        accuracy = self.accuracy(texts, records)
        rewards = score(self.functions, list(texts), list(records), group_sizes)
        groups = group_slices(group_sizes)
        if cfg.length:
            rewards["length"] = [bonus for rows in groups for bonus in length_bonus(
                accuracy[rows], lengths[rows], cfg.length_min_tokens, cfg.length_max_tokens, cfg.length_bonus,
                cfg.bonus_rules)]
        if cfg.temporal:
            temporal = [0.0] * len(texts)
            for g, mixed_texts in (shuffled_texts or {}).items():
                rows = groups[g]
                mixed = self.accuracy(mixed_texts, [records[rows.start]] * len(mixed_texts))
                temporal[rows] = temporal_bonus(accuracy[rows], mixed, cfg.temporal_alpha, cfg.temporal_ratio,
                                                cfg.bonus_rules)
            rewards["temporal"] = temporal
        total = [sum(self.weights.get(name, 1.0) * values[i] for name, values in rewards.items())
                 for i in range(len(texts))]
        return Scored(accuracy, rewards, total)
