"""The model judge (rewards.functions: judge): one grouped forward per group equals the same judge on each
[context; completion; verdict] alone, on Qwen2.5-VL (video context) and Qwen3-VL (image context), fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.config import DataConfig
from app.judge import GroupedJudge, JudgeError

COMPLETIONS = ["<think>red first</think><answer>A</answer>", "<answer>B</answer>",
               "<think>the green square comes first, then the red one, so</think><answer>B</answer>", "B"]


def judge_for(family, checkpoints, tmp_path):
    from PIL import Image

    from app.data.video import write_mp4
    from app.models import load_model, load_processor

    rng = np.random.default_rng(0)
    write_mp4(tmp_path / "clip.mp4", rng.integers(0, 255, (8, 56, 84, 3), dtype=np.uint8), fps=4)
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(tmp_path / "frame.png")
    model = load_model(checkpoints[family])
    torch.manual_seed(1)
    with torch.no_grad():  # sharper than the random init, so the judge's probabilities differ by completion
        for param in model.parameters():
            if param.ndim >= 2:
                param.normal_(0.0, 0.2)
    data = DataConfig(max_frames=8, min_pixels=3136, max_pixels=3136, image_min_pixels=3136, image_max_pixels=4096)
    return GroupedJudge(model, load_processor(checkpoints[family]), data, tmp_path)


@pytest.mark.parametrize(("family", "kind"), [("qwen2_5_vl", "video"), ("qwen3_vl", "image")])
def test_grouped_judge_equals_the_judge_on_each_completion_alone(family, kind, tiny_checkpoints, tmp_path):
    judge = judge_for(family, tiny_checkpoints, tmp_path)
    record = {"problem": "Which colour appears first?", "problem_type": "multiple choice", "data_type": kind,
              "options": ["A. red", "B. green"], "path": "clip.mp4" if kind == "video" else "frame.png",
              "solution": "<answer>B</answer>"}
    prompts = judge.prompt(record)
    assert ("pixel_values_videos" if kind == "video" else "pixel_values") in prompts
    grouped = judge.group_log_scores(prompts, COMPLETIONS, "B")
    alone = [judge.group_log_scores(prompts, [c], "B")[0] for c in COMPLETIONS]  # [context; completion; verdict]
    repeated = judge.group_log_scores(prompts, COMPLETIONS, "B", mode="repeated")
    for other in (alone, repeated):  # log P(yes), 1e-5 relative
        assert np.allclose(grouped, other, rtol=1e-5, atol=1e-6), (grouped, other)
    assert max(grouped) - min(grouped) > 0.1  # the completions are judged apart, not one number for all
    assert judge(COMPLETIONS, [record] * 4, [4]) == pytest.approx(np.exp(grouped).tolist(), rel=1e-6)


def test_two_groups_are_judged_against_their_own_question(tiny_checkpoints, tmp_path):
    from app.rewards import RewardSet

    judge = judge_for("qwen2_5_vl", tiny_checkpoints, tmp_path)
    first = {"problem": "What colour?", "problem_type": "free-form", "data_type": "video", "path": "clip.mp4",
             "solution": "<answer>red</answer>"}
    second = {**first, "solution": "<answer>green</answer>"}
    both = judge(COMPLETIONS[:2] + COMPLETIONS[2:], [first, first, second, second], [2, 2])
    assert both[:2] == pytest.approx(judge(COMPLETIONS[:2], [first] * 2, [2]), rel=1e-5)
    assert both[2:] == pytest.approx(judge(COMPLETIONS[2:], [second] * 2, [2]), rel=1e-5)
    assert both[2:] != pytest.approx(judge(COMPLETIONS[2:], [first] * 2, [2]), rel=1e-3)  # its own reference

    class Rewards:
        functions, weights, regression, length, temporal, bonus_rules = ["judge"], [], "relative_error", False, \
            False, "video_r1"

    scored = RewardSet(Rewards(), judge=judge).score(COMPLETIONS, [first, first, second, second], [2, 2], [5] * 4)
    assert scored.rewards["judge"] == pytest.approx(both)


def test_a_judge_that_cannot_score_is_named(tiny_checkpoints, tmp_path):
    from app.config import ConfigError, load_config
    from app.models import load_model, load_processor

    with pytest.raises(JudgeError, match=r"must contain \{reference\}"):
        GroupedJudge(load_model(tiny_checkpoints["qwen2_5_vl"]), load_processor(tiny_checkpoints["qwen2_5_vl"]),
                     DataConfig(), tmp_path, "Is it right?")
    with pytest.raises(ConfigError, match="'rewards.judge_path' is required"):
        load_config("configs/demo_cpu.yaml", ["model.path=m", "rewards.functions=[format, judge]"])
