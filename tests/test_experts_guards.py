"""What keeps the mixture-of-experts path honest, in one process: routing replay is on for every forward or the step
stops naming the prompt; a separate reference under r3 is replayed, run without replay or refused before the load;
the export writes the source checkpoint's expert layout; router metrics cost one host copy a step and one key per
layer; the planner prices the load-balancing loss's counting pass; unknown model types stop at start-up; a
rollout's per-row tensors (routing record included) take one pad / cut / select / gather path."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from app.data.prompts import collate_prompts, encode_prompts
from app.data.records import EncodedPrompt
from app.grouping.experts.blocks import expert_shape
from app.grouping.experts.routers import RoutingError
from app.rollout.generate import SamplingConfig, generate_groups
from app.rollout.rows import Rows, fit, gathered, select_groups, sent
from app.runtime.models import MOE_FAMILIES, load_model, load_processor
from app.training.trajectory import Trajectory
from tests.helpers import conversations_of, load, tokenizer_of


def moe_trajectory(family, checkpoints, videos, sizes=(3, 2)):
    """A real r3 trajectory: two prompts (video, text) encoded one by one as the stream does, rolled out by the
    grouped engine recording routing, with rewards that differ."""
    model, processor = load(family, checkpoints)
    prompts = []
    for b, conversation in enumerate(conversations_of(family, videos, ["video", "text"])):
        inputs = encode_prompts(processor, [conversation])
        prompts.append(EncodedPrompt({"problem": f"q{b}", "problem_id": 40 + b, "_where": f"train.jsonl:{b + 1}"},
                                     inputs))
    tok = tokenizer_of(processor)
    batch = collate_prompts([p.inputs for p in prompts], tok.pad_token_id)
    rollout = generate_groups(model, batch, list(sizes), SamplingConfig(temperature=1.0, max_new_tokens=6, seed=3),
                              tokenizer=tok, record_routing=True)
    n = sum(sizes)
    t = Trajectory(prompts, rollout, [""] * n, [0.0] * n, {"r": [0.0] * n}, torch.arange(n, dtype=torch.float32))
    t.advantages = torch.linspace(-1, 1, n)
    return model, t, tok


def test_replay_is_on_for_every_micro_batch_or_the_step_stops_naming_the_prompt_and_rank(tiny_checkpoints, videos):
    model, t, tok = moe_trajectory("qwen3_vl_moe", tiny_checkpoints, videos)
    shape, weights = expert_shape(model), t.rollout.completion_mask.float()
    batches = t.micro_batches(1, weights, tok.pad_token_id, "cpu", replay=shape)
    assert all(mb.routing is not None and mb.replay for mb in batches)  # every forward of the step replays it
    # one group's record removed in the real trajectory (its completions' first tokens unrecorded)
    t.rollout.routing.completion[3:, 0] = -1
    with pytest.raises(RoutingError, match=re.escape("rank 0's prompt train.jsonl:2 (problem_id 41): the routing "
                                                     "record of its completion token 0 (completion 0) has no record")):
        t.micro_batches(1, weights, tok.pad_token_id, "cpu", replay=shape)
    t.micro_batches(1, weights, tok.pad_token_id, "cpu")  # r3 off: nothing is asked of the record
    t.rollout.routing = None  # an engine that recorded nothing
    with pytest.raises(RoutingError, match=r"rollout.routing_replay=r3, but rank 0's rollout of train.jsonl:1 "
                                           r"\(problem_id 40\) and 1 more prompt\(s\) carries no routing record"):
        t.micro_batches(2, weights, tok.pad_token_id, "cpu", replay=shape)


def test_per_row_tensors_take_one_path_for_selection_joins_and_gathers(tiny_checkpoints, videos):
    """Rows: right-padded rows keep their first columns, left-padded their last; select_groups (dynamic sampling),
    the micro-batches and a gather over ranks (prompt order) all carry the routing record with the other rows, and
    a rollout without a record cannot join one with it."""
    assert torch.equal(fit(torch.tensor([[1, 2, 3]]), 2, 0), torch.tensor([[1, 2]]))
    assert torch.equal(fit(torch.tensor([[1, 2, 3]]), 2, 0, left=True), torch.tensor([[2, 3]]))
    assert torch.equal(fit(torch.tensor([[1]]), 3, 9, left=True), torch.tensor([[9, 9, 1]]))
    joined = Rows.joined([Rows({"a": torch.ones(1, 2)}, {"a": -1}), Rows({"a": torch.ones(2, 4)}, {"a": -1})])
    assert joined["a"].shape == (3, 4) and bool((joined["a"][0, 2:] == -1).all())
    _, t, tok = moe_trajectory("qwen3_vl_moe", tiny_checkpoints, videos)
    rollout = t.rollout
    picked = select_groups([rollout, rollout], [(1, 1), (0, 0)], tok.pad_token_id)
    assert picked.group_sizes == [2, 3] and torch.equal(picked.routing.prompt[1], rollout.routing.prompt[0])
    width = picked.completion_ids.shape[1]
    assert torch.equal(picked.routing.completion[2:], rollout.routing.completion[:3, :width])
    assert torch.equal(picked.completion_ids[:2], rollout.completion_ids[3:, :width])
    bare = select_groups([rollout], [(0, 0)], tok.pad_token_id)
    bare.routing = None
    with pytest.raises(RoutingError, match=r"rollouts \[1\] of 2 carry no routing record where the others do"):
        select_groups([rollout, bare], [(0, 0), (1, 0)], tok.pad_token_id)
    # two ranks' rollouts through a gather (a stand-in for the group's: every rank's tensors in rank order)
    first, second = (select_groups([rollout], [(0, g)], tok.pad_token_id) for g in (0, 1))
    calls = []

    def gather(tensors):
        calls.append(len(tensors))
        return [tensors, sent(second, tok.pad_token_id)]
    ranks = gathered(first, gather, tok.pad_token_id)
    assert len(calls) == 1 and [r.group_sizes for r in ranks] == [[3], [2]]
    whole = select_groups(ranks, [(0, 0), (1, 0)], tok.pad_token_id)
    width = whole.completion_ids.shape[1]
    assert torch.equal(whole.routing.completion, rollout.routing.completion[:, :width])
    assert torch.equal(whole.completion_ids, rollout.completion_ids[:, :width])
    assert whole.stop_reasons == rollout.stop_reasons


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("layout", ["released", "fused"])
def test_the_export_writes_the_source_checkpoints_expert_layout_and_loads_back_to_the_trained_weights(
        family, layout, tiny_checkpoints, tmp_path):
    """Both families from both source layouts: the export's keys and shapes are the source's (what vLLM's loader
    reads for the released one), tensors the model does not hold (an MTP head) are kept, and it loads in transformers
    to the trained weights."""
    from safetensors.torch import load_file, save_file

    from app.runtime.checkpoint import _export
    from app.runtime.expert_layouts import source_shapes
    from app.runtime.tiny import write_expert_layout

    source = tmp_path / "source"
    shutil.copytree(tiny_checkpoints[family], source)
    write_expert_layout(source, layout)
    on_disk = load_file(str(source / "model.safetensors"))
    save_file({**on_disk, "mtp.fc.weight": torch.arange(6.0).view(2, 3)}, str(source / "model.safetensors"),
              metadata={"format": "pt"})  # a part transformers drops on load, as qwen4_exp's MTP head
    model = load_model(source)
    generator = torch.Generator().manual_seed(0)
    trained = {k: v + 0.01 * torch.randn(v.shape, generator=generator) if v.is_floating_point() else v
               for k, v in model.state_dict().items()}
    out = tmp_path / "final"
    _export(trained, out, load_processor(source), source, torch.float32, None)
    assert source_shapes(out) == source_shapes(source)  # every key and shape, experts included
    assert torch.equal(load_file(str(out / "model.safetensors"))["mtp.fc.weight"], torch.arange(6.0).view(2, 3))
    back = load_model(out).state_dict()
    for key, value in trained.items():
        torch.testing.assert_close(back[key], value, rtol=0, atol=0, msg=key)


def test_router_metrics_reach_the_host_in_one_copy_with_one_key_per_layer_whatever_the_experts(monkeypatch):
    """48 sparse layers x 128 experts: the step's sums are one tensor, copied to the host once (with the step's
    other metrics), and the logged router metrics are per layer, not per expert."""
    from app.grouping.experts.statistics import RouterStatistics
    from app.objectives.router import declare_sums, step_router_metrics
    from app.runtime.tracking import StepMetrics

    layers, experts = tuple(range(0, 96, 2)), 128
    stats = RouterStatistics(layers, torch.rand(48, experts), torch.rand(48, experts), torch.rand(48),
                             torch.tensor(300.0), 8)
    m = StepMetrics()
    m.mean("loss", 1.0)
    declare_sums(m, stats)
    copies = []
    real = torch.Tensor.tolist

    def counted(self):
        copies.append(self.numel())
        return real(self)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    values = m.reduce(lambda flat: [flat, flat])  # two ranks, as the step's one gather gives them
    monkeypatch.undo()
    assert len(copies) == 1 and copies[0] == 1 + 48 + 2 * 48 * experts + 48
    router = step_router_metrics(values)
    assert len(router) == 2 * 48 + 3 and not any(k.startswith("router_sums") for k in values)
    assert router["router/entropy/layer_94"] == pytest.approx(2 * float(stats.entropy[-1]) / 600.0)


def test_the_planner_prices_the_counting_pass_and_a_frozen_router_coefficient_is_warned(tmp_path):
    from app.config.loading import load_config
    from app.planning.planner import World, plan

    cfg = "configs/qwen3_vl_30b_a3b_video_lora.yaml"
    world = World(gpus_per_node=8, nodes=1, gpu_memory_gib=80.0)
    off = plan(load_config(cfg, ["grpo.router_aux_loss_coef=0"]), world, "qwen3_vl_30b_a3b")
    on = plan(load_config(cfg, ["grpo.router_aux_loss_coef=0.001"]), world, "qwen3_vl_30b_a3b")
    assert off["phase_seconds"]["grouped"]["router_counts"] == 0.0
    counted = on["phase_seconds"]["grouped"]["router_counts"]
    assert counted > 0 and on["phase_seconds"]["grouped"]["step"] == pytest.approx(
        off["phase_seconds"]["grouped"]["step"] + counted, rel=1e-6)


@pytest.mark.parametrize("model_type", ["qwen3_omni_moe", "qwen2_5_omni", "llava"])
def test_a_model_type_the_trainer_does_not_support_stops_at_start_up_in_one_line(model_type, tiny_checkpoints,
                                                                                  tmp_path):
    """train / SFT (the preflight every recipe runs), evaluation, the judge and the planner: one line naming the type
    and the supported families, before any weight is read."""
    from app.config.loading import load_config
    from app.planning.planner import PlanError, model_of
    from app.runtime.models import FAMILIES, CheckpointPathError, check_checkpoint
    from app.training.preflight import check

    folder = tmp_path / model_type
    shutil.copytree(tiny_checkpoints["qwen2_5_vl"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    supported = f"which this trainer refuses: it runs the families it has made exact and tested (model_type): " \
                f"{', '.join(FAMILIES)}"
    with pytest.raises(SystemExit, match=re.escape(f"model error: model.path {str(folder)!r} is a {model_type} "
                                                   f"checkpoint, {supported}")):
        check(["configs/demo_cpu.yaml", f"model.path={folder}", f"train.output_dir={tmp_path / 'out'}"])
    for key in ("MODEL_DIR", "rewards.judge_path"):  # evaluation's and the judge's check
        with pytest.raises(CheckpointPathError, match=re.escape(f"{key} {str(folder)!r} is a {model_type}")):
            check_checkpoint(folder, key)
    with pytest.raises(CheckpointPathError, match=r"is a qwen3_next checkpoint, which this trainer refuses "
                                                  r"\(Qwen3-Next"):
        (folder / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_next"}))
        check_checkpoint(folder)
    (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    with pytest.raises(PlanError, match=re.escape(f"model {folder} is a {model_type} checkpoint, {supported}")):
        model_of(str(folder))  # scripts/plan.sh's reading of a checkpoint folder
    assert load_config("configs/demo_cpu.yaml", [f"model.path={folder}"]).model.path  # the config alone is fine


def test_a_separate_reference_of_another_expert_shape_and_router_sums_on_trees_stop_before_the_load(
        tiny_checkpoints, tmp_path):
    """r3 with model.reference_path: a reference of the policy's expert shape or a dense one passes the preflight; one
    routing other layers, experts or top-k is refused in one line before any weight is read. The load-balancing
    coefficient with rollout.tools on a mixture of experts (prefix trees return no router sums) too."""
    from app.runtime.models import TinySizes, build_tiny_checkpoint
    from app.training.preflight import check

    policy = tiny_checkpoints["qwen3_vl_moe"]
    common = ["configs/demo_cpu.yaml", f"model.path={policy}", "rollout.routing_replay=r3", "grpo.beta=0.1",
              f"train.output_dir={tmp_path / 'out'}"]
    for reference in (tiny_checkpoints["qwen3_vl"], policy):
        check([*common, f"model.reference_path={reference}"])
    other = build_tiny_checkpoint(tmp_path / "other", "qwen3_vl_moe", seed=1, sizes=TinySizes(experts=6))
    with pytest.raises(SystemExit, match=r"^config error: 'rollout.routing_replay'=r3 replays the policy's routing in "
                                         r"the reference forward, but model.reference_path .*other routes decoder "
                                         r"layers \[0, 2\] over 6 experts top-2 where the policy routes \[0, 2\] over 4 "
                                         r"top-2"):
        check([*common, f"model.reference_path={other}"])
    check([*common, f"model.reference_path={other}", "grpo.beta=0"])  # no reference forward: nothing to replay
    with pytest.raises(SystemExit, match=r"^config error: 'grpo.router_aux_loss_coef'=0.01 needs router sums, which "
                                         r"prefix trees \(rollout.tools\) do not return yet"):
        check(["configs/demo_cpu.yaml", f"model.path={policy}", "grpo.router_aux_loss_coef=0.01",
               "rollout.tools=[get_frames]", f"train.output_dir={tmp_path / 'out'}"])
