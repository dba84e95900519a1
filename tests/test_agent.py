"""GRPO with tools (app.training.agent) as a user runs it: rollout.tools in the config, trees trained through the tree
scorer, the weights move. The tiny random model never writes a tool call by itself, so one test scripts its first
turns (a get_frames call and a malformed one, teacher-forced log-probs) and samples the rest for real."""

from __future__ import annotations

import json

import pytest
import torch

from app.config.loading import ConfigError, load_config
from tests.helpers import world_of_one
from tests.test_trainer import assets, overrides, run  # noqa: F401  (assets: fixture)

pytestmark = pytest.mark.distributed

TOOLS = {"rollout.tools": "[get_frames, zoom]", "rollout.group_size": 4, "rollout.branching": "[2, 2]",
         "rollout.max_turns": 2, "rollout.max_completion_length": 8, "train.max_steps": 1,
         "rewards.tool_call_cost": 0.05, "rewards.valid_call_bonus": 0.2}


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def scripted_first_turns(trainer_):
    """The trainer's sampler, with every first turn written for it: even samples ask for frames, odd ones write
    a malformed call; their log-probs are the policy's own (teacher-forced)."""
    from app.data.prompts import collate_prompts
    from app.grouping import completion_logprobs
    from app.rollout.generate import Rollout

    real = trainer_.sampler
    tok = trainer_.tokenizer

    def sampler(asked, group_size, seeds, max_new_tokens):
        if not trainer_.first_turn:  # a later turn: the policy samples
            return real(asked, group_size, seeds, max_new_tokens)
        trainer_.first_turn = False
        batch = collate_prompts([p.inputs for p in asked], tok.pad_token_id)
        group_sizes = [group_size] * len(asked)
        texts = [call("get_frames", start=0.0, end=1.0) if j % 2 == 0 else "<tool_call>{nope</tool_call>"
                 for size in group_sizes for j in range(size)]
        ids = [tok.encode(t, add_special_tokens=False) for t in texts]
        width = max(len(i) for i in ids)
        completion = torch.tensor([i + [tok.pad_token_id] * (width - len(i)) for i in ids])
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
        with torch.no_grad():
            logprobs = completion_logprobs(trainer_.engine.module, {k: v for k, v in batch.items()}, completion,
                                           mask, group_sizes).logprobs
        return Rollout(completion, mask, logprobs, list(group_sizes), ["stop_string"] * len(texts), 0)

    return sampler


@pytest.mark.parametrize("engine", ["grouped", pytest.param("hf", marks=pytest.mark.slow)])
def test_grpo_with_tools_trains_on_trees_with_observations(engine, assets, tmp_path, monkeypatch):  # noqa: F811
    from app.training.train import recipe_for

    cfg = load_config("configs/demo_cpu.yaml", overrides(assets, tmp_path / "run", **TOOLS,
                                                         **{"rollout.engine": engine}))
    with world_of_one(monkeypatch):
        trainer_ = recipe_for(cfg)
        assert type(trainer_).__name__ == "AgentGRPOTrainer"
        next_prompts = trainer_.stream.next_prompts

        def remember(n):
            trainer_.first_turn = True  # the next sampler call is these prompts' first turn
            return next_prompts(n)

        trainer_.stream.next_prompts = remember
        trainer_.sampler = scripted_first_turns(trainer_)
        before = {n: p.detach().clone() for n, p in trainer_.engine.module.named_parameters()}
        metrics = trainer_.train_step(0)
        after = dict(trainer_.engine.module.named_parameters())
    assert metrics["tools/calls"] == 4 and metrics["tools/valid"] == 2 and metrics["tools/malformed"] == 2
    assert metrics["reward/tool_bonus"] == pytest.approx(0.1) and metrics["reward/tool_cost"] == pytest.approx(-0.05)
    assert metrics["reward/std"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))
    assert metrics["tokens/policy_forward"] > 0
    moved = [n for n in before if not torch.equal(before[n], after[n].detach())]
    assert len(moved) > len(before) // 2


def test_plain_grpo_entry_refuses_tools_and_bad_settings_are_named(assets, tmp_path):  # noqa: F811
    from app.training.trainer import plain_grpo

    with pytest.raises(ConfigError, match="run python -m app.training.train"):  # python -m app.training.trainer with tools set
        plain_grpo(load_config("configs/demo_cpu.yaml", overrides(assets, tmp_path / "plain", **TOOLS)))
    for extra, says in ((("rollout.engine", "vllm"),), r"'rollout.vllm_max_videos' \(1\) is below"), \
                       ((("rollout.branching", "[3, 2]"),), "makes 6 rollouts per prompt"), \
                       ((("rewards.temporal", True),), "not available with rollout.tools"):
        with pytest.raises(ConfigError, match=says):
            load_config("configs/demo_cpu.yaml", overrides(assets, tmp_path / "x", **{**TOOLS, **dict(extra)}))


@pytest.mark.slow  # 17 s: make test-all and CI run it
def test_train_sh_runs_grpo_with_tools_under_zero3_with_two_processes(assets, tmp_path):  # noqa: F811
    """The launcher as a user runs it: rollout.tools set, ZeRO-3, 2 processes; the ranks' turns stay in step."""
    out = tmp_path / "zero3"
    run(["bash", "scripts/train.sh", "configs/demo_cpu.yaml", *overrides(assets, out, **{
        **TOOLS, "train.max_steps": 2, "train.deepspeed_config": "deepspeed_configs/zero3.json",
        "train.export_hf": False})], env={"NPROC_PER_NODE": "2"}, timeout=400)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2] and all("tools/calls" in m for m in lines)
    assert "self-check passed: packed trees vs their paths" in (out / "logs" / "rank0.log").read_text()


@pytest.mark.slow
def test_a_killed_run_with_tools_resumes_to_the_uninterrupted_result(assets, tmp_path):  # noqa: F811
    """rollout.tools through scripts/train.sh: a resume from the step-2 checkpoint (a copy of the uninterrupted run
    cut back to it, as a crash after step 2 leaves it; the dying is tests/test_crash.py's) ends bitwise equal to the
    run that was never interrupted (turn seeds derive from the step, the rank and the prompt, so the resumed steps
    redraw the same trees)."""
    from tests.helpers import cut_back_copy
    from tests.test_trainer import assert_trained_and_equal

    settings = {**TOOLS, "train.max_steps": 3, "train.save_every": 1}

    def command(out, **extra):
        return ["bash", "scripts/train.sh", "configs/demo_cpu.yaml", *overrides(assets, out, **settings, **extra)]

    run(command(tmp_path / "straight"))
    cut_back_copy(tmp_path / "straight", tmp_path / "resumed", 2)
    resumed = run(command(tmp_path / "resumed", **{"train.resume": True}))
    assert "step-0000002" in resumed.stderr
    assert_trained_and_equal(tmp_path / "resumed" / "final", tmp_path / "straight" / "final", assets["checkpoint"])


def test_selected_groups_keep_their_trees_and_every_draws_tool_counts():
    """Dynamic sampling picks groups from several draws: each keeps its tree, and the tool counts are those of
    every draw made (as the groups/* counts are)."""
    from app.rollout.generate import Rollout
    from app.training.trajectory import Trajectory

    def drawn(calls: int) -> Trajectory:
        rollout = Rollout(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long), torch.zeros(2, 3),
                          [2], ["eos", "eos"], 0)
        return Trajectory([None], rollout, ["a", "b"], [0.0, 1.0], {"x": [0.0, 1.0]}, torch.tensor([0.0, 1.0]),
                          trees=[f"tree of draw {calls}"], counts={"tools/calls": float(calls)})

    picked = Trajectory.select([drawn(2), drawn(3)], [(1, 0)], pad_id=0)
    assert picked.trees == ["tree of draw 3"] and picked.counts == {"tools/calls": 5.0}


def test_sft_with_tools_trains_the_models_turns_of_written_trajectories(assets, tmp_path, monkeypatch):  # noqa: F811
    """scripts/sft.sh's recipe with rollout.tools (app.training.agent_sft): each record's written turns go through the tool
    loop (the call runs; its clip is the next turn's context), the loss covers the model's turns only, the weights
    move, and a record without turns is skipped by name."""
    from app.training.sft import recipe_for

    records = [json.loads(line) for line in assets["train"].read_text().splitlines()]
    written = [{**r, "turns": [call("get_frames", start=0.0, end=1.0), f"<think>ok</think><answer>{'AB'[i % 2]}"
                                                                        "</answer>"]} for i, r in enumerate(records)]
    written[1].pop("turns")
    data = tmp_path / "turns.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in written))
    cfg = load_config("configs/demo_cpu.yaml", overrides(assets, tmp_path / "sft", **{
        **TOOLS, "data.train_file": data, "data.data_root": assets["train"].parent, "grpo.beta": 0.0,
        "rollout.branching": "[]", "rollout.group_size": 2}))
    with world_of_one(monkeypatch):
        recipe = recipe_for(cfg)
        assert type(recipe).__name__ == "AgentSFT"
        before = {n: p.detach().clone() for n, p in recipe.engine.module.named_parameters()}
        metrics = recipe.train_step(0)
        moved = sum(not torch.equal(before[n], p) for n, p in recipe.engine.module.named_parameters())
        drawn = recipe.stream.next_prompts(16)  # one of each record
        queue = [[p for p in drawn if "turns" not in p.record] + [p for p in drawn if "turns" in p.record][:1],
                 [p for p in drawn if "turns" in p.record][1:2]]
        recipe.stream.next_prompts = lambda n: queue.pop(0)[:max(n, 2)]
        skipped_before = sum(recipe.stream.skipped.values())
        kept = recipe.examples()
        skipped = sum(recipe.stream.skipped.values()) - skipped_before
    assert metrics["tools/calls"] == 4 and metrics["tools/valid"] == 4  # 2 prompts x 2 copies, every call ran
    assert metrics["loss"] > 0 and torch.isfinite(torch.tensor(metrics["loss"])) and moved > len(before) // 2
    assert skipped == 1 and len(kept) == 2 and all("turns" in p.record for p in kept)
    call_tokens = len(recipe.tokenizer(call("get_frames", start=0.0, end=1.0))["input_ids"])
    assert metrics["tokens/target"] > 4 * call_tokens  # both turns of each copy are trained, not the observation


def test_grpo_with_tools_replays_each_trees_routing_on_a_mixture_of_experts(assets, tiny_checkpoints, tmp_path,  # noqa: F811
                                                                           monkeypatch):
    """rollout.routing_replay=r3 with tools on Qwen3-VL-MoE, one step in this process: the trees carry the
    rollout's experts (the written first turns' as their forward routed them, the sampled turns' as the grouped
    engine recorded them) and every forward of the update replays them; the step says how many replayed tokens the
    update's routers would have sent elsewhere (none on the rollout's own weights) and the weights move."""
    from app.training.train import recipe_for

    settings = {**TOOLS, "rollout.routing_replay": "r3", "model.path": tiny_checkpoints["qwen3_vl_moe"],
                "model.train_router": True}
    cfg = load_config("configs/demo_cpu.yaml", overrides(assets, tmp_path / "run", **settings))
    with world_of_one(monkeypatch):
        trainer_ = recipe_for(cfg)
        next_prompts = trainer_.stream.next_prompts

        def remember(n):
            trainer_.first_turn = True
            return next_prompts(n)

        trainer_.stream.next_prompts = remember
        written = scripted_first_turns(trainer_)

        def recording(asked, group_size, seeds, max_new_tokens):  # the written turns' experts, as a forward routes
            first = trainer_.first_turn
            rollout = written(asked, group_size, seeds, max_new_tokens)
            if first:
                from app.data.prompts import collate_prompts
                from app.grouping import completion_logprobs

                batch = collate_prompts([p.inputs for p in asked], trainer_.tokenizer.pad_token_id)
                with torch.no_grad():
                    rollout.routing = completion_logprobs(trainer_.engine.module, batch, rollout.completion_ids,
                                                          rollout.completion_mask, group_size,
                                                          record_routing=True).routing
            assert rollout.routing is not None
            return rollout

        trainer_.sampler = recording
        before = {n: p.detach().clone() for n, p in trainer_.engine.module.named_parameters()}
        metrics = trainer_.train_step(0)
        after = dict(trainer_.engine.module.named_parameters())
    assert metrics["routing/replay_differs"] == 0 and metrics["tools/calls"] == 4, metrics
    moved = [n for n in before if not torch.equal(before[n], after[n].detach())]
    assert len(moved) > len(before) // 2 and any(".mlp.gate." in n for n in moved)
