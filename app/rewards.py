"""Rule-based rewards: format, accuracy per problem type, plug-ins; group-level length and temporal bonuses.
Pure Python, no model code.

A reward function takes the decoded completions and their records and returns one float per completion:
``fn(completions: list[str], records: list[dict]) -> list[float]``. Custom ones load from
``path/to/file.py:function``. The length and temporal bonuses look at a whole group (Video-R1's rules by default,
``BONUS_RULES``).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.groups import group_slices
from app.plugins import load_function

RewardFn = Callable[[list[str], list[dict]], list[float]]

FORMAT_PATTERN = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
ANSWER_PATTERN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class RewardError(ValueError):
    """A reward specification or a record the rewards cannot score."""


def extract_answer(text: str) -> str | None:
    """The last complete ``<answer>...</answer>`` of a completion, stripped; None when it has none.

    A completion without a closed answer tag (no tag, or cut off by the length limit inside ``<think>`` or inside
    ``<answer>``) has given no answer and earns no accuracy: scoring its whole text would pay for reasoning that
    merely mentions the right option.
    """
    found = ANSWER_PATTERN.findall(text)
    return found[-1].strip() if found else None


def solution_answer(solution: str) -> str:
    """The reference answer of a record: its last ``<answer>`` content, or the whole solution when untagged."""
    found = ANSWER_PATTERN.findall(solution)
    return found[-1].strip() if found else solution.strip()


# ---- multiple choice: one option letter, in the forms models write it, never a letter read out of a word ----------
_WRAPPERS = (re.compile(r"^\\boxed\{(.*)\}$", re.DOTALL), re.compile(r"^\*\*(.*)\*\*$", re.DOTALL),
             re.compile(r"^\$(.*)\$$", re.DOTALL), re.compile(r"^`(.*)`$", re.DOTALL),
             re.compile(r"^\[(.*)\]$", re.DOTALL), re.compile(r"^\{(.*)\}$", re.DOTALL))
_LEAD_IN = re.compile(r"^(?:the\s+)?(?:final\s+|correct\s+)*(?:answer|option|choice)(?:\s+is)?\s*[:：]?\s*",
                      re.IGNORECASE)
# The letter, then nothing, or a separator and the option's text / a justification: "B", "B.", "(B) red",
# "B, the red one", "B - red", "B because it is red", "[B] red".
_LETTER_FORMS = (
    re.compile(r"^[(\[]([A-Za-z])[)\]](?:[.:,;]?\s+(?P<rest>\S.*?))?[.]?$", re.DOTALL),
    re.compile(r"^([A-Za-z])(?:[.:),;](?:\s+(?P<rest>\S.*?))?|\s+[-\u2013\u2014]\s+(?P<dash>\S.*?))?[.]?$",
               re.DOTALL),
)
# A bare letter followed by a word is an option only when the word starts a justification ("B because ..."):
# "A cat" is an article and a noun, "B or C" a hedge.
_JUSTIFIED = re.compile(r"^([A-Za-z])\s+(?P<rest>(?:\(|(?:because|since|as|given|due|which|this|it|that|is|was)\b).*?)"
                        r"[.]?$", re.DOTALL | re.IGNORECASE)
# Another option letter standing alone in the text after the answer makes it a hedge ("A, C", "B, or C").
_OTHER_LETTER = re.compile(r"(?<![\w'])(?:[B-HJ-Z]|A(?!\s+[a-z]))(?![\w'])")


def _unwrap(text: str) -> str:
    text = text.strip()
    changed = True
    while changed:
        changed = False
        for pattern in _WRAPPERS:
            match = pattern.match(text)
            if match:
                text, changed = match.group(1).strip(), True
        stripped = _LEAD_IN.sub("", text, count=1)
        if stripped != text:
            text, changed = stripped.strip(), True
    return text


# A statement of the choice inside a sentence: "..., so the answer is B", "I think the correct option is (C)".
_STATED = re.compile(r"(?:^|[\s,;:(])(?:answer|option|choice)(?:\s+(?:is|would\s+be|should\s+be|must\s+be))?\s*[:：]?\s*"
                     r"(?P<said>[(\[*`$]*[A-Za-z](?![\w'])[^\n]*)$", re.IGNORECASE | re.DOTALL)
# One-letter words that are not option letters: the pronoun "I" ("I think", "I'm") and the article "A"/"a" before a
# word ("A dog runs"). Every other letter standing alone is a candidate.
_NOT_A_LETTER = re.compile(r"^(?:I(?:\s+[a-z]|'[a-z])|[Aa]\s+[a-z])")
_STANDALONE = re.compile(r"(?<![\w'\\])[A-Za-z](?![\w'])")


def _letters_in_sentence(text: str) -> list[str]:
    """Every one-letter word of a sentence that may be an option letter (upper case; lower-case "a" and "i" only
    as the whole answer): the pronoun I and the article A before a word are words, not options."""
    found = []
    for match in _STANDALONE.finditer(text):
        letter = match.group(0)
        if _NOT_A_LETTER.match(text[match.start():]) or letter.islower():
            continue
        found.append(letter)
    return found


def option_letter(text: str) -> str | None:
    """The option letter an answer names (A-Z: benchmarks have up to 26 options), or None.

    Named: "B", "b", "B.", "(B)", "[B]", "**B**", "\\boxed{B}", "Answer: B", "B. red", "B, the red one",
    "B - red", "B because the square is red", "B is correct", "B (the red one)"; inside a sentence, "the red one
    falls, so the answer is B" and "I think it is C" / "A dog runs left: D" (the pronoun I and the article A before a
    word are words). None: "blue", "Because ...", "a cat", "B or C", "A, C", "B, not C" (a second option letter in
    the text is a hedge)."""
    text = _unwrap(text)
    for pattern in (*_LETTER_FORMS, _JUSTIFIED):
        match = pattern.match(text)
        if match:
            rest = match.groupdict().get("rest") or match.groupdict().get("dash") or ""
            if _OTHER_LETTER.search(rest):
                return None
            return match.group(1).upper()
    stated = list(_STATED.finditer(text))
    if stated:  # the last "answer is X" of a sentence decides, parsed as a whole answer would be
        said = stated[-1].group("said").strip()
        if said != text:
            return option_letter(said)
    letters = _letters_in_sentence(text)
    return letters[0] if len(letters) == 1 else None  # one candidate letter in the sentence; several are a hedge


# ---- numbers: one value, thousands separators, leading-dot decimals, exponents, unicode minus; hedges refused -----
_MINUS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2014": "-", "\ufe63": "-", "\uff0d": "-"})
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:[.,]\d+)?|\.\d+)(?:[eE][-+]?\d+)?")


def parse_number(text: str) -> float | None:
    """The single number an answer states, or None when it states none or several different ones ("3 or 4").

    "1,500" is 1500 (comma before exactly three digits groups thousands), "1,5" is 1.5, ".5" is 0.5, "1e3" is
    1000, "\u22123" is -3; units and "%" around the number are ignored.
    """
    values = set()
    for token in _NUMBER.findall(text.translate(_MINUS)):
        if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?:[eE][-+]?\d+)?", token):
            token = token.replace(",", "")
        else:
            token = token.replace(",", ".")
        try:
            value = float(token)
        except ValueError:
            continue
        if math.isfinite(value):
            values.add(value)
    return values.pop() if len(values) == 1 else None


def word_error_rate(reference: str, hypothesis: str) -> float:
    ref, hyp = reference.split(), hypothesis.split()
    if not ref:
        return 0.0 if not hyp else 1.0
    previous = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        current = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (r != h))
        previous = current
    return previous[-1] / len(ref)


_rouge = None


def mean_rouge(reference: str, hypothesis: str) -> float:
    """Mean F of ROUGE-1, ROUGE-2 and ROUGE-L; ROUGE-2 only when the reference has two words or more (a one-word
    reference has no bigram, so an exact one-word answer would otherwise score 2/3)."""
    global _rouge
    if _rouge is None:
        from rouge_score import rouge_scorer

        _rouge = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=False)
    scores = _rouge.score(reference, hypothesis)
    names = ["rouge1", "rouge2", "rougeL"] if len(reference.split()) >= 2 else ["rouge1", "rougeL"]
    return sum(scores[n].fmeasure for n in names) / len(names)


MRA_THRESHOLDS = tuple((10 + i) / 20 for i in range(10))  # 0.50, 0.55, ..., 0.95


def mean_relative_accuracy(prediction: float, truth: float) -> float:
    """VSI-Bench's MRA, as Video-R1 reports it: mean over theta in 0.50..0.95 of [|p - t| / |t| < 1 - theta]."""
    if truth == 0:
        return float(prediction == 0)
    relative = abs(prediction - truth) / abs(truth)
    return sum(relative < 1 - theta for theta in MRA_THRESHOLDS) / len(MRA_THRESHOLDS)


def _multiple_choice(pred: str, truth: str) -> float:
    letter = option_letter(pred)
    return float(letter is not None and letter == option_letter(truth))


def _numerical(pred: str, truth: str) -> float:
    p, t = parse_number(pred), parse_number(truth)
    return float(p is not None and t is not None and round(p, 2) == round(t, 2))


def _ocr(pred: str, truth: str) -> float:
    return max(0.0, 1.0 - word_error_rate(truth.lower(), pred.lower()))


def _free_form(pred: str, truth: str) -> float:
    return mean_rouge(truth, pred) if pred.strip() else 0.0


def relative_error_reward(prediction: float, truth: float) -> float:
    """Video-R1's training reward for regression: 1 - min(1, |p - t| / |t|) (0.8 for 20% off). Video-R1 adds 1e-9
    to both sides of the ratio; without it an exact answer scores exactly 1 (not 1 - 1e-10), and truth 0 scores
    [p == 0] (Video-R1's formula would give an exact 0 the reward 0)."""
    if truth == 0:
        return float(prediction == 0)
    relative = abs(prediction - truth) / abs(truth)
    return 1.0 - min(1.0, max(0.0, relative))


REGRESSION_METRICS: dict[str, Callable[[float, float], float]] = {
    "relative_error": relative_error_reward,  # what Video-R1 trains on (smooth)
    "mra": mean_relative_accuracy,  # what Video-R1's evaluation reports (VSI-Bench)
}


def _regression(pred: str, truth: str, metric: str = "relative_error") -> float:
    p, t = parse_number(pred), parse_number(truth)
    if p is None or t is None:
        return 0.0
    return REGRESSION_METRICS[metric](p, t)


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


GROUNDING_TYPES = ("temporal grounding", "spatial grounding")
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
    if kind == "temporal grounding":
        span = parse_interval(truth)
        if span is None:
            return f"temporal grounding solution {truth!r} is not one [start, end] in seconds"
        duration = record.get("duration")
        if duration is not None and (not isinstance(duration, (int, float)) or span[1] > float(duration) + 1e-6):
            return f"temporal grounding solution {truth!r} ends past the record's duration {duration!r}"
    elif kind == "spatial grounding":
        box_format = record.get("box_format", "pixel")
        if box_format not in BOX_FORMATS:
            return f"unknown box_format {box_format!r} (known: {', '.join(BOX_FORMATS)})"
        if parse_box(truth, BOX_FORMATS[box_format]) is None:
            return f"spatial grounding solution {truth!r} is not one [x1, y1, x2, y2] box in {box_format} coordinates"
    return None


ACCURACY_BY_PROBLEM_TYPE: dict[str, Callable[[str, str], float]] = {
    "multiple choice": _multiple_choice,
    "numerical": _numerical,
    "OCR": _ocr,
    "free-form": _free_form,
    "regression": _regression,
    "temporal grounding": _temporal_grounding,
    "spatial grounding": _spatial_grounding,
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


ANSWER_EXTRACTION = {  # name -> (score of an output, the answer it read)
    # this project's scoring (the trainer's reward code; regression by MRA, as evaluations report it)
    "project": (lambda completion, record: accuracy_of(completion, record, regression="mra"),
                lambda completion: extract_answer(completion) or ""),
    "video_r1": (video_r1_eval_accuracy, video_r1_eval_answer),  # Video-R1's evaluation script, to reproduce it
    "timezero": (timezero_accuracy, timezero_answer),  # TimeZero's temporal-grounding evaluation
}


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
