"""Reading answers as models write them: the ``<answer>`` tag, an option letter, a number; and the metric of each
text problem type (multiple choice, numerical, OCR, free-form, regression). Pure Python, no model code.
Grounding answers (a time interval, a box) are ``app.answers.grounding``; which metric a record gets is ``app.rewards.rules``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

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
# Words that join two choices: after one of them "A" is an option letter, not the article ("A or B", "both A and B").
_JOINING = r"(?:or|and|nor|vs|versus|plus|and/or)\b"
# Another option letter standing alone in the text after the answer makes it a hedge ("A, C", "B, or C", "C, or A
# and B").
_OTHER_LETTER = re.compile(rf"(?<![\w'])(?:[B-HJ-Z]|A(?!\s+(?!{_JOINING})[a-z]))(?![\w'])")


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
# word ("A dog runs"), but not before a word joining choices ("A or B" names two options: a hedge). Every other
# letter standing alone is a candidate.
_NOT_A_LETTER = re.compile(rf"^(?:I(?:\s+[a-z]|'[a-z])|[Aa]\s+(?!{_JOINING})[a-z])")
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
    word are words). None: "blue", "Because ...", "a cat", "B or C", "A or B", "both A and B", "A, C", "B, not C" (a
    second option letter in the text is a hedge: an answer commits to one option)."""
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
