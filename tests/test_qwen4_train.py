"""Qwen3.8-Flash-Next's tiny model (``qwen4_exp``) through the launchers: scripts/train.sh on 2 processes under
ZeRO-3, one process against 2 as one replica of S = 2, a run killed with -9 and resumed, scripts/eval.sh and
scripts/plan.sh (slow set; its own module so that pytest -n 2 --dist loadfile can run it beside the
other MoE launches)."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from app.runtime.models import build_tiny_checkpoint
from tests.helpers import killed_at_random
from tests.test_experts_train import assert_close_weights, metrics, moe_overrides, train_assets
from tests.test_trainer import run, weights

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen4_train")
    return {**train_assets(root), "checkpoints": {"qwen4_exp": build_tiny_checkpoint(root / "qwen4_exp", "qwen4_exp",
                                                                                    seed=0)}}


@pytest.mark.slow  # a launch of one process, three of 2, an evaluation and a plan (about 2 minutes on 2 cores)
def test_qwen4_exp_through_the_launchers_two_processes_equal_one_resume_after_kill_evaluate_and_plan(assets, tmp_path):
    """Qwen3.8-Flash-Next's tiny model (GDN and QSA layers, PLE tables in host memory, hyper-connections, experts)
    as a user runs it: scripts/train.sh, k = 2 questions on one video, rollouts through HF generate, ZeRO-3, 3 steps,
    in one process and in 2 processes holding each packed row half each (S = 2: one data-parallel replica, so the
    same prompts and seeds): the same rollouts, loss, KL, gradient norm and entropy within 1e-4 and the weights equal
    up to float32 summation order (``assert_sequence_parallel_matches``; every weight within 1e-4 of its norm too).
    The 2-process run killed with -9 at a random time and resumed ends at its uninterrupted weights bit for bit;
    scripts/eval.sh scores its export and scripts/plan.sh plans the family's config. The gradients themselves, every
    QSA choice and PLE lookup: the forward's own check in ``tests/test_sequence_parallel.py``."""
    import subprocess

    from tests.test_trainer import ROOT, assert_sequence_parallel_matches

    checkpoint = assets["checkpoints"]["qwen4_exp"]
    common = {"train.max_steps": 3, "data.questions_per_video": 2, "data.train_file": assets["shared_train"],
              "train.prompts_per_rank": 2, "train.groups_per_micro_batch": 2, "train.save_every": 1,
              "rollout.engine": "hf", "model.train_router": True,
              "train.deepspeed_config": "deepspeed_configs/zero3.json"}

    def command(out, **extra):
        return ["bash", "scripts/train.sh", "configs/demo_cpu.yaml", *moe_overrides(assets, "qwen4_exp", out,
                                                                                    **{**common, **extra})]

    run(command(tmp_path / "one", **{"train.save_every": 0}))  # the reference alone: no checkpoints to write
    env, two = {"NPROC_PER_NODE": "2"}, {"train.sequence_parallel_size": 2}
    start = time.time()
    launched = run(command(tmp_path / "two", **two), env=env)
    took = time.time() - start
    assert "1 data-parallel replica(s) of 2 sequence-parallel ranks" in launched.stderr
    assert "self-check passed (sequence parallel" in launched.stderr
    assert_sequence_parallel_matches(tmp_path / "one", tmp_path / "two", checkpoint)
    initial = weights(checkpoint)
    assert_close_weights(weights(tmp_path / "two" / "final"), weights(tmp_path / "one" / "final"), initial, 1e-4)
    rows = metrics(tmp_path / "two")
    assert rows[-1]["tokens/shared_video"] > 0 and "router/entropy" in rows[-1]

    killed = tmp_path / "killed"
    killed_at_random(command(killed, **two), killed, env, took, random.Random("qwen4_exp"), (0.5, 0.9))
    run([*command(killed, **two), "train.resume=true"], env=env)
    want, got = weights(tmp_path / "two" / "final"), weights(killed / "final")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)

    run(["bash", "scripts/eval.sh", str(killed / "final"), str(assets["heldout"]),
         f"eval.output_dir={tmp_path / 'eval'}", "eval.max_new_tokens=4", "eval.engine=hf"],
        env={"NPROC_PER_NODE": "1"})
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())
    planned = subprocess.run(["bash", "scripts/plan.sh", "configs/qwen3_8_flash_next_video_lora.yaml",
                              "--out", str(tmp_path / "plan")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "host memory per node" in planned.stdout
