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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.answers.problems import ACCURACY_BY_PROBLEM_TYPE, NEEDS_RECORD, PROBLEM_TYPES
from app.answers.reading import (
    FORMAT_PATTERN,
    REGRESSION_METRICS,
    RewardError,
    _regression,
    extract_answer,
    solution_answer,
)
from app.common.groups import group_slices
from app.common.plugins import load_function

RewardFn = Callable[[list[str], list[dict]], list[float]]

__all__ = ["ACCURACY_BY_PROBLEM_TYPE", "NEEDS_RECORD", "PROBLEM_TYPES"]  # and the names defined below


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
    answers (``REGRESSION_METRICS``); ``judge``: the model judge ``judge`` names (``app.rewards.judge``), built by the
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
