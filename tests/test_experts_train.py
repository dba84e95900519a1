"""GRPO on the tiny mixture-of-experts models through the real recipe (app.training.trainer) on generated video
data: grouped and repeated training reach the same weights with the load-balancing loss in the objective and the
routers training, and log the same router metrics (per logical token); through scripts/train.sh, 2 processes
under ZeRO-3 (each sparse block a leaf module) reach the ZeRO-2 run's weights with k = 2 questions on one video,
and a run killed with -9 resumes to the uninterrupted run's weights (slow set); scripts/eval.sh on its output."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch

from app.data.synthetic import generate
from app.runtime.models import MOE_FAMILIES, build_tiny_checkpoint
from tests.helpers import killed_at_random, world_of_one
from tests.test_trainer import overrides, run, weights

pytestmark = pytest.mark.distributed


def train_assets(root: Path) -> dict:
    """Video data (16 train / 4 held-out records; 4 clips x 2 questions for k = 2) and a reward plugin whose rewards
    differ within every group, so the weights really move."""
    files = generate(root / "data", train=16, heldout=4, seed=0)
    shared = generate(root / "shared", train=8, heldout=0, seed=0, questions_per_video=2)
    plugin = root / "varied_reward.py"
    plugin.write_text("def varied(completions, records):\n    return [len(c) % 5 / 4 for c in completions]\n")
    return {"root": root, "train": files["train"], "heldout": files["heldout"], "shared_train": shared["train"],
            "plugin": f"{plugin}:varied"}


@pytest.fixture(scope="module")
def moe_assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_train")
    return {**train_assets(root), "checkpoints": {f: build_tiny_checkpoint(root / f, f, seed=0) for f in MOE_FAMILIES}}


def moe_overrides(assets, family, out, **extra):
    base = {"grpo.router_aux_loss_coef": 0.05, "model.train_router": True, "train.warmup_steps": 0}
    base.update(extra)
    args = overrides({**assets, "checkpoint": assets["checkpoints"][family]}, out, **base)
    return args


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_close_weights(got: dict, want: dict, initial: dict, rtol: float) -> None:
    moved = 0
    for name in want:
        if not want[name].is_floating_point():  # integer buffers (PLE's hash tables' sizes): equal or wrong
            assert torch.equal(got[name], want[name]), name
            continue
        scale = max(float(want[name].norm()), 1e-12)
        assert float((got[name] - want[name]).norm()) / scale <= rtol, name
        moved += int(not torch.equal(want[name], initial[name]))
    assert moved > len(want) // 2


@pytest.mark.parametrize("family", ["qwen3_5_moe", pytest.param("qwen3_vl_moe", marks=pytest.mark.slow)])
def test_grouped_and_repeated_moe_training_reach_the_same_weights_and_router_metrics(family, moe_assets, tmp_path,
                                                                                     monkeypatch):
    """Two steps, in this process: the routers and the experts train, the load-balancing loss is in the loss;
    grouped == repeated (weights 1e-4, the routers' and experts' included), and == the same step cut into one
    micro-batch instead of two (the loss is the step's); router/* logged by both and equal, and drawn beside the
    training curves."""
    from app.training.trainer import main

    runs = {"grouped": {"forward.grouping": "grouped"}, "repeated": {"forward.grouping": "repeated"},
            "one_micro_batch": {"forward.grouping": "grouped", "train.groups_per_micro_batch": 2}}
    for name, extra in runs.items():
        with world_of_one(monkeypatch):
            main(["configs/demo_cpu.yaml", *moe_overrides(moe_assets, family, tmp_path / name, **extra)])
    initial = weights(moe_assets["checkpoints"][family])
    grouped, repeated = weights(tmp_path / "grouped" / "final"), weights(tmp_path / "repeated" / "final")
    assert_close_weights(grouped, repeated, initial, 1e-4)
    # the load-balancing loss is the step's, not each micro-batch's: 2 micro-batches of a group each or 1 of both
    assert_close_weights(weights(tmp_path / "one_micro_batch" / "final"), grouped, initial, 1e-4)
    routers = [n for n in initial if n.endswith("mlp.gate.weight")]
    experts = [n for n in initial if ".mlp.experts." in n]  # either expert layout (as save_pretrained writes it)
    assert routers and experts and all(not torch.equal(grouped[n], initial[n]) for n in routers)
    assert sum(not torch.equal(grouped[n], initial[n]) for n in experts) > len(experts) // 2
    got, want = metrics(tmp_path / "grouped")[-1], metrics(tmp_path / "repeated")[-1]
    keys = [k for k in want if k.startswith("router/")]
    assert {"router/aux_loss", "router/entropy", "router/load_max_over_mean"} <= set(keys)
    assert any(k.startswith("router/load_max_over_mean/layer_") for k in keys)
    for key in keys:
        assert got[key] == pytest.approx(want[key], rel=1e-4), key
    assert not any(k.startswith("router_sums") for k in got)
    from app.runtime.plots import main as plot  # scripts/plot_metrics.sh: the routers' figure beside the curves

    plot([str(tmp_path / "grouped" / "metrics.jsonl"), str(tmp_path / "curves.png")])
    assert (tmp_path / "curves.png").stat().st_size > 0 and (tmp_path / "curves_router.png").stat().st_size > 10000


@pytest.mark.slow  # two launches of 2 processes (and an evaluation: about 45 s on 2 cores)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_two_processes_under_zero3_equal_zero2_with_k2(family, moe_assets, tmp_path):
    """scripts/train.sh, 2 processes, each rank its own prompts (so the ranks route differently), k = 2 questions
    on one video, 3 steps: ZeRO-3 reaches ZeRO-2's weights (1e-4); scripts/eval.sh scores Qwen3.5-MoE's export
    (Qwen3-VL-MoE's, in the released layout, loads back and serves in vLLM: ``tests/test_experts_loading.py``).
    Killed with -9 and resumed under ZeRO-3: Qwen3-VL-MoE in
    ``test_routing_replay_through_the_launcher_under_zero3_resumes_after_kill_and_is_drawn`` (its routing record
    replayed), Qwen3.5-MoE at EP = 2 in ``tests/test_expert_parallel.py`` (replayed too), the dense Qwen3.5 in
    ``tests/test_recurrent.py``."""
    common = {"train.max_steps": 3, "data.questions_per_video": 2, "data.train_file": moe_assets["shared_train"],
              "train.prompts_per_rank": 2, "train.groups_per_micro_batch": 2}
    env = {"NPROC_PER_NODE": "2"}
    for zero in ("zero2", "zero3"):
        run(["bash", "scripts/train.sh", "configs/demo_cpu.yaml",
             *moe_overrides(moe_assets, family, tmp_path / zero, **common,
                            **{"train.deepspeed_config": f"deepspeed_configs/{zero}.json"})], env=env)
    initial = weights(moe_assets["checkpoints"][family])
    assert_close_weights(weights(tmp_path / "zero3" / "final"), weights(tmp_path / "zero2" / "final"), initial, 1e-4)
    assert metrics(tmp_path / "zero3")[-1]["tokens/shared_video"] > 0

    if family == "qwen3_5_moe":
        run(["bash", "scripts/eval.sh", str(tmp_path / "zero3" / "final"), str(moe_assets["heldout"]),
             f"eval.output_dir={tmp_path / 'eval'}", "eval.max_new_tokens=4"], env={"NPROC_PER_NODE": "1"})
        summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
        assert summary, "scripts/eval.sh wrote an empty summary"


@pytest.mark.slow  # two launches of 2 processes (about 30 s)
def test_lora_on_the_routed_experts_under_zero3_equals_zero2_and_exports(moe_assets, tmp_path):
    """scripts/train.sh, 2 processes, Qwen3.5-MoE with LoRA on the demo config's modules, the shared expert and
    every routed expert (lora.target_parameters), 2 steps: ZeRO-3's merged export equals ZeRO-2's (1e-4: the
    adapters drawn from train.seed alike, the first layer's expert adapters getting their gradients under ZeRO-3's
    leaf modules: ``zero.inputs_require_grad``), the routed experts' merged weights moved and the routers did not;
    the adapter alone loads with peft onto the base."""
    from peft import PeftModel

    from app.runtime.models import load_model

    family = "qwen3_5_moe"
    settings = {"train.max_steps": 2, "lora.rank": 2, "lora.alpha": 4, "train.learning_rate": 2e-3,
                "lora.target_parameters": "[mlp.experts.gate_up_proj,mlp.experts.down_proj]",
                "model.train_router": False, "grpo.router_aux_loss_coef": 0.0}
    for zero in ("zero2", "zero3"):
        run(["bash", "scripts/train.sh", "configs/demo_cpu.yaml",
             *moe_overrides(moe_assets, family, tmp_path / zero, **settings,
                            **{"train.deepspeed_config": f"deepspeed_configs/{zero}.json"})], env={"NPROC_PER_NODE": "2"})
    initial = weights(moe_assets["checkpoints"][family])
    zero3, zero2 = weights(tmp_path / "zero3" / "final"), weights(tmp_path / "zero2" / "final")
    assert zero3.keys() == initial.keys()  # merged: the base model's own keys
    for name in zero2:
        scale = max(float(zero2[name].norm()), 1e-12)
        assert float((zero3[name] - zero2[name]).norm()) / scale <= 1e-4, name
    experts = [n for n in initial if ".mlp.experts." in n]
    assert experts and all(not torch.equal(zero3[n], initial[n]) for n in experts)
    assert all(torch.equal(zero3[n], initial[n]) for n in initial if n.endswith("mlp.gate.weight"))
    adapted = PeftModel.from_pretrained(load_model(moe_assets["checkpoints"][family]),
                                        tmp_path / "zero3" / "final-adapter").merge_and_unload().state_dict()
    final = load_model(tmp_path / "zero3" / "final").state_dict()
    for name in final:
        torch.testing.assert_close(adapted[name], final[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # two processes, about 15 s
def test_a_collective_nobody_joins_stops_the_run_naming_itself_and_the_rank(tmp_path):
    """train.collective_timeout_s as the product applies it (``distributed.init_distributed`` and
    ``collective_failures``): rank 0 waits in an all_reduce rank 1 never enters; it stops within a few timeouts,
    its message names torch.distributed.all_reduce, rank 0 and the key; nothing hangs."""
    import subprocess
    import sys

    from tests.test_trainer import ROOT, free_port

    start = time.time()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_port", str(free_port()), "tests/workers/collective_timeout.py", "4"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    took = time.time() - start
    assert result.returncode != 0 and "the all_reduce returned" not in result.stdout
    assert "collective error: rank 0 of 2 waited in torch.distributed.all_reduce longer than " \
           "train.collective_timeout_s=4 s" in result.stderr, result.stderr[-3000:]
    assert took < 60


@pytest.mark.parametrize("family", ["qwen3_vl_moe", pytest.param("qwen3_5_moe", marks=pytest.mark.slow)])
def test_routing_replay_trains_through_the_rollouts_experts_in_both_layouts(family, moe_assets, tmp_path,
                                                                            monkeypatch):
    """rollout.routing_replay=r3, two steps in this process with a KL reference and mu = 2: grouped == repeated
    (weights 1e-4, routers and experts included), the weights moved, and not to replay off's (mu's second pass and
    the reference route as the rollout did); the step metrics say how many replayed tokens the update would have
    routed otherwise, beside the mismatch."""
    from app.training.trainer import main

    common = {"rollout.routing_replay": "r3", "grpo.num_iterations": 2}
    runs = {"grouped": {**common, "forward.grouping": "grouped"},
            "repeated": {**common, "forward.grouping": "repeated"},
            "off": {"grpo.num_iterations": 2, "forward.grouping": "grouped"}}
    for name, extra in runs.items():
        with world_of_one(monkeypatch):
            main(["configs/demo_cpu.yaml", *moe_overrides(moe_assets, family, tmp_path / name, **extra)])
    initial = weights(moe_assets["checkpoints"][family])
    grouped = weights(tmp_path / "grouped" / "final")
    assert_close_weights(grouped, weights(tmp_path / "repeated" / "final"), initial, 1e-4)
    off = weights(tmp_path / "off" / "final")  # the replay is used: mu's second pass and the reference (the
    # initial weights) route as the rollout did, not afresh
    assert max(float((grouped[n] - off[n]).norm() / off[n].norm().clamp_min(1e-12)) for n in off) > 1e-3
    for name in ("grouped", "repeated"):
        last = metrics(tmp_path / name)[-1]
        assert 0 <= last["routing/replay_differs"] <= 1 and "mismatch/mean_abs_logprob_diff" in last
    assert "routing/replay_differs" not in metrics(tmp_path / "off")[-1]


@pytest.mark.slow  # one run in this process, one launch of 2 processes
@pytest.mark.distributed
def test_routing_replay_with_a_shared_video_spread_over_two_ranks_trains_like_one_process(moe_assets, tmp_path,
                                                                                         monkeypatch):
    """rollout.routing_replay=r3 with k = 2 questions on one video and S = 2 (the rollout spread over the group:
    each rank routes its pieces of the video's and the questions' prefill, the record gathered; the update replays
    each rank's shard of the packed row): scripts/train.sh on 2 processes reaches the one-process run's weights
    (1e-4), every step replaying the rollouts' experts with the video held once."""
    from app.training.trainer import main

    common = {"train.max_steps": 2, "data.questions_per_video": 2, "data.train_file": moe_assets["shared_train"],
              "train.prompts_per_rank": 2, "train.groups_per_micro_batch": 2, "rollout.routing_replay": "r3",
              "rollout.sp_split": "spread", "rollout.prefill_chunk_size": 32}
    family = "qwen3_5_moe"
    with world_of_one(monkeypatch):
        main(["configs/demo_cpu.yaml", *moe_overrides(moe_assets, family, tmp_path / "one", **common)])
    two = run(["bash", "scripts/train.sh", "configs/demo_cpu.yaml",
               *moe_overrides(moe_assets, family, tmp_path / "two", **common, **{"train.sequence_parallel_size": 2})],
              env={"NPROC_PER_NODE": "2"})
    assert two.stderr.count("each spread over the group") == 1, two.stderr[-3000:]
    initial = weights(moe_assets["checkpoints"][family])
    assert_close_weights(weights(tmp_path / "two" / "final"), weights(tmp_path / "one" / "final"), initial, 1e-4)
    for name in ("one", "two"):
        rows = metrics(tmp_path / name)
        assert len(rows) == 2 and all(0 <= r["routing/replay_differs"] <= 1 and r["tokens/shared_video"] > 0
                                      for r in rows), rows
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [r["reward/mean"] for r in one] == [r["reward/mean"] for r in two]


@pytest.mark.slow  # three launches of 2 processes (about a minute on 2 cores)
def test_routing_replay_through_the_launcher_under_zero3_resumes_after_kill_and_is_drawn(moe_assets, tmp_path):
    """scripts/train.sh, 2 processes under ZeRO-3, Qwen3-VL-MoE, rollout.routing_replay=r3, 3 steps: every step logs
    the routing agreement and the mismatch, scripts/plot_metrics.sh draws them; killed with -9 at a random time
    and resumed, the run ends at the uninterrupted run's weights, bit for bit."""
    import subprocess

    from tests.test_trainer import ROOT

    common = {"train.max_steps": 3, "train.save_every": 1, "rollout.routing_replay": "r3",
              "train.deepspeed_config": "deepspeed_configs/zero3.json"}
    env = {"NPROC_PER_NODE": "2"}
    whole, killed = tmp_path / "whole", tmp_path / "killed"

    def command(out):
        return ["bash", "scripts/train.sh", "configs/demo_cpu.yaml",
                *moe_overrides(moe_assets, "qwen3_vl_moe", out, **common)]

    start = time.time()
    run(command(whole), env=env)
    took = time.time() - start
    rows = metrics(whole)
    assert len(rows) == 3 and all(0 <= r["routing/replay_differs"] <= 1 and r["mismatch/max_ratio"] >= 1
                                  for r in rows)
    initial = weights(moe_assets["checkpoints"]["qwen3_vl_moe"])
    want = weights(whole / "final")
    assert sum(not torch.equal(want[n], initial[n]) for n in want) > len(want) // 2
    killed_at_random(command(killed), killed, env, took, random.Random("replay"), (0.5, 0.9))
    run([*command(killed), "train.resume=true"], env=env)
    got = weights(killed / "final")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    drawn = subprocess.run(["bash", "scripts/plot_metrics.sh", str(whole / "metrics.jsonl"),
                            str(tmp_path / "curves.png")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert drawn.returncode == 0, drawn.stderr
    assert (tmp_path / "curves_replay.png").stat().st_size > 10000


@pytest.mark.slow  # two 1-step launches of 2 processes under ZeRO-3 (about a minute on 2 cores)
def test_routing_replay_with_a_separate_dense_or_moe_reference_through_the_launcher(moe_assets, tmp_path):
    """rollout.routing_replay=r3 and grpo.beta > 0 with model.reference_path: a dense reference (Qwen3-VL) runs
    without replay, said once at start-up, while the policy's forwards replay; a reference of the policy's expert
    shape (another Qwen3-VL-MoE) replays the rollout's experts. Both train (the weights move); the load-balancing
    coefficient with frozen routers is warned about, saying where its gradient goes."""
    dense = build_tiny_checkpoint(moe_assets["root"] / "dense_reference", "qwen3_vl", seed=3)
    moe = build_tiny_checkpoint(moe_assets["root"] / "moe_reference", "qwen3_vl_moe", seed=3)
    initial = weights(moe_assets["checkpoints"]["qwen3_vl_moe"])
    for name, reference in (("dense", dense), ("moe", moe)):
        out = tmp_path / name
        result = run(["bash", "scripts/train.sh", "configs/demo_cpu.yaml", *moe_overrides(
            moe_assets, "qwen3_vl_moe", out, **{"rollout.routing_replay": "r3", "model.reference_path": reference,
                                                "grpo.beta": 0.1, "model.train_router": False, "train.max_steps": 1,
                                                "train.deepspeed_config": "deepspeed_configs/zero3.json"})],
                     env={"NPROC_PER_NODE": "2"})
        log = (out / "logs" / "rank0.log").read_text()
        said = "the reference model" in log and "is dense, so its log-probs are computed without replay" in log
        assert said == (name == "dense"), log[-3000:]
        assert "with frozen routers (model.train_router=false, the default): the load-balancing loss trains no " \
               "router" in result.stderr + log
        rows = metrics(out)
        assert len(rows) == 1 and all("routing/replay_differs" in r and r["kl"] != 0 for r in rows)
        final = weights(out / "final")
        assert sum(not torch.equal(final[n], initial[n]) for n in final) > len(final) // 2
