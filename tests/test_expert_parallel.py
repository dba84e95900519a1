"""Expert parallelism (train.expert_parallel_size, DeepSpeed's AutoEP under ZeRO-3) on the tiny mixture-of-experts
models of both families.

In this process, at EP = 1 (AutoEP's layer without its all-to-all): its blocks route by AutoEP's own rule and the
project's routing plans (statistics, record, replay) route them by the same rule; grouped == repeated through them
with a replay; the state dict goes back to the checkpoint's names and layout exactly; what cannot run is refused by
name before a weight is read. Under torchrun (slow set): 2 processes at EP = 2 against EP = 1 (rollouts of both
engines, log-probs, gradients) and the launcher at EP = 2 (against EP = 1, killed and resumed, evaluated)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from app.config.loading import ConfigError, load_config
from app.grouping import completion_logprobs
from app.grouping.experts.blocks import expert_parallel_size, expert_shape, sparse_layers
from app.rollout.generate import SamplingConfig, generate_groups
from app.runtime import expert_parallel
from app.runtime.expert_parallel import is_ep_block
from app.runtime.models import MOE_FAMILIES, build_tiny_checkpoint, load_model
from tests.helpers import load, max_rel_diff, prompt_batch, tokenizer_of

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"qwen3_vl_moe": ["video", "text"], "qwen3_5_moe": ["text", "video"]}
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=9, seed=4)


def with_autoep(model):
    """``model`` with its sparse blocks replaced in place by AutoEP's layer at EP = 1 (one rank holds every expert,
    no all-to-all), through AutoEP's own detection and replacement, from the section the trainer writes."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    config = parse_autoep_config(expert_parallel.section(model.config, 1))
    autoep = AutoEP(model, config)
    autoep.replace_moe_layers(autoep.ep_parser(), ep_size=1, ep_rank=0)
    return model


def setup(family, checkpoints, videos):
    model, processor = load(family, checkpoints)
    prompts = prompt_batch(family, processor, videos, KINDS[family])
    return model, prompts, tokenizer_of(processor)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_autoep_blocks_route_by_autoeps_rule_and_the_plans_route_them_the_same(family, tiny_checkpoints, videos):
    """AutoEP's blocks, found by the same walk as transformers' (``sparse_layers``): the model's log-probs equal the
    transformers blocks' (fp32 1e-5); a forward with router statistics (the project's ``EPRouter``) routes every
    token to the experts AutoEP's own router picks, with the same log-probs and the same statistics as the
    transformers blocks; a rollout's record from the transformers model replays through AutoEP's blocks in both
    layouts (log-probs 1e-5, gradients 1e-4, the router's and every expert tensor's included)."""
    import copy

    hf, prompts, tok = setup(family, tiny_checkpoints, videos)
    rollout = generate_groups(hf, prompts, [3, 2], SAMPLING, tokenizer=tok, record_routing=True)
    ids, mask = rollout.completion_ids, rollout.completion_mask
    ep = with_autoep(copy.deepcopy(hf))
    assert all(is_ep_block(s.block) for s in sparse_layers(ep)) and len(sparse_layers(ep)) == len(sparse_layers(hf))
    assert expert_shape(ep) == expert_shape(hf) and expert_parallel_size(ep) == 1
    with torch.no_grad():
        own = completion_logprobs(ep, prompts, ids, mask, [3, 2])  # AutoEP's router, no plan
        ref = completion_logprobs(hf, prompts, ids, mask, [3, 2], router_statistics="metrics", record_routing=True)
        planned = completion_logprobs(ep, prompts, ids, mask, [3, 2], router_statistics="metrics",
                                      record_routing=True)
    assert max_rel_diff(own.logprobs, ref.logprobs) <= 1e-5
    assert max_rel_diff(planned.logprobs, own.logprobs) <= 1e-6
    real = prompts["attention_mask"].bool()
    assert torch.equal(planned.routing.prompt[real].sort(-1).values, ref.routing.prompt[real].sort(-1).values)
    used = mask.bool()
    assert torch.equal(planned.routing.completion[used].sort(-1).values, ref.routing.completion[used].sort(-1).values)
    for part in ("load", "probability", "entropy"):
        assert max_rel_diff(getattr(planned.router, part), getattr(ref.router, part)) <= 1e-5, part

    def run(mode):
        ep.zero_grad(set_to_none=True)
        scores = completion_logprobs(ep, prompts, ids, mask, [3, 2], mode=mode, routing=rollout.routing,
                                     router_statistics="loss")
        ((scores.logprobs * torch.linspace(0.5, 1.5, ids.shape[1])[None]).sum()
         + scores.router.probability.pow(2).sum()).backward()
        return scores, {n: p.grad.clone() for n, p in ep.named_parameters() if p.grad is not None}

    grouped, grads = run("grouped")
    repeated, want = run("repeated")
    assert max_rel_diff(grouped.logprobs, repeated.logprobs) <= 1e-5
    assert set(grads) == set(want) and max(max_rel_diff(grads[n], want[n]) for n in grads) <= 1e-4
    routed = [n for n in grads if ".mlp.router.gate." in n or ".mlp.experts.w" in n]
    assert len(routed) == 4 * len(sparse_layers(ep)) and all(grads[n].abs().sum() > 0 for n in routed)
    assert grouped.replay_differs.tolist()[0] == 0  # on the rollout's own weights no router would choose otherwise
    torch.testing.assert_close(grouped.logprobs, own.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_an_autoep_models_state_dict_goes_back_to_the_checkpoints_names_and_layout(family, tiny_checkpoints):
    """``expert_parallel.hf_state_dict`` of a model whose blocks AutoEP replaced: the same keys as the transformers
    model (router, fused experts, Qwen3.5-MoE's shared expert and gate), every tensor equal, and it loads strictly."""
    import copy

    hf = load_model(tiny_checkpoints[family])
    want = hf.state_dict()
    ep = with_autoep(copy.deepcopy(hf))
    state = expert_parallel.hf_state_dict(ep, {k: v.clone() for k, v in ep.state_dict().items()})
    assert state.keys() == want.keys()
    assert all(torch.equal(state[k], want[k]) for k in want)
    load_model(tiny_checkpoints[family]).load_state_dict(state, strict=True)
    assert expert_parallel.hf_state_dict(hf, None) is None  # no AutoEP blocks: untouched (rank > 0: None)


def test_the_routers_weights_stay_finite_where_every_replayed_expert_underflows():
    """A replayed set the current router all but rules out (its probabilities 0 in float32): the gate weights are the
    softmax over those experts' logits, not 0 / 0 (found by an SGD step of lr 1 at EP = 1 under torchrun: NaN)."""
    from app.grouping.experts.routers import renormalised

    logits = torch.tensor([[200.0, 0.0, -10.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    probs = torch.softmax(logits, -1)
    indices = torch.tensor([[2, 1], [3, 1]])
    top = probs.gather(-1, indices)
    weights = renormalised(top, top.sum(-1, keepdim=True), logits, indices)
    assert torch.isfinite(weights).all()
    torch.testing.assert_close(weights[0], torch.softmax(torch.tensor([-10.0, 0.0]), -1))
    torch.testing.assert_close(weights[1], top[1] / top[1].sum())


def test_an_autoep_router_with_another_rule_is_refused_by_name():
    from app.grouping.experts.routers import RoutingError
    from app.runtime.expert_parallel import EPRouter

    class Router(torch.nn.Module):
        def __init__(self, score_func, groups=None):
            super().__init__()
            self.gate, self.top_k, self.num_experts = torch.nn.Linear(8, 4, bias=False), 2, 4
            self.score_func, self.route_norm, self.route_scale, self.num_expert_groups = score_func, True, 1.0, groups

    EPRouter(Router("softmax"))
    with pytest.raises(RoutingError, match=r"score_func='sigmoid'.*\(softmax top-k\) only"):
        EPRouter(Router("sigmoid"))
    with pytest.raises(RoutingError, match="a load-balancing expert bias, group-limited routing"):
        EPRouter(Router("softmax", groups=2), expert_bias=torch.zeros(4))


def test_the_section_maps_both_families_onto_autoeps_qwen3_moe_preset(tiny_checkpoints):
    from transformers import AutoConfig

    for family in MOE_FAMILIES:
        config = AutoConfig.from_pretrained(tiny_checkpoints[family])
        got = expert_parallel.section(config, 2)
        assert got["preset_model"] == "qwen3_moe" and got["autoep_size"] == 2 and got["route_norm"] is True
        assert got["top_k"] == config.get_text_config().num_experts_per_tok
        import re

        assert re.fullmatch(got["moe_layer_pattern"], "model.language_model.layers.3.mlp")
        assert not re.fullmatch(got["moe_layer_pattern"], "model.visual.blocks.0.mlp")


def test_what_expert_parallelism_cannot_run_is_named():
    found = expert_parallel.problems(size=2, model_type="qwen2_5_vl", experts=0, world=2)
    assert found == ["needs a mixture-of-experts model; this qwen2_5_vl checkpoint has no routed experts"]
    found = expert_parallel.problems(size=3, model_type="qwen3_5_moe", experts=4, world=2, zero_stage=2)
    assert "does not divide the 4 routed experts" in found[0] and "sizes that do and fit 2 rank(s): [1, 2]" in found[0]
    assert "does not divide the data-parallel world (2 rank(s))" in found[1] and "runs under ZeRO-3" in found[2]
    assert expert_parallel.problems(size=2, model_type="qwen3_vl_moe", experts=128, world=8) == []
    assert expert_parallel.problems(size=1, model_type="qwen2_5_vl", experts=0, world=1) == []


@pytest.mark.parametrize("override, words", [
    ("train.sequence_parallel_size=2", "cannot be combined with train.sequence_parallel_size=2"),
    ("lora.rank=4", "trains full weights only, not LoRA.*does not support frozen expert parameters yet"),
    ("rollout.engine=vllm", "samples with rollout.engine grouped or hf.*not vllm"),
    ("train.expert_parallel_size=0", "must be >= 1, got 0"),
])
def test_the_config_checks_refuse_what_expert_parallelism_does_not_run(override, words):
    import re

    with pytest.raises(ConfigError, match="'train.expert_parallel_size'") as error:
        load_config("configs/demo_cpu.yaml", ["train.expert_parallel_size=2", "model.path=x", override])
    assert re.search(words, str(error.value)), str(error.value)


def test_preflight_stops_before_any_weight_naming_the_experts_the_world_and_the_stage(tiny_checkpoints, tmp_path,
                                                                                      monkeypatch):
    """What config.json, the world being launched and the DeepSpeed JSON decide, checked before any weight is read:
    through scripts/train.sh with 2 processes once (one line, exit 1, before torchrun, the weights garbage), and the
    other cases in this process (``preflight.check``, what scripts/train.sh and every recipe run first)."""
    from app.training import preflight

    checkpoint = build_tiny_checkpoint(tmp_path / "moe", "qwen3_5_moe")
    (checkpoint / "model.safetensors").write_bytes(b"not a tensor file")
    result = subprocess.run(["bash", "scripts/train.sh", "configs/demo_cpu.yaml", f"model.path={checkpoint}",
                             "train.deepspeed_config=deepspeed_configs/zero2.json", "train.expert_parallel_size=2",
                             f"train.output_dir={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "NPROC_PER_NODE": "2"}, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("config error: 'train.expert_parallel_size'=2 runs under ZeRO-3"), lines[0]
    assert not (tmp_path / "out").exists()
    common = ["configs/demo_cpu.yaml", f"model.path={checkpoint}", "train.deepspeed_config=deepspeed_configs/zero3.json"]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    for overrides, words in (("train.expert_parallel_size=3", "does not divide the 4 routed experts"),
                             ("train.expert_parallel_size=4", "does not divide the data-parallel world (2 rank(s))")):
        with pytest.raises(SystemExit, match=r"config error: 'train.expert_parallel_size'=\d " + re.escape(words)):
            preflight.check([*common, overrides])
    monkeypatch.setenv("NNODES", "2")  # scripts/train_multinode.sh: the world is the nodes' ranks
    preflight.check([*common, "train.expert_parallel_size=4"])
    monkeypatch.delenv("NNODES")
    with pytest.raises(SystemExit, match="needs a mixture-of-experts model; this qwen2_5_vl checkpoint"):
        preflight.check(["configs/demo_cpu.yaml", f"model.path={tiny_checkpoints['qwen2_5_vl']}",
                         "train.deepspeed_config=deepspeed_configs/zero3.json", "train.expert_parallel_size=2"])


def test_a_checkpoint_is_resumed_at_the_expert_parallel_size_it_was_written_with(tmp_path):
    from app.runtime.checkpoint import CheckpointError, check_layout

    state = {"world_size": 2, "sequence_parallel_size": 1, "expert_parallel_size": 2}
    check_layout(tmp_path, state, 2, 1, 2)
    with pytest.raises(CheckpointError, match=r"written with train.expert_parallel_size=2, this run has 1.*does not "
                                              r"reshard them"):
        check_layout(tmp_path, state, 2, 1, 1)
    check_layout(tmp_path, {"world_size": 2}, 2, 1, 1)  # written before the setting existed: EP = 1


def test_a_save_the_engine_itself_refuses_is_not_called_a_lack_of_space(tmp_path):
    """A failed save whose error is not the disk's (DeepSpeed's AutoEP refusing frozen experts, say) is reported with
    its own words, not as missing space."""
    from app.runtime import checkpoint

    class Refusing:
        def save_checkpoint(self, folder, tag, save_latest):
            raise RuntimeError("AutoEP with ZeRO Stage 3 checkpointing does not support frozen expert parameters yet")

    with pytest.raises(checkpoint.SaveError) as error:
        checkpoint.save_checkpoint(Refusing(), tmp_path, 1, {"step": 1}, need_bytes=10)
    assert "does not support frozen expert parameters yet" in str(error.value)
    assert "this is not a lack of space" in str(error.value) and "free space" not in str(error.value)
    assert checkpoint.space_like(RuntimeError("[enforce fail at inline_container.cc] unexpected pos 123 vs 456"))
    assert checkpoint.space_like(OSError(28, "No space left on device"))


# ---- under torchrun ---------------------------------------------------------------------------------------------
@pytest.mark.slow  # one launch of 2 processes (about 15 s), one of 4 (about 25 s)
@pytest.mark.distributed
# Qwen3.5-MoE at 2 processes (the EP group the whole world) asserts nothing that its 4 processes and Qwen3-VL-MoE's 2
# do not, and the launcher test below runs it there
@pytest.mark.parametrize("family, world", [("qwen3_vl_moe", 2), ("qwen3_5_moe", 4)])
def test_processes_at_ep2_sample_score_and_step_as_ep1(family, world, tmp_path, videos):
    """2 processes (and 4: two expert-parallel groups, each rank's experts partitioned by ZeRO-3 over the 2 ranks that
    hold the same ones), ZeRO-3, each rank its own prompt and group size: the model at EP = 2 (AutoEP, an all-to-all
    per sparse layer) against the same model at EP = 1 in the same processes. Rollouts: greedy with rank 0 stopping at
    its third token while rank 1 decodes on (lock step), chunked prefill, seeded sampling and hf generate: the same
    tokens; the routing records agree on every token. The record replayed: log-probs 1e-5 apart; grouped ==
    repeated on both (1e-5); two questions on one video packed as one family: equal to apart and across the sizes
    (1e-5). One SGD step (lr 1) on a loss with the routers' statistics in it: the routers' and experts' changes 1e-4
    apart, every weight 1e-4 apart, in the checkpoint's names and layout."""
    checkpoint = build_tiny_checkpoint(tmp_path / family, family)
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                             str(world), "-m", "tests.workers.expert_parallel", str(checkpoint), str(videos[0]),
                             str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for info in ranks:
        assert info["world"] == world and info["ep_of"] == {"1": 1, "2": 2}
        assert info["collective_2"] and not info["collective_1"]  # EP's forwards are collectives, full gather or not
        assert all(info[f"{name}_equal"] for name in ("greedy", "chunked", "sampled", "hf")), info
        assert info["record_tokens_apart"] == 0 and info["record_tokens"] > 0
        assert info["logprob_max_abs"] <= 1e-5 and info["repeated_max_abs_1"] <= 1e-5 and \
            info["repeated_max_abs_2"] <= 1e-5, info
        assert info["finite_after_1"] and info["finite_after_2"]
        assert info["family_max_abs"] <= 1e-5 and info["family_vs_apart_1"] <= 1e-5 and info["family_vs_apart_2"] <= 1e-5
    assert ranks[0]["greedy_steps_2"] == 3 and ranks[1]["greedy_steps_2"] == 10  # rank 0 stepped idly with rank 1
    assert ranks[0]["prefill_chunks"] < ranks[1]["prefill_chunks"]
    first = ranks[0]
    assert first["gradient_worst_routed"][0] <= 1e-4 and first["weights_worst"][0] <= 1e-4, first
    assert first["moved"][0] == first["moved"][1] and first["experts_moved"] > 0 and first["routers_moved"] > 0


@pytest.mark.slow  # four launches of 2 processes (about 1.5-2 minutes on 2 cores)
@pytest.mark.distributed
def test_the_launcher_at_ep2_trains_as_ep1_and_resumes_after_kill(tmp_path):
    """scripts/train.sh, 2 processes under ZeRO-3, Qwen3.5-MoE (Gated DeltaNet layers, a shared expert), video data,
    the routers training with the load-balancing loss and routing replay on (r3), 3 steps: EP = 2 reaches EP = 1's
    weights (1e-4) and exports in the checkpoint's own names and layout, every step logs the routing agreement and
    the mismatch; EP = 2 killed with -9 at a random time and resumed ends at the uninterrupted run's weights bit for
    bit; its checkpoints record the size (a resume at another is refused: ``check_layout``, above). Questions sharing
    a video under EP: the 2-process worker above. scripts/plot_metrics.sh drawing the replay metrics and
    scripts/eval.sh scoring an MoE export: ``tests/test_experts_train.py``."""
    from app.data.synthetic import generate
    from tests.helpers import killed_at_random
    from tests.test_experts_train import assert_close_weights, metrics
    from tests.test_trainer import overrides, run, weights

    family = "qwen3_5_moe"
    checkpoint = build_tiny_checkpoint(tmp_path / family, family)
    data = generate(tmp_path / "data", train=8, heldout=0, seed=0)
    plugin = tmp_path / "varied.py"  # rewards that differ within every group: the weights really move
    plugin.write_text("def varied(completions, records):\n    return [len(c) % 5 / 4 for c in completions]\n")
    assets = {"checkpoint": checkpoint, "train": data["train"], "plugin": f"{plugin}:varied"}
    common = {"train.max_steps": 3, "train.save_every": 1, "train.prompts_per_rank": 2,
              "train.groups_per_micro_batch": 1, "train.deepspeed_config": "deepspeed_configs/zero3.json",
              "grpo.router_aux_loss_coef": 0.05, "model.train_router": True, "train.warmup_steps": 0,
              "rollout.routing_replay": "r3"}
    env = {"NPROC_PER_NODE": "2"}

    def command(out, ep):
        return ["bash", "scripts/train.sh", "configs/demo_cpu.yaml",
                *overrides(assets, out, **{**common, "train.expert_parallel_size": ep})]

    run(command(tmp_path / "ep1", 1), env=env)
    start = time.time()
    run(command(tmp_path / "ep2", 2), env=env)
    took = time.time() - start
    initial, ep2 = weights(checkpoint), weights(tmp_path / "ep2" / "final")
    assert ep2.keys() == initial.keys()  # the export is in the checkpoint's own names and layout
    assert_close_weights(ep2, weights(tmp_path / "ep1" / "final"), initial, 1e-4)
    assert "expert parallelism: 4 sparse layers on 2 expert-parallel ranks" in (
        tmp_path / "ep2" / "logs" / "rank0.log").read_text()
    rows = metrics(tmp_path / "ep2")
    assert len(rows) == 3 and all(0 <= r["routing/replay_differs"] <= 1 and r["mismatch/max_ratio"] >= 1
                                  and r["router/aux_loss"] > 0 for r in rows)
    states = [json.loads(p.read_text()) for p in (tmp_path / "ep2" / "checkpoints").glob("step-*/trainer_state_rank*")]
    assert states and {s["expert_parallel_size"] for s in states} == {2}

    killed = tmp_path / "killed"
    killed_at_random(command(killed, 2), killed, env, took, random.Random("expert-parallel"), (0.5, 0.9))
    run([*command(killed, 2), "train.resume=true"], env=env)
    got = weights(killed / "final")
    for name in ep2:
        torch.testing.assert_close(got[name], ep2[name], rtol=0, atol=0, msg=name)


# ---- the planner ------------------------------------------------------------------------------------------------
def full_weight_30b(*overrides):
    from app.planning.planner import World

    return load_config("configs/qwen3_vl_30b_a3b_video.yaml", list(overrides)), World(gpus_per_node=8,
                                                                                      gpu_memory_gib=80)


def test_the_planner_prices_what_expert_parallelism_changes_by_its_formulas():
    """Qwen3-VL-30B-A3B, full weights, 8 ranks, bf16: a ZeRO-3 forward gathers what the other 7 ranks hold of a
    sparse layer's 128 experts, 1,008 MiB, at EP = 1; at EP = 2 the rank's 64 over its 4 expert-data-parallel
    ranks; at EP = 8 nothing. The all-to-all sends each token's 8 routed copies (2,048 wide) there and back, 7/8 of
    them to other ranks; the rollout's full gather holds 1/EP of the experts; a sparse layer gathered whole holds
    E / EP experts; decode steps run eagerly (no graph) under EP."""
    from app.planning.planner import plan

    layer = 128 * 3 * 2048 * 768 * 2  # bytes of one sparse layer's routed experts in bf16
    results = {}
    for ep in (1, 2, 8):
        cfg, world = full_weight_30b(f"train.expert_parallel_size={ep}", "rollout.zero3_gather=full")
        results[ep] = plan(cfg, world, "qwen3_vl_30b_a3b", frames=16)
    from app.planning.costs import Workload

    tokens = Workload(**results[1]["workload"]).grouped_tokens
    for ep, gather in ((1, layer * 7 / 8), (2, layer / 2 * (1 - 2 / 8)), (8, 0.0)):
        experts = results[ep]["experts"]
        assert experts["ep"] == ep and experts["layer_gather_bytes"] == pytest.approx(gather)
        assert experts["layer_gather_bytes_without_ep"] == pytest.approx(layer * 7 / 8)
        assert experts["layer_exchange_bytes"] == pytest.approx(2 * tokens * 8 * 2048 * 2 * (ep - 1) / ep)
        assert results[ep]["training"]["experts_gathered"] == pytest.approx(layer / ep)
        decode = results[ep]["phase_terms"]["grouped"]["decode"]
        assert ("graph_launch_ms" in decode) == (ep == 1) and ("eager_launch_ms" in decode) == (ep > 1)
    total = results[1]["parameters"]["total"] * 2
    held = {ep: results[ep]["rollout"]["gathered_weights"] + total / 8 for ep in (1, 8)}
    assert held[1] == pytest.approx(total) and held[8] == pytest.approx(total - 48 * layer * 7 / 8)
    assert results[8]["fits"] and not results[1]["fits"]  # the full gather of all 128 experts a layer does not fit
    assert results[1]["experts"]["exchange_bytes"] == 0 and results[8]["experts"]["gather_bytes"] == 0


def test_the_plan_prices_each_expert_parallel_size_and_suggests_the_one_that_fits_best(tmp_path, capsys):
    """scripts/plan.sh on the full-weight 30B-A3B config (layerwise gather, 8 x 80 GB): EP = 1, 2, 4, 8 each
    planned; EP = 8 fits with the shortest step and is suggested; a LoRA config's sizes above 1 are refused in the
    config checks' words; a dense model at EP = 2 is refused by name; a full gather that does not fit gets expert
    parallelism among its remedies, each a config the trainer accepts."""
    from app.planning.plan import main
    from app.planning.planner import PlanError, plan
    from app.planning.remedies import expert_parallel_options, remedies, suggested_expert_parallel

    cfg, world = full_weight_30b()
    options = expert_parallel_options(cfg, world, "qwen3_vl_30b_a3b")
    assert [o["ep"] for o in options] == [1, 2, 4, 8] and all("refused" not in o for o in options)
    assert options[-1]["fits"] and options[-1]["step_s"] < min(o["step_s"] for o in options[:-1])
    assert suggested_expert_parallel(options, 1)["ep"] == 8 and suggested_expert_parallel(options, 8) is None
    main(["configs/qwen3_vl_30b_a3b_video.yaml", "--model", "qwen3_vl_30b_a3b", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "mixture of experts at EP=1" in printed and "suggested: train.expert_parallel_size=8" in printed
    assert json.loads((tmp_path / "plan.json").read_text())["expert_parallel"][-1]["ep"] == 8

    lora = load_config("configs/qwen3_vl_30b_a3b_video_lora.yaml")
    refused = expert_parallel_options(lora, world, "qwen3_vl_30b_a3b")
    assert "refused" not in refused[0] and all("cannot be combined with LoRA" in o["refused"] for o in refused[1:])
    with pytest.raises(PlanError, match="train.expert_parallel_size=2: needs a mixture-of-experts model"):
        plan(load_config("configs/qwen2_5_vl_7b_video.yaml", ["train.expert_parallel_size=2"]), world,
             "qwen2_5_vl_7b", frames=16)

    whole, _ = full_weight_30b("rollout.zero3_gather=full")
    fixes = remedies(whole, world, "qwen3_vl_30b_a3b")
    ep_fixes = [f for f in fixes if "expert parallelism" in f["change"]]
    assert ep_fixes and "refused" not in ep_fixes[-1] and ep_fixes[-1]["fits"]


def test_a_reference_model_gets_its_own_section_and_a_dense_one_none(tiny_checkpoints):
    """model.reference_path under EP: the policy's expert_parallel section made again for the reference's config at
    the same size, and left out for a dense reference (AutoEP refuses a model without sparse blocks)."""
    policy = {"zero_optimization": {"stage": 3}, "expert_parallel": {"autoep_size": 2, "top_k": 99}}
    moe = load_model(tiny_checkpoints["qwen3_5_moe"])
    got = expert_parallel.reference_section(policy, moe)
    assert got["expert_parallel"] == expert_parallel.section(moe.config, 2) and policy["expert_parallel"]["top_k"] == 99
    assert "expert_parallel" not in expert_parallel.reference_section(policy, load_model(tiny_checkpoints["qwen2_5_vl"]))
