"""The model judge (rewards.functions: judge): one grouped forward per group equals the same judge on each
[context; completion; verdict] alone, on Qwen2.5-VL (video context) and Qwen3-VL (image context), fp32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from app.config.sections import DataConfig
from app.rewards.judge import GroupedJudge, JudgeError
from tests.test_trainer import assets, overrides  # noqa: F401  (assets: fixture)

COMPLETIONS = ["<think>red first</think><answer>A</answer>", "<answer>B</answer>",
               "<think>the green square comes first, then the red one, so</think><answer>B</answer>", "B"]


def judge_for(family, checkpoints, tmp_path, verdict="yes"):
    from PIL import Image

    from app.data.video import write_mp4
    from app.runtime.models import load_model, load_processor

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
    return GroupedJudge(model, load_processor(checkpoints[family]), data, tmp_path, verdict=verdict)


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


@pytest.mark.parametrize(("family", "kind"), [("qwen2_5_vl", "video"), ("qwen3_vl", "image")])
def test_score_verdict_is_the_expected_digit_of_the_judge_alone(family, kind, tiny_checkpoints, tmp_path):
    """rewards.judge_verdict=score: the grouped forward's digit distribution equals a plain HF forward of each
    [context; completion; verdict] (full logits at its last position), and the reward is its expected digit / 9."""
    from app.grouping import repeated_inputs

    judge = judge_for(family, tiny_checkpoints, tmp_path, verdict="score")
    record = {"problem": "Which colour appears first?", "problem_type": "multiple choice", "data_type": kind,
              "options": ["A. red", "B. green"], "path": "clip.mp4" if kind == "video" else "frame.png",
              "solution": "<answer>B</answer>"}
    prompts = judge.prompt(record)
    grouped = judge.digit_logprobs(prompts, COMPLETIONS, "B")
    assert torch.allclose(grouped, judge.digit_logprobs(prompts, COMPLETIONS, "B", mode="repeated"), atol=1e-5)
    for i, completion in enumerate(COMPLETIONS):  # the reference: HF's own forward, no grouping, no hook
        ids = torch.tensor([judge.response_ids(completion, "B")[:-1]])
        batch = repeated_inputs(judge.model, prompts, ids, torch.ones_like(ids), [1])
        with torch.no_grad():
            logits = judge.model(**batch).logits[0, -1].float()
        torch.testing.assert_close(grouped[i], logits.log_softmax(-1)[judge.digit_ids], rtol=0, atol=1e-5)
    rewards = judge(COMPLETIONS, [record] * 4, [4])
    want = (grouped.softmax(-1) @ torch.arange(10.0) / 9).tolist()
    assert rewards == pytest.approx(want, rel=1e-6) and all(0 <= r <= 1 for r in rewards)
    assert max(rewards) - min(rewards) > 0.01  # judged apart
    assert judge.digit_mass == pytest.approx(grouped.logsumexp(-1).exp().tolist(), rel=1e-6)


@pytest.mark.parametrize("verdict", ["yes", "score"])
def test_a_text_judge_reads_the_question_without_the_video(verdict, tiny_checkpoints, tmp_path):
    """A text checkpoint as the judge (no vision processor): the question's conversation without its media; grouped
    equals repeated."""
    judge = judge_for("qwen2", tiny_checkpoints, tmp_path, verdict=verdict)
    record = {"problem": "What colour is the square?", "problem_type": "free-form", "data_type": "video",
              "path": "clip.mp4", "solution": "<answer>red</answer>"}
    prompts = judge.prompt(record)
    text = judge.tokenizer.decode(prompts["input_ids"][0])
    assert "What colour is the square?" in text and "<|vision_start|>" not in text and len(prompts) == 2
    if verdict == "yes":
        got = [judge.group_log_scores(prompts, COMPLETIONS, "red", mode) for mode in ("grouped", "repeated")]
        assert np.allclose(*got, rtol=1e-5, atol=1e-6)
    else:
        got = [judge.digit_logprobs(prompts, COMPLETIONS, "red", mode) for mode in ("grouped", "repeated")]
        torch.testing.assert_close(*got, rtol=0, atol=1e-5)


def test_two_groups_are_judged_against_their_own_question(tiny_checkpoints, tmp_path):
    from app.rewards.rules import RewardSet

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
    from app.config.loading import ConfigError, load_config
    from app.runtime.models import load_model, load_processor

    with pytest.raises(JudgeError, match=r"must contain \{reference\}"):
        GroupedJudge(load_model(tiny_checkpoints["qwen2_5_vl"]), load_processor(tiny_checkpoints["qwen2_5_vl"]),
                     DataConfig(), tmp_path, "Is it right?")
    with pytest.raises(ConfigError, match="'rewards.judge_path' is required"):
        load_config("configs/demo_cpu.yaml", ["model.path=m", "rewards.functions=[format, judge]"])
    with pytest.raises(ConfigError, match="'rewards.judge_verdict' must be one of"):
        load_config("configs/demo_cpu.yaml", ["model.path=m", "rewards.judge_verdict=likert"])


@pytest.mark.parametrize(("zero", "verdict"), [("zero2", "score"), ("zero3", "yes")])
def test_grpo_trains_on_the_judges_reward_with_its_own_copy_or_partitioned(zero, verdict, assets, tmp_path,  # noqa: F811
                                                                         monkeypatch):
    """rewards.functions=[judge] in the trainer as a user runs it: the judge is the policy's own checkpoint, its
    own copy under ZeRO-2, partitioned like the reference under ZeRO-3, where it judges exactly as an own copy does;
    the rewards differ within groups, so the weights move."""
    from app.config.loading import load_config
    from app.runtime.models import load_model, load_processor
    from app.training.trainer import GRPOTrainer
    from tests.helpers import world_of_one

    cfg = load_config("configs/demo_cpu.yaml", overrides(assets, tmp_path / "run", **{
        "rewards.functions": "[judge]", "rewards.judge_path": assets["checkpoint"], "rewards.judge_verdict": verdict,
        "train.deepspeed_config": f"deepspeed_configs/{zero}.json", "train.max_steps": 1}))
    record = json.loads(Path(assets["train"]).read_text().splitlines()[0])
    record["_root"] = str(Path(assets["train"]).parent)
    own = GroupedJudge(load_model(assets["checkpoint"]), load_processor(assets["checkpoint"]), cfg.data,
                       Path(assets["train"]).parent, verdict=verdict)(COMPLETIONS, [record] * 4, [4])
    with world_of_one(monkeypatch):
        trainer = GRPOTrainer(cfg)
        judge = trainer.rewards.functions[0][1]
        assert judge.partitioned == (zero == "zero3") and judge.verdict == verdict
        before = [p.detach().clone() for p in trainer.engine.module.parameters() if p.requires_grad and p.numel()]
        metrics = trainer.train_step(0)
        after = [p.detach().clone() for p in trainer.engine.module.parameters() if p.requires_grad and p.numel()]
        judged = judge(COMPLETIONS, [record] * 4, [4])
    assert 0 < metrics["reward/judge"] < 1 and metrics["reward/std"] > 0
    if zero == "zero2":  # ZeRO-3 keeps each rank's shard in .data only between gathers: compare where it can
        assert sum(not torch.equal(a, b) for a, b in zip(before, after)) > len(before) // 2
    assert judged == pytest.approx(own, rel=1e-5)  # the partitioned judge judges as its own copy does
