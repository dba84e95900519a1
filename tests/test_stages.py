"""The GRPO step's stages in one process: the typed containers, dynamic-sampling selection, reward composition with
the group bonuses, metric reductions, and one real step on a tiny model. Each fails at the function it names."""

from __future__ import annotations

import math

import pytest
import torch

from app.config.loading import load_config
from app.config.sections import RewardConfig
from app.data.records import EncodedPrompt
from app.objectives.grpo import choose_groups, groups_with_signal
from app.rewards.rules import RewardSet
from app.rollout.generate import Rollout
from app.runtime.tracking import StepMetrics
from app.training.metrics import group_counts, step_metrics
from app.training.trainer import collect_groups
from app.training.trajectory import Trajectory
from tests.helpers import world_of_one
from tests.test_trainer import assets, overrides  # noqa: F401  (assets: fixture)


def said(letter: str) -> str:
    return f"<think>x</think><answer>{letter}</answer>"


def fake_trajectory(accuracy: list[float], sizes: list[int], width: int = 3) -> Trajectory:
    """A scored trajectory without a model: prompt b's inputs are [1, b+3] tokens, completions of known length."""
    n = sum(sizes)
    prompts = [EncodedPrompt({"problem": f"q{b}", "solution": "<answer>A</answer>", "problem_id": b},
                             {"input_ids": torch.full((1, b + 3), b), "attention_mask": torch.ones(1, b + 3,
                                                                                                     dtype=torch.long)})
               for b in range(len(sizes))]
    lengths = [1 + i % width for i in range(n)]
    mask = torch.tensor([[1] * k + [0] * (width - k) for k in lengths])
    rollout = Rollout(completion_ids=torch.arange(n * width).view(n, width) * mask, completion_mask=mask,
                      logprobs=-torch.rand(n, width) * mask, group_sizes=list(sizes),
                      stop_reasons=["eos" if k < width else "length" for k in lengths], prefill_tokens=0)
    texts = [said("A") if a else said("B") for a in accuracy]
    return Trajectory(prompts, rollout, texts, list(accuracy), {"accuracy": list(accuracy)},
                      torch.tensor(accuracy, dtype=torch.float32))


# ---- containers ----------------------------------------------------------------------------------------------------
def test_select_takes_whole_groups_of_any_size_from_several_trajectories():
    a = fake_trajectory([1, 0, 1, 1, 1], [2, 3])
    b = fake_trajectory([0, 1, 0, 0], [1, 3])
    chosen = Trajectory.select([a, b], [(1, 1), (0, 0)], pad_id=0)
    assert chosen.group_sizes == [3, 2]
    assert chosen.accuracy == [1, 0, 0, 1, 0]
    assert chosen.prompts == [b.prompts[1], a.prompts[0]]
    assert torch.equal(chosen.total_reward, torch.tensor([1.0, 0, 0, 1, 0]))
    assert chosen.records == [b.prompts[1].record] * 3 + [a.prompts[0].record] * 2


def test_micro_batches_collate_once_and_cut_to_their_widest_completion():
    t = fake_trajectory([1, 0, 1, 1, 0, 1], [2, 1, 3], width=3)
    t.advantages = torch.arange(6.0)
    weights = t.rollout.completion_mask.float() * 2
    mbs = t.micro_batches(2, weights, pad_id=7, device="cpu")
    assert [mb.groups for mb in mbs] == [[0, 1], [2]]
    assert [mb.rows.tolist() for mb in mbs] == [[0, 1, 2], [3, 4, 5]]
    assert [mb.group_sizes for mb in mbs] == [[2, 1], [3]]
    first = mbs[0]
    assert first.inputs["input_ids"].shape == (2, 4)  # prompts of 3 and 4 tokens, left-padded to 4
    assert first.inputs["input_ids"][0, 0] == 7
    assert first.completion_ids.shape == (3, 3) and torch.equal(first.advantages, torch.tensor([0.0, 1, 2]))
    assert torch.equal(first.loss_weights, weights[:3]) and torch.equal(first.sampled_logprobs, t.rollout.logprobs[:3])


# ---- dynamic sampling -------------------------------------------------------------------------------------------
def test_groups_with_signal_and_choice():
    kept, dropped = groups_with_signal([1, 1, 0, 1, 0, 0, 0.5, 0.5], [2, 2, 2, 2])
    assert (kept, dropped) == ([1], [0, 2, 3])
    assert choose_groups(["a", "b", "c"], ["x"], 2) == (["a", "b"], 0)
    assert choose_groups(["a"], ["x", "y"], 3) == (["a", "x", "y"], 2)


class _Cfg:
    def __init__(self, **kw):
        self.dynamic_sampling, self.dynamic_sampling_metric, self.dynamic_sampling_max_draws = True, "accuracy", 4
        self.__dict__.update(kw)


def test_collect_draws_until_enough_groups_have_signal():
    draws = [fake_trajectory([1, 1, 0, 1], [2, 2]), fake_trajectory([0, 0, 1, 0], [2, 2]),
             fake_trajectory([0, 1, 1, 1], [2, 2])]
    asked = []

    def draw(k):
        asked.append(k)
        return draws[k]

    t = collect_groups(draw, 2, _Cfg(), pad_id=0, reduce_max=lambda v: v)
    assert asked == [0, 1]  # two groups with signal after the second draw
    assert t.accuracy == [0, 1, 1, 0] and t.group_sizes == [2, 2]
    assert t.draws["dynamic_sampling/dropped"] == 2 and t.draws["dynamic_sampling/filled"] == 0
    assert t.draws["dynamic_sampling/extra_draws"] == 1 and t.draws["groups/drawn"] == 4
    assert t.draws["groups/all_correct"] == 1 and t.draws["groups/all_wrong"] == 1


def test_collect_fills_with_groups_without_signal_when_draws_run_out():
    flat = fake_trajectory([1, 1, 0, 0], [2, 2])
    t = collect_groups(lambda k: flat, 2, _Cfg(dynamic_sampling_max_draws=1), pad_id=0, reduce_max=lambda v: v)
    assert t.draws["dynamic_sampling/filled"] == 2 and t.draws["dynamic_sampling/extra_draws"] == 1
    assert t.accuracy == [1, 1, 0, 0]


def test_collect_without_dynamic_sampling_takes_the_first_draw():
    t = fake_trajectory([1, 1, 0, 0], [2, 2])
    assert collect_groups(lambda k: t, 2, _Cfg(dynamic_sampling=False), pad_id=0) is t
    assert t.draws == group_counts([t])


# ---- rewards and bonuses -------------------------------------------------------------------------------------------
def test_reward_set_composes_weights_and_group_bonuses():
    cfg = RewardConfig(functions=["format", "accuracy"], weights=[0.5, 2.0], length=True, length_min_tokens=2,
                       length_max_tokens=3, length_bonus=0.2, temporal=True, temporal_alpha=0.3, temporal_ratio=0.8)
    rewards = RewardSet(cfg)
    records = [{"problem_type": "multiple choice", "solution": "<answer>A</answer>"}] * 4
    texts = [said("A"), said("A"), said("B"), "A"]
    scored = rewards.score(texts, records, [2, 2], lengths=[2, 5, 3, 2],
                           shuffled_texts={0: [said("B"), said("B")], 1: [said("A"), said("A")]})
    assert scored.accuracy == [1, 1, 0, 0]
    assert scored.rewards["format"] == [1, 1, 1, 0]
    assert scored.rewards["length"] == [0.2, 0.0, 0.0, 0.0]  # two correct in group 0; only the first in bounds
    assert scored.rewards["temporal"] == [0.3, 0.3, 0.0, 0.0]  # group 0 beats its shuffled run; group 1 does not
    assert scored.total == pytest.approx([0.5 + 2 + 0.2 + 0.3, 0.5 + 2 + 0.3, 0.5, 0.0])


# ---- metrics -------------------------------------------------------------------------------------------------------
def test_step_metrics_are_reduced_as_declared():
    m = StepMetrics()
    m.mean("a", 1.0)
    m.sum("b", 2.0)
    m.max("c", 3.0)
    m.fraction("d", 1.0, 4.0)
    m.local("e", 5.0)
    m.each("f", 7.0)
    m.max("f", 7.0)  # the same name with another reduction: both kept
    other = {"a": 3.0, "b": 4.0, "c": 1.0, "d": (3.0, 4.0), "e": 9.0, "f": 8.0}
    calls = []

    def gather(values):  # a second rank with other values
        calls.append(values)
        theirs = [other["a"], 0, other["b"], 0, other["c"], 0, *other["d"], other["e"], 0, other["f"], 0,
                  other["f"], 0]
        return [values, theirs]

    assert m.reduce(gather) == {"a": 2.0, "b": 6.0, "c": 3.0, "d": 0.5, "e": 5.0, "f": 8.0, "f/rank0": 7.0,
                                "f/rank1": 8.0}
    assert len(calls) == 1  # one collective for every metric
    with pytest.raises(KeyError):
        m.mean("a", 0.0)
    # 4 ranks in sequence-parallel pairs: means and sums count each pair once, max and each see every rank
    m = StepMetrics()
    m.mean("time", 1.0)
    m.sum("tokens", 10.0)
    m.max("peak", 1.0)
    m.each("peak", 1.0)
    rows = {"time": [1.0, 1.0, 3.0, 3.0], "tokens": [10.0, 10.0, 20.0, 20.0], "peak": [1.0, 2.0, 0.5, 1.5]}
    by_rank = [[rows["peak"][r], 0, rows["peak"][r], 0, rows["time"][r], 0, rows["tokens"][r], 0] for r in range(4)]
    assert m.reduce(lambda values: by_rank, copies=2) == {
        "time": 2.0, "tokens": 30.0, "peak": 2.0, "peak/rank0": 1.0, "peak/rank1": 2.0, "peak/rank2": 0.5,
        "peak/rank3": 1.5}


def test_step_metrics_of_a_trajectory():
    t = fake_trajectory([1, 0, 1, 1], [2, 2])
    t.draws = group_counts([t])
    updates = [{"loss": 0.5, "tokens": 10, "metrics": {"kl": 0.1, "entropy": 2.0, "mismatch/max_ratio": 1.5}},
               {"loss": 1.5, "tokens": 12, "metrics": {"kl": 0.3}}]
    seconds = {"rollout": 1.0, "data_wait": 0.1, "reference": 0.5, "policy": 2.0}
    values = step_metrics(t, updates, seconds, grouped=True).reduce()
    assert values["loss"] == 1.0 and values["kl"] == pytest.approx(0.2) and values["entropy"] == 2.0
    assert values["mismatch/max_ratio"] == 1.5 and values["tokens/policy_forward"] == 22
    assert values["accuracy"] == 0.75 and values["groups/all_correct"] == 0.5 and values["groups/trained"] == 2
    assert values["tokens/prefix_saved_by_grouping"] == 3 + 4  # prompts of 3 and 4 tokens, each saved once
    assert values["time/step"] == 3.5


# ---- one real step, in this process -------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["split", "masked"])
def test_a_grpo_step_in_process_with_any_backend(assets, tmp_path, monkeypatch, backend):  # noqa: F811
    from app.training.trainer import GRPOTrainer

    cfg = load_config("configs/demo_cpu.yaml", overrides(assets, tmp_path / "run", **{
        "forward.attention_backend": backend, "train.prompts_per_rank": 2, "rollout.group_size": 2,
        "rollout.max_completion_length": 4, "grpo.num_iterations": 2}))
    with world_of_one(monkeypatch):
        trainer = GRPOTrainer(cfg)
        t = trainer.collect(0)
        assert t.group_sizes == [2, 2] and len(t.texts) == 4 and t.draws["groups/drawn"] == 2
        before = {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters()}
        metrics = trainer.train_step(0)
        after = dict(trainer.engine.module.named_parameters())
    assert metrics["groups/trained"] == 2 and metrics["tokens/policy_forward"] > 0
    assert metrics["reward/std"] > 0 and metrics["grad_norm"] > 0  # rewards differ within a group: a real update
    assert math.isfinite(metrics["loss"]) and metrics["mismatch/mean_abs_logprob_diff"] < 1e-4
    # mu = 2: the second pass runs after the first update, so the policy has left the reference
    assert metrics["kl"] > 0
    moved = [n for n, p in after.items() if not torch.equal(p.detach(), before[n])]
    assert len(moved) > len(before) // 2, moved


@pytest.mark.parametrize("policy_loss", ["gspo", "gspo_token", "cispo", "sapo"])
def test_a_grpo_step_with_each_policy_objective_trains_and_logs_its_ratios(assets, tmp_path, monkeypatch,  # noqa: F811
                                                                           policy_loss):
    """One real step of the demo's GRPO with each newer objective (mu = 2, so the second pass sees ratios away
    from 1): the weights move and the step logs the ratio's mean, min and max (GSPO: the sequence ratios)."""
    from app.training.trainer import GRPOTrainer

    cfg = load_config("configs/demo_cpu.yaml", overrides(assets, tmp_path / "run", **{
        "grpo.policy_loss": policy_loss, "train.prompts_per_rank": 2, "rollout.group_size": 2,
        "rollout.max_completion_length": 4, "grpo.num_iterations": 2}))
    with world_of_one(monkeypatch):
        trainer = GRPOTrainer(cfg)
        before = {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters()}
        metrics = trainer.train_step(0)
        after = dict(trainer.engine.module.named_parameters())
    assert metrics["ratio/min"] <= metrics["ratio/mean"] <= metrics["ratio/max"]
    assert metrics["ratio/min"] < 1 < metrics["ratio/max"] or metrics["ratio/max"] != metrics["ratio/min"]
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert sum(not torch.equal(p.detach(), before[n]) for n, p in after.items()) > len(before) // 2
