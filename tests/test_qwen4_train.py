"""Qwen3.8-Flash-Next's tiny model (``qwen4_exp``) through the launchers: scripts/train.sh on 2 processes under
ZeRO-3 and ZeRO-2, a run killed with -9 and resumed, scripts/eval.sh and scripts/plan.sh (slow set; its own module
so that pytest -n 2 --dist loadfile can run it beside the other MoE launches)."""

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
    return train_assets(tmp_path_factory.mktemp("qwen4_train"))


@pytest.mark.slow  # four launches of 2 processes, an evaluation and a plan (about 2 minutes on 2 cores)
def test_qwen4_exp_through_the_launchers_zero3_equals_zero2_resumes_after_kill_evaluates_and_plans(assets, tmp_path):
    """Qwen3.8-Flash-Next's tiny model (GDN and QSA layers, PLE tables in host memory, hyper-connections, experts):
    scripts/train.sh, 2 processes, k = 2 questions on one video, rollouts through HF generate, 3 steps: ZeRO-3 reaches
    ZeRO-2's weights (1e-4), and killed with -9 at a random time and resumed ends at the uninterrupted run's weights;
    scripts/eval.sh scores its export and scripts/plan.sh plans it."""
    import subprocess

    from tests.test_trainer import ROOT

    checkpoint = build_tiny_checkpoint(assets["root"] / "qwen4_exp", "qwen4_exp", seed=0)
    common = {"train.max_steps": 3, "data.questions_per_video": 2, "data.train_file": assets["shared_train"],
              "train.prompts_per_rank": 2, "train.groups_per_micro_batch": 2, "train.save_every": 1,
              "rollout.engine": "hf", "model.train_router": True}
    env = {"NPROC_PER_NODE": "2"}
    family = {**assets, "checkpoints": {"qwen4_exp": checkpoint}}
    runs = {}
    for zero in ("zero2", "zero3"):
        out = tmp_path / zero
        start = time.time()
        run(["bash", "scripts/train.sh", "configs/demo_cpu.yaml", *moe_overrides(
            family, "qwen4_exp", out, **common, **{"train.deepspeed_config": f"deepspeed_configs/{zero}.json"})],
            env=env)
        runs[zero] = (out, time.time() - start)
    initial = weights(checkpoint)
    assert_close_weights(weights(runs["zero3"][0] / "final"), weights(runs["zero2"][0] / "final"), initial, 1e-4)
    rows = metrics(runs["zero3"][0])
    assert rows[-1]["tokens/shared_video"] > 0 and "router/entropy" in rows[-1]
    assert "self-check passed" in (runs["zero3"][0] / "logs" / "rank0.log").read_text()

    killed = tmp_path / "killed"
    command = ["bash", "scripts/train.sh", "configs/demo_cpu.yaml", *moe_overrides(
        family, "qwen4_exp", killed, **common, **{"train.deepspeed_config": "deepspeed_configs/zero3.json"})]
    killed_at_random(command, killed, env, runs["zero3"][1], random.Random("qwen4_exp"), (0.5, 0.9))
    run([*command, "train.resume=true"], env=env)
    want, got = weights(runs["zero3"][0] / "final"), weights(killed / "final")
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
