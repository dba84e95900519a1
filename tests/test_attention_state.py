"""Whoever switches a model's attention setting puts it back: after scoring without gradients (the reference, the
old policy, the judge, the self-check, benchmarks), after a training step (its backward done), the model takes a
plain forward again. A training forward keeps the grouped setting until its backward has run (activation
checkpointing recomputes through it); ``attention_restored`` around forward and backward restores it."""

from __future__ import annotations

import pytest
import torch

from app.grouping import attention_restored, completion_logprobs, text_config
from tests.helpers import load, prompt_batch
from tests.test_trainer import assets, overrides  # noqa: F401  (assets: fixture)


def plain_forward(model):
    """A plain transformers forward of a few tokens (what an exported checkpoint's user runs)."""
    ids = torch.tensor([[11, 12, 13, 14]])
    return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def _batch(processor, videos):
    prompts = prompt_batch("qwen2_5_vl", processor, videos, ["video", "text"])
    ids = torch.randint(20, 200, (4, 5), generator=torch.Generator().manual_seed(0))
    return prompts, ids, torch.ones_like(ids)


@pytest.mark.parametrize("mode", ["grouped", "repeated"])
def test_scoring_without_gradients_leaves_the_attention_as_it_found_it(mode, tiny_checkpoints, videos):
    model, processor = load("qwen2_5_vl", tiny_checkpoints)
    before = text_config(model)._attn_implementation
    with torch.no_grad():
        completion_logprobs(model, *_batch(processor, videos), [2, 2], mode)
        assert text_config(model)._attn_implementation == before
        plain_forward(model)


def test_a_training_forward_keeps_its_setting_until_restored_after_the_backward(tiny_checkpoints, videos):
    from app.runtime.models import enable_activation_checkpointing

    model, processor = load("qwen2_5_vl", tiny_checkpoints)
    enable_activation_checkpointing(model)
    model.train()
    before = text_config(model)._attn_implementation
    with attention_restored(model):
        scores = completion_logprobs(model, *_batch(processor, videos), [2, 2])
        assert text_config(model)._attn_implementation == "prefix_grouper"  # the backward recomputes through it
        scores.logprobs.sum().backward()
    assert text_config(model)._attn_implementation == before
    with torch.no_grad():
        plain_forward(model)


def test_the_judge_leaves_its_model_usable_for_a_plain_forward(tiny_checkpoints, tmp_path):
    from tests.test_judge import COMPLETIONS, judge_for

    judge = judge_for("qwen2_5_vl", tiny_checkpoints, tmp_path)
    before = text_config(judge.model)._attn_implementation
    record = {"problem": "Which colour appears first?", "problem_type": "multiple choice", "data_type": "video",
              "options": ["A. red", "B. green"], "path": "clip.mp4", "solution": "<answer>B</answer>"}
    judge(COMPLETIONS, [record] * 4, [4])
    assert text_config(judge.model)._attn_implementation == before
    with torch.no_grad():
        plain_forward(judge.model)


def test_a_training_run_leaves_the_policy_as_it_found_it(assets, tmp_path, monkeypatch):  # noqa: F811
    """Two GRPO steps through the recipe's loop (rollouts, reference, the self-check, updates with backward): the
    policy's attention setting is what it was before the run, and a plain forward runs."""
    from app.config.loading import load_config
    from app.training.trainer import GRPOTrainer
    from tests.helpers import world_of_one

    cfg = load_config("configs/demo_cpu.yaml", overrides(assets, tmp_path / "run", **{
        "train.prompts_per_rank": 2, "rollout.group_size": 2, "rollout.max_completion_length": 4,
        "train.export_hf": False}))
    with world_of_one(monkeypatch):
        trainer = GRPOTrainer(cfg)
        before = text_config(trainer.engine)._attn_implementation
        trainer.train()
        assert text_config(trainer.engine)._attn_implementation == before
        with torch.no_grad():
            plain_forward(trainer.engine.module)
