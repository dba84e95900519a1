"""Reward functions on hand-made cases for every problem type, plug-ins, and GRPO maths."""

from __future__ import annotations

import pytest
import torch

from app.answers.reading import word_error_rate
from app.objectives.grpo import LossOptions, group_advantages, grpo_loss, kl_penalty
from app.rewards.rules import (
    PROBLEM_TYPES,
    RewardError,
    accuracy_of,
    build_rewards,
    extract_answer,
    format_reward,
    length_bonus,
    score,
    temporal_bonus,
)


def rec(problem_type: str, answer: str) -> dict:
    return {"problem_type": problem_type, "solution": f"<answer>{answer}</answer>"}


def said(answer: str) -> str:
    return f"<think>because</think><answer>{answer}</answer>"


@pytest.mark.parametrize(("problem_type", "truth", "answer", "expected"), [
    ("multiple choice", "B", "B", 1.0),
    ("multiple choice", "B", "b. green", 1.0),
    ("multiple choice", "B", "C", 0.0),
    ("multiple choice", "B", "", 0.0),
    ("numerical", "3.14", "3.141", 1.0),
    ("numerical", "3.14", "3.2", 0.0),
    ("numerical", "12", "about 12 squares", 1.0),
    ("numerical", "12", "many", 0.0),
    ("OCR", "hello big world", "hello big world", 1.0),
    ("OCR", "hello big world", "hello world", pytest.approx(2 / 3)),
    ("OCR", "a b", "x y z w", 0.0),
    ("free-form", "the red square moves left", "the red square moves left", pytest.approx(1.0)),
    ("free-form", "the red square moves left", "blue circle", 0.0),
    ("regression", "10", "10", 1.0),
    ("regression", "10", "8", pytest.approx(0.8)),  # Video-R1's training reward: 1 - |8-10|/10
    ("regression", "10", "30", 0.0),
    ("regression", "0", "0", 1.0),
])
def test_accuracy_per_problem_type(problem_type, truth, answer, expected):
    assert accuracy_of(said(answer), rec(problem_type, truth)) == expected


# Every class of scoring defect found against Video-R1's data, with the intended score; then what must stay right.
GAMED = [
    # a word or a hedge is not an option letter
    ("multiple choice", "B", said("blue"), 0.0),
    ("multiple choice", "B", said("Because it moves left"), 0.0),
    ("multiple choice", "D", said("Dog"), 0.0),
    ("multiple choice", "C", said("Cannot tell"), 0.0),
    ("multiple choice", "A", said("a cat"), 0.0),
    ("multiple choice", "B", said("B or C"), 0.0),
    ("multiple choice", "A", said("A, C"), 0.0),
    ("multiple choice", "C", said("Both C and D"), 0.0),
    # no closed answer tag: nothing was answered
    ("multiple choice", "B", "<think>Looking at option B, the square moves", 0.0),
    ("multiple choice", "B", "B", 0.0),
    ("multiple choice", "B", "<think>so B</think><answer>B", 0.0),
    ("free-form", "the red square moves left", "<think>the red square moves left because", 0.0),
    ("numerical", "3", "<think>3</think>", 0.0),
    # numbers read as what they say, hedges refused
    ("numerical", "1500", said("1,500"), 1.0),
    ("numerical", "1.5", said("1,500"), 0.0),
    ("numerical", "0.5", said(".5"), 1.0),
    ("numerical", "5", said(".5"), 0.0),
    ("numerical", "1000", said("1e3"), 1.0),
    ("numerical", "-3", said("\u22123"), 1.0),
    ("numerical", "3", said("3 or 4"), 0.0),
    ("regression", "3", said("between 2 and 4"), 0.0),
    # free-form: an exact one-word answer is fully right (ROUGE-2 only for references of two words or more)
    ("free-form", "left", said("left"), pytest.approx(1.0)),
    # regression trains on Video-R1's 1 - relative error: smooth, 0.9 for 10% off, 0.5 for 50% off
    ("regression", "10", said("11"), pytest.approx(0.9)),
    ("regression", "10", said("15"), pytest.approx(0.5)),
    ("regression", "4", said("8"), 0.0),
    # a hedge stays a hedge when it comes with a justification
    ("multiple choice", "B", said("B, not C"), 0.0),
    ("multiple choice", "B", said("B because C is wrong"), 0.0),
    ("multiple choice", "A", said("A cat"), 0.0),
    ("multiple choice", "B", said("B is wrong, C is right"), 0.0),
    ("multiple choice", "B", said("B and C"), 0.0),
    # an answer that commits to two options is a hedge whatever the wording: "A" before a joining word is a letter
    *[("multiple choice", truth, said(answer), 0.0) for truth, answer in (
        ("B", "A or B"), ("B", "Both A and B"), ("B", "Either A or B"), ("B", "A and B"), ("B", "A and/or B"),
        ("B", "A/B"), ("B", "A & B"), ("B", "(A) or (B)"), ("B", "A or maybe B"), ("B", "The answer is A or B"),
        ("B", "A, B"), ("B", "A; B"), ("B", "A (or B)"), ("B", "A vs B"), ("B", "A or B."), ("A", "B or A"),
        ("C", "A or B or C"), ("A", "A nor B"), ("C", "C, or A and B"), ("A", "Options A and B"))],
    # ... and so is more than one number, interval or box
    ("numerical", "3", said("3, 4"), 0.0),
    ("numerical", "3", said("3 or maybe 4"), 0.0),
    ("regression", "10", said("10 to 12"), 0.0),
    # inside a sentence: one-letter words that are not options (I, the article A) never make a hedge or a choice
    ("multiple choice", "C", said("I think it could be B or C"), 0.0),
    ("multiple choice", "A", said("I see a dog"), 0.0),
    ("multiple choice", "A", said("A dog runs left"), 0.0),
    ("multiple choice", "B", said("I am not sure"), 0.0),
    # an empty reference: only an empty (closed) answer matches it, and an empty answer matches nothing else
    ("free-form", "", said(""), 1.0),
    ("OCR", "", said("some text"), 0.0),
    ("multiple choice", "", "<think>nothing</think>", 0.0),
    ("OCR", "hello", said(""), 0.0),
]
RIGHT = [
    ("multiple choice", "B", said(answer), 1.0)
    for answer in ("b", "B.", "(B)", "**B**", "\\boxed{B}", "Answer: B", "B. red", "(B) red", "The answer is B")
] + [
    # a correct letter followed by its justification is an answer, not a hedge (any letter, any wording)
    (problem, truth, said(answer), 1.0) for problem, truth, answer in (
        ("multiple choice", "B", "[B]"), ("multiple choice", "B", "B because the square is red"),
        ("multiple choice", "B", "B, the red one"), ("multiple choice", "D", "[D] the blue circle"),
        ("multiple choice", "E", "e, since it comes first"), ("multiple choice", "C", "C - it moves left"),
        ("multiple choice", "A", "A because the ball falls"), ("multiple choice", "J", "(J), the last one"),
        ("multiple choice", "F", "The answer is F, as the clip shows"), ("multiple choice", "B", "B is correct"),
        ("multiple choice", "C", "C (the square that moves)"), ("multiple choice", "D", "D was right, the clip shows it"),
        # the letter after a sentence with the pronoun I or the article A in it
        ("multiple choice", "B", "I think the answer is B"), ("multiple choice", "C", "I believe it is C."),
        ("multiple choice", "D", "A ball rolls left, so the answer is D"), ("multiple choice", "B", "I'd say B"),
        ("multiple choice", "E", "After watching, I choose E"), ("multiple choice", "A", "I think the answer is A."),
        ("multiple choice", "C", "A square moves; the correct option is (C) the square"),
        ("multiple choice", "I", "The answer is I"), ("multiple choice", "B", "Looking at a frame, I pick B."))
] + [
    ("numerical", "3", said("3.0"), 1.0),
    ("numerical", "12", said("12 squares"), 1.0),
    ("numerical", "50", said("50%"), 1.0),
    ("numerical", "50%", said("50"), 1.0),
    ("numerical", "3", said("nan"), 0.0),
    ("regression", "0", said("0"), 1.0),
    ("regression", "0", said("1"), 0.0),
    ("regression", "4", said("NaN"), 0.0),
]


@pytest.mark.parametrize(("problem_type", "truth", "completion", "expected"), GAMED + RIGHT)
def test_scoring_cannot_be_gamed_and_stays_right(problem_type, truth, completion, expected):
    assert accuracy_of(completion, rec(problem_type, truth)) == expected


@pytest.mark.parametrize(("truth", "answer", "expected"), [
    ("10", "10", 1.0), ("10", "11", pytest.approx(0.8)),  # 10% off passes 8 of 10 thresholds (not 0.90, 0.95)
    ("10", "8", pytest.approx(0.6)), ("10", "15", 0.0), ("0", "0", 1.0)])
def test_regression_reports_mra_in_evaluation(truth, answer, expected):
    """Evaluation reports VSI-Bench's MRA (what Video-R1's eval prints); training uses 1 - relative error."""
    assert accuracy_of(said(answer), rec("regression", truth), regression="mra") == expected


def test_every_problem_type_has_a_case():
    assert set(PROBLEM_TYPES) == {"multiple choice", "numerical", "OCR", "free-form", "regression",
                                  "temporal grounding", "spatial grounding", "object tracking"}


def test_free_form_partial_credit_is_mean_rouge():
    value = accuracy_of(said("the red square"), rec("free-form", "the red square moves left"))
    assert 0.3 < value < 1.0


def test_format_reward():
    assert format_reward([said("A"), "<answer>A</answer>", "<think>x</think> <answer>A</answer> trailing", ""],
                         [{}] * 4) == [1.0, 0.0, 0.0, 0.0]


def test_empty_completion_scores_zero_not_error():
    assert accuracy_of("", rec("multiple choice", "A")) == 0.0
    assert accuracy_of("   ", rec("free-form", "words")) == 0.0


def test_unknown_problem_type_is_an_error():
    with pytest.raises(RewardError, match="unknown problem_type 'poetry'"):
        accuracy_of(said("x"), rec("poetry", "x"))


def test_extract_answer_and_wer():
    assert extract_answer("<answer> A </answer> then <answer>B</answer>") == "B"
    assert extract_answer("no tags") is None
    assert extract_answer("<think>x</think><answer>B") is None
    assert word_error_rate("a b c", "a x c") == pytest.approx(1 / 3)


def test_plugin_rewards_and_weights(tmp_path):
    plugin = tmp_path / "my_reward.py"
    plugin.write_text("def shout(completions, records):\n    return [float(c.isupper()) for c in completions]\n")
    rewards = build_rewards(["accuracy", f"{plugin}:shout"], [0.5, 2.0])
    values = score(rewards, [said("A"), said("B"), "LOUD"], [rec("multiple choice", "A")] * 3)
    assert values["accuracy"] == [1.0, 0.0, 0.0]
    assert values[f"{plugin}:shout"] == [0.0, 0.0, 1.0]
    assert [w for _, _, w in rewards] == [0.5, 2.0]


@pytest.mark.parametrize(("accuracy", "lengths", "rules", "expected"), [
    # Video-R1: correct = accuracy > 0.1; the bonus needs more than one correct completion in the group.
    ([1, 1, 0, 1], [400, 600, 400, 320], "video_r1", [0.2, 0.0, 0.0, 0.2]),
    ([1, 0, 0, 0], [400, 400, 400, 400], "video_r1", [0.0] * 4),  # a lone correct one earns nothing
    ([0.3, 0.2, 0.05, 0], [400, 512, 400, 400], "video_r1", [0.2, 0.2, 0.0, 0.0]),  # partial counts as correct
    ([0.3, 0.2, 0.05, 0], [400, 512, 400, 400], "strict", [0.0] * 4),  # strict: > 0.5
    ([1, 1, 1, 1], [319, 320, 512, 513], "strict", [0.0, 0.2, 0.2, 0.0]),  # bounds inclusive
])
def test_length_bonus_follows_video_r1(accuracy, lengths, rules, expected):
    assert length_bonus(accuracy, lengths, 320, 512, 0.2, rules) == expected


@pytest.mark.parametrize(("spec", "message"), [
    ("nonsense", "unknown reward function 'nonsense'"),
    ("missing.py:f", "file missing.py not found"),
])
def test_bad_reward_specs(spec, message):
    with pytest.raises(RewardError, match=message):
        build_rewards([spec])


def test_temporal_bonus_follows_video_r1():
    assert temporal_bonus([1, 1, 0, 1], [0, 1, 0, 0], alpha=0.3, ratio=0.8) == [0.3, 0.3, 0.0, 0.3]
    assert temporal_bonus([1, 0, 0, 0], [1, 1, 0, 0], alpha=0.3, ratio=0.8) == [0.0] * 4
    # ordered 0.5 == 0.8 x shuffled 0.625: Video-R1 pays (>=), strict does not (>)
    ordered, shuffled = [1, 1, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]
    assert temporal_bonus(ordered, shuffled, 0.3, 0.8) == [0.3, 0.3, 0.0, 0.0]
    assert temporal_bonus(ordered, shuffled, 0.3, 0.8, "strict") == [0.0] * 4
    # Video-R1's "correct" is accuracy > 0.1: a partial free-form match (0.2) earns the bonus, strict needs > 0.5
    assert temporal_bonus([0.2, 0.6, 0.0], [0.0, 0.0, 0.0], 0.3, 0.8) == [0.3, 0.3, 0.0]
    assert temporal_bonus([0.2, 0.6, 0.0], [0.0, 0.0, 0.0], 0.3, 0.8, "strict") == [0.0, 0.3, 0.0]


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0])
    adv = group_advantages(rewards, [4, 2])
    assert adv[:4].sum().abs() < 1e-6 and adv[0] > 0 > adv[1]
    assert torch.equal(adv[4:], torch.zeros(2))  # equal rewards: no signal
    assert torch.allclose(group_advantages(rewards, [4, 2], scale="none")[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    batch = group_advantages(rewards, [4, 2], scale="batch", eps=0.0)
    assert torch.allclose(batch, group_advantages(rewards, [4, 2], scale="none") / rewards.std())
    assert torch.allclose(group_advantages(rewards, [4, 2], scale="batch", batch_std=2.0, eps=0.0),
                          group_advantages(rewards, [4, 2], scale="none") / 2.0)


def test_grpo_loss_clipping_and_aggregation():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.25, 0.5, 0.5], [0.5, 0.5, 0.5]]))  # ratio 2 on one token
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -1.0])
    loss, metrics = grpo_loss(logp, old, adv, mask, options=LossOptions(loss_type="grpo"))
    # completion 0: tokens (ratio 2 clipped to 1.2, ratio 1) -> -(1.2 + 1)/2; completion 1: +1 per token
    assert loss.item() == pytest.approx((-(1.2 + 1.0) / 2 + 1.0) / 2)
    assert metrics["clip_fraction_high"] == pytest.approx(1 / 5)
    token_loss, _ = grpo_loss(logp, old, adv, mask, options=LossOptions(loss_type="bnpo"))
    assert token_loss.item() == pytest.approx((-1.2 - 1.0 + 3.0) / 5)
    ref = logp - 0.1
    with_kl, metrics = grpo_loss(logp, old, adv, mask, ref_logprobs=ref, options=LossOptions(beta=0.5))
    assert metrics["kl"] == pytest.approx(float(kl_penalty(logp, ref, "k3")[0, 0]), rel=1e-5)
    assert with_kl.item() > loss.item()


# ---- grounding: temporal IoU in seconds, spatial IoU of boxes --------------------------------------------------------
def grounding(kind: str, truth: str, **fields) -> dict:
    return {"problem_type": kind, "solution": f"<answer>{truth}</answer>", **fields}


TEMPORAL = [
    # right, in the forms models write: brackets or none, commas, dashes or "to", units, clock times, swapped ends
    ("[3.0, 7.0]", {}, 1.0), ("3 - 7", {}, 1.0), ("from 3s to 7s", {}, 1.0), ("3 to 7 seconds", {}, 1.0),
    ("(7.0, 3.0)", {}, 1.0), ("0:03 - 0:07", {}, 1.0), ("3.0-7.0", {}, 1.0), ("The moment is [3, 7].", {}, 1.0),
    ("[5, 9]", {}, pytest.approx(2 / 6)), ("[8, 12]", {}, 0.0),
    # gamed: the whole video earns only its overlap; past the record's duration counts to its end
    ("[0, 9999]", {}, pytest.approx(4 / 9999)), ("[0, 9999]", {"duration": 20}, pytest.approx(4 / 20)),
    # malformed or ambiguous: no score
    ("7", {}, 0.0), ("3, 5, 7", {}, 0.0), ("[1, 2] and [3, 7]", {}, 0.0), ("[-1, 7]", {}, 0.0), ("soon", {}, 0.0),
    ("", {}, 0.0), ("[3, 7] or [4, 8]", {}, 0.0), ("3 to 7, or 4 to 8", {}, 0.0),
]


@pytest.mark.parametrize(("answer", "fields", "expected"), TEMPORAL)
def test_temporal_grounding_scores_the_iou_of_the_span_in_seconds(answer, fields, expected):
    assert accuracy_of(said(answer), grounding("temporal grounding", "[3, 7]", **fields)) == expected


SPATIAL = [
    ("[10, 20, 110, 220]", "pixel", 1.0), ("10, 20, 110, 220", "pixel", 1.0), ("(110, 220, 10, 20)", "pixel", 1.0),
    ("x1=10, y1=20, x2=110, y2=220", "pixel", 1.0), ("[60, 20, 160, 220]", "pixel", pytest.approx(1 / 3)),
    ("[0.1, 0.2, 0.5, 0.6]", "normalized", 1.0), ("[100, 200, 500, 600]", "normalized_1000", 1.0),
    # refused, not guessed: pixel values where normalised ones are asked, 5 numbers, two boxes, a negative
    ("[10, 20, 110, 220]", "normalized", 0.0), ("[10, 20, 110, 220, 5]", "pixel", 0.0),
    ("[0, 0, 5, 5] [10, 20, 110, 220]", "pixel", 0.0), ("[-10, 20, 110, 220]", "pixel", 0.0),
    ("[10, 20, 110, 220] or [0, 0, 5, 5]", "pixel", 0.0),
    ("the left one", "pixel", 0.0),
]


@pytest.mark.parametrize(("answer", "box_format", "expected"), SPATIAL)
def test_spatial_grounding_scores_the_iou_of_the_box_in_the_records_coordinates(answer, box_format, expected):
    truth = {"pixel": "[10, 20, 110, 220]", "normalized": "[0.1, 0.2, 0.5, 0.6]",
             "normalized_1000": "[100, 200, 500, 600]"}[box_format]
    assert accuracy_of(said(answer), grounding("spatial grounding", truth, box_format=box_format)) == expected


TRACK = [[0.1, 0.2, 0.5, 0.6], [0.2, 0.2, 0.6, 0.6], [0.3, 0.2, 0.7, 0.6]]  # one box per sampled frame
TRACKING = [
    # right, in the forms models write: nested brackets, parentheses, one box per line, corners swapped
    (str(TRACK), 1.0), ("(0.1, 0.2, 0.5, 0.6), (0.2, 0.2, 0.6, 0.6), (0.3, 0.2, 0.7, 0.6)", 1.0),
    ("0.1 0.2 0.5 0.6\n0.2 0.2 0.6 0.6\n0.3 0.2 0.7 0.6", 1.0),
    ("[[0.5, 0.6, 0.1, 0.2], [0.2, 0.2, 0.6, 0.6], [0.3, 0.2, 0.7, 0.6]]", 1.0),
    # half right: the mean IoU over the frames
    ("[[0.1, 0.2, 0.5, 0.6], [0.2, 0.2, 0.6, 0.6], [0.8, 0.8, 0.9, 0.9]]", pytest.approx(2 / 3)),
    # gamed: the whole frame every time earns only the boxes' share of it
    (str([[0, 0, 1, 1]] * 3), pytest.approx(0.16)),
    # malformed or ambiguous: a box short, a box too many, a flat run of numbers, one box, pixel values, 5 numbers
    (str(TRACK[:2]), 0.0), (str(TRACK + TRACK[:1]), 0.0), ("0.1 0.2 0.5 0.6 0.2 0.2 0.6 0.6 0.3 0.2 0.7 0.6", 0.0),
    ("[0.1, 0.2, 0.5, 0.6]", 0.0), (str([[10, 20, 50, 60]] * 3), 0.0), (str([b + [1] for b in TRACK]), 0.0),
    ("it moves right", 0.0),
]


@pytest.mark.parametrize(("answer", "expected"), TRACKING)
def test_object_tracking_scores_the_mean_iou_of_the_boxes_frame_by_frame(answer, expected):
    record = grounding("object tracking", str(TRACK), box_format="normalized")
    assert accuracy_of(said(answer), record) == expected


def test_grounding_records_that_cannot_be_scored_are_named():
    from app.answers.grounding import check_grounding_record

    assert check_grounding_record(grounding("temporal grounding", "[3, 7]", duration=10)) is None
    assert "not one [start, end]" in check_grounding_record(grounding("temporal grounding", "around 5"))
    assert "past the record's duration" in check_grounding_record(grounding("temporal grounding", "[3, 17]",
                                                                            duration=10))
    assert "unknown box_format 'percent'" in check_grounding_record(grounding("spatial grounding", "[1, 2, 3, 4]",
                                                                              box_format="percent"))
    assert "not one [x1, y1, x2, y2] box in normalized" in check_grounding_record(
        grounding("spatial grounding", "[10, 20, 30, 40]", box_format="normalized"))
    assert "object tracking solution '[0.1, 0.2, 0.3]' is not a list of [x1, y1, x2, y2] boxes" in \
        check_grounding_record(grounding("object tracking", "[0.1, 0.2, 0.3]", box_format="normalized"))
    assert check_grounding_record(grounding("object tracking", str(TRACK), box_format="normalized")) is None


def test_grounding_metrics_are_miou_and_recall_at_thresholds():
    from app.answers.grounding import grounding_metrics

    assert grounding_metrics([0.2, 0.4, 0.6, 0.8]) == pytest.approx(
        {"mIoU": 0.5, "R@0.3": 0.75, "R@0.5": 0.5, "R@0.7": 0.25})


def test_evaluation_summary_reports_grounding_metrics_per_type():
    from app.evaluation.evaluate import markdown, summarize

    def row(kind, ious):
        return {"problem_type": kind, "data_source": "s", "accuracies": ious, "accuracy": sum(ious) / len(ious),
                "pass": 1.0}

    rows = [row("temporal grounding", [0.2]), row("temporal grounding", [0.8]), row("spatial grounding", [0.6]),
            row("multiple choice", [1.0])]
    summary = summarize(rows, [], 1)
    assert summary["grounding"]["temporal grounding"] == pytest.approx(
        {"mIoU": 0.5, "R@0.3": 0.5, "R@0.5": 0.5, "R@0.7": 0.5})
    assert summary["grounding"]["spatial grounding"]["R@0.5"] == 1.0
    assert "temporal grounding: mIoU 0.500, R@0.3 0.500" in markdown(summary, "t")
