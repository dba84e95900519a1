"""GRPO with data.questions_per_video > 1, as a user runs it: the same step as k = 1 on the same prompts and
completions (rollout.engine=replay), fewer tokens, per-question advantages; the shared rollout in a real step."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from app.config.loading import ConfigError, load_config
from app.data.synthetic import generate
from app.runtime.models import build_tiny_checkpoint
from tests.helpers import max_rel_diff, world_of_one

STAGE0 = {"zero_optimization": {"stage": 0}}  # gradients stay on the parameters until the step (compared here)


@pytest.fixture(scope="module")
def shared_assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-train")
    checkpoint = build_tiny_checkpoint(root / "tiny", "qwen2_5_vl", seed=0)
    files = generate(root / "data", train=8, heldout=0, seed=0, questions_per_video=4)  # 2 clips x 4 questions
    plugin = root / "varied_reward.py"  # rewards that differ within every group: the weights really move
    plugin.write_text("def varied(completions, records):\n    return [len(c) % 5 / 4 for c in completions]\n")
    (root / "stage0.json").write_text(json.dumps(STAGE0))
    return {"root": root, "checkpoint": checkpoint, "train": files["train"], "plugin": f"{plugin}:varied",
            "stage0": root / "stage0.json"}


def shared_overrides(assets, out, **extra) -> list[str]:
    base = {
        "model.path": assets["checkpoint"], "data.train_file": assets["train"], "train.output_dir": out,
        "data.shuffle": False, "data.max_frames": 4, "train.max_steps": 1, "train.prompts_per_rank": 4,
        "train.groups_per_micro_batch": 4, "train.learning_rate": 1e-3, "train.save_every": 0,
        "rollout.group_size": 2, "rollout.max_completion_length": 6, "grpo.beta": 0.04,
        "logging.progress_bar": False, "logging.wandb_mode": "disabled", "train.export_hf": False,
        "train.deepspeed_config": assets["stage0"], "rewards.functions": f"[format, accuracy, '{assets['plugin']}']",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def one_step(assets, out, monkeypatch, **extra):
    """One GRPO step in this process: its metrics, the gradients the optimizer step saw, the rollout."""
    from app.training.trainer import GRPOTrainer

    cfg = load_config("configs/demo_cpu.yaml", shared_overrides(assets, out, **extra))
    seen = {}
    with world_of_one(monkeypatch):
        trainer = GRPOTrainer(cfg)
        step = trainer.engine.step

        def capture():
            seen["grads"] = {n: p.grad.detach().clone() for n, p in trainer.engine.module.named_parameters()
                             if p.grad is not None}
            return step()

        trainer.engine.step = capture
        collected = {}
        collect = trainer.collect

        def keep(index):
            collected["t"] = collect(index)
            return collected["t"]

        trainer.collect = keep
        metrics = trainer.train_step(0)
    return metrics, seen["grads"], collected["t"]


def test_k4_is_the_k1_step_on_the_same_prompts_and_completions(shared_assets, tmp_path, monkeypatch):
    """k = 1 records its rollouts; k = 4 replays them (same prompts: the file lists each clip's questions
    together, unshuffled): the same per-question rewards and advantages, loss and every gradient (fp32), the KL
    reference through the same families; its policy forward packs each clip once."""
    base, base_grads, base_t = one_step(shared_assets, tmp_path / "k1", monkeypatch,
                                        **{"rollout.record": True})
    shared, grads, t = one_step(shared_assets, tmp_path / "k4", monkeypatch, **{
        "data.questions_per_video": 4, "rollout.engine": "replay", "rollout.replay_dir": tmp_path / "k1"})
    assert [p.record["problem_id"] for p in t.prompts] == [p.record["problem_id"] for p in base_t.prompts]
    assert torch.equal(t.rollout.completion_ids, base_t.rollout.completion_ids)
    assert torch.equal(t.advantages, base_t.advantages) and base_t.advantages.abs().sum() > 0
    assert math.isclose(shared["loss"], base["loss"], rel_tol=1e-5, abs_tol=1e-7)
    assert math.isclose(shared["kl"], base["kl"], rel_tol=1e-4, abs_tol=1e-8)
    assert set(grads) == set(base_grads) and sum(float(g.abs().sum()) for g in base_grads.values()) > 0
    worst = max(grads, key=lambda n: max_rel_diff(grads[n], base_grads[n]))
    assert max_rel_diff(grads[worst], base_grads[worst]) <= 1e-4, worst
    assert base["tokens/shared_video"] == 0 and shared["tokens/shared_video"] > 0
    assert shared["tokens/policy_forward"] == base["tokens/policy_forward"] - shared["tokens/shared_video"]
    fraction = shared["tokens/shared_video"] / sum(p.length for p in t.prompts)  # of the prompts' tokens
    assert shared["tokens/shared_video_fraction"] == pytest.approx(fraction) and fraction > 0.1
    assert base["data/media_decoded"] == 4 and shared["data/media_decoded"] == 1


def test_a_k4_step_with_the_shared_rollout_trains(shared_assets, tmp_path, monkeypatch):
    """The grouped engine's shared rollout in a real step (LoRA, so the tower is frozen and the reference is the
    policy with its adapters off): the video prefilled once, the weights move, the step logs what was shared."""
    metrics, grads, t = one_step(shared_assets, tmp_path / "run", monkeypatch, **{
        "data.questions_per_video": 4, "lora.rank": 4})
    plain_prefill = sum(p.length for p in t.prompts)
    # one clip's shared tokens prefilled once: what the training forward also left out
    assert t.rollout.prefill_tokens == plain_prefill - metrics["tokens/shared_video"] < plain_prefill
    assert metrics["reward/std"] > 0 and math.isfinite(metrics["loss"])
    assert any(".lora_" in n and float(g.abs().sum()) > 0 for n, g in grads.items())
    assert metrics["tokens/shared_video"] > 0 and metrics["data/media_decoded"] == 1


def test_t_grpo_keeps_working_with_k4(shared_assets, tmp_path, monkeypatch):
    """rewards.temporal with k = 4: each question's shuffled-frame prompt is another video, encoded and rolled out on
    its own (nothing shared, nothing cached); the step's own prompts still share theirs."""
    from app.training.trainer import GRPOTrainer

    shuffled = []
    real = GRPOTrainer.shuffled_texts

    def spy(self, step, prompts):
        out = real(self, step, prompts)
        shuffled.append(len(out))
        return out

    monkeypatch.setattr(GRPOTrainer, "shuffled_texts", spy)
    metrics, _, t = one_step(shared_assets, tmp_path / "run", monkeypatch, **{
        "data.questions_per_video": 4, "rewards.temporal": True})
    assert shuffled == [4] and "reward/temporal" in metrics and math.isfinite(metrics["loss"])
    assert metrics["tokens/shared_video"] > 0


@pytest.mark.parametrize("override, key", [
    ({"rollout.tools": "[get_frames]"}, "data.questions_per_video"),
    ({"forward.attention_backend": "packed"}, "forward.attention_backend"),
    ({"forward.attention_backend": "paper"}, "forward.attention_backend"),
    ({"data.questions_per_video": 0}, "data.questions_per_video"),
])
def test_what_does_not_share_a_video_is_refused_by_name(shared_assets, tmp_path, override, key):
    extra = {"data.questions_per_video": 4, **override}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("configs/demo_cpu.yaml", shared_overrides(shared_assets, tmp_path, **extra))


def uneven_video_data(root, seed: int = 3):
    """Clips asked 1, 6, 3, 2, 5 and 4 questions, and three questions without a video among them."""
    files = generate(root, train=21, heldout=0, seed=seed, questions_per_video=(1, 6, 3, 2, 5, 4))
    records = [json.loads(line) for line in files["train"].read_text().splitlines()]
    text = [{**{k: v for k, v in r.items() if k not in ("path", "data_type")}, "problem_id": 1000 + i,
             "problem": "Without a video: " + r["problem"]} for i, r in enumerate(records[:3])]
    records = records[:7] + text[:2] + records[7:15] + text[2:] + records[15:]
    files["train"].write_text("".join(json.dumps(r) + "\n" for r in records))
    return files["train"]


def kill_resume_equals_straight(shared_assets, tmp_path, settings: dict, seed: int | None, check=None):
    """scripts/train.sh with ``settings`` on 4 processes: straight, then killed (SIGKILL) at a moment drawn from
    ``seed`` and resumed (``seed=None``: resumed from a copy cut back to step 1's checkpoint, as a crash right after
    it leaves a run); the resumed run ends bit for bit at the straight run's weights, which training moved.
    ``check(out, stderr)`` looks at the straight run first."""
    import random

    from safetensors.torch import load_file

    from tests.helpers import cut_back_copy, killed_at_random
    from tests.test_trainer import run

    env = {"NPROC_PER_NODE": "4"}

    def launch(out, **extra):
        return ["bash", "scripts/train.sh", "configs/demo_cpu.yaml",
                *shared_overrides(shared_assets, out, **settings, **extra)]

    start = time.perf_counter()
    straight_run = run(launch(tmp_path / "straight"), env=env, timeout=900)
    took = time.perf_counter() - start
    if check is not None:
        check(tmp_path / "straight", straight_run.stderr)
    if seed is None:
        cut_back_copy(tmp_path / "straight", tmp_path / "resumed", 1)
    else:
        # somewhere in start-up, a step or a save
        killed_at_random(launch(tmp_path / "resumed"), tmp_path / "resumed", env, took, random.Random(seed), (0.3, 0.8))
    resumed_run = run(launch(tmp_path / "resumed", **{"train.resume": True}), env=env, timeout=900)
    if seed is None:
        assert "step-0000001" in resumed_run.stderr
    straight, resumed = (load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in ("straight", "resumed"))
    initial = load_file(str(shared_assets["checkpoint"] / "model.safetensors"))
    assert sum(not torch.equal(straight[n], initial[n]) for n in straight) > len(straight) // 2
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


@pytest.mark.slow  # two 4-process runs through scripts/train.sh
@pytest.mark.distributed
def test_four_processes_at_s2_with_k4_under_zero3_resume_to_the_straight_runs_weights(shared_assets, tmp_path):
    """scripts/train.sh, 4 ranks as 2 replicas of S = 2, data.questions_per_video=4 on clips of 1 to 6 questions
    and records without video (shuffled), ZeRO-3, 2 steps: the families' rows sharded over each replica's 2 ranks,
    each family's video prefilled once per replica. Resumed from step 1's checkpoint (a copy of the run cut back
    there), the run ends bit for bit at the uninterrupted run's weights: the data stream's place and every rank's
    state come back at 2 x 2. Dying at a random moment is asserted at S = 4 below and in tests/test_crash.py."""
    train = uneven_video_data(shared_assets["root"] / "uneven")
    settings = {"data.train_file": train, "data.shuffle": True, "data.questions_per_video": 4,
                "train.sequence_parallel_size": 2, "train.deepspeed_config": "deepspeed_configs/zero3.json",
                "train.max_steps": 2, "train.save_every": 1, "train.export_hf": True, "train.prompts_per_rank": 4,
                "train.groups_per_micro_batch": 4}

    def check(out, stderr):
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2] and all(r["tokens/shared_video"] > 0 for r in rows)

    kill_resume_equals_straight(shared_assets, tmp_path, settings, None, check)


@pytest.mark.slow  # three 4-process runs through scripts/train.sh
@pytest.mark.distributed
def test_four_processes_at_s4_with_k6_spread_rollouts_under_zero3_killed_at_random_resume_to_the_same_weights(
        shared_assets, tmp_path):
    """scripts/train.sh, 4 ranks as one replica of S = 4, data.questions_per_video=6 on longer clips (32 frames
    sampled to 16) asked 1 to 6 questions, and records without video, ZeRO-3, chunked prefill and vision chunking:
    the step's families are fewer than the ranks, each rolled out spread over the group (rollout.sp_split=spread:
    at this length auto keeps them whole; said in the log),
    the tower's outputs kept for the training forwards. Each rank decodes only its quarter of each video
    (data.decode_shares, the default), on 2 threads (data.decode_threads=2: the clips have a keyframe every 4
    frames, so a share is read in pieces). Killed at a seeded random moment and resumed: bit for bit the
    uninterrupted run's weights."""
    files = generate(shared_assets["root"] / "long", train=21, heldout=0, seed=5, frames=32, size=56,
                     questions_per_video=(1, 6, 3, 2, 5, 4), keyframe_interval=4)
    settings = {"data.train_file": files["train"], "data.shuffle": True, "data.questions_per_video": 6,
                "data.max_frames": 16, "train.sequence_parallel_size": 4,
                "train.deepspeed_config": "deepspeed_configs/zero3.json", "train.max_steps": 2, "train.save_every": 1,
                "train.export_hf": True, "train.prompts_per_rank": 6, "train.groups_per_micro_batch": 6,
                "rollout.prefill_chunk_size": 64, "forward.vision_chunk_frames": 2, "model.freeze_vision_tower": True,
                "forward.vision_cache": "step", "rollout.sp_split": "spread", "data.decode_threads": 2}

    def check(out, stderr):
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2] and all(r["tokens/shared_video"] > 0 for r in rows)
        assert "each spread over the group" in stderr
        assert "decodes only its share of each video file (1/4 of its frames)" in stderr

    kill_resume_equals_straight(shared_assets, tmp_path, settings, 61, check)
