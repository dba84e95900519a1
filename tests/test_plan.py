"""Real model shapes and the planner: presets as published, the planner's arithmetic, its errors, and its memory and
FLOP formulas against real forward+backward passes at real widths (Qwen2-VL-2B, Qwen2.5-VL-3B and 7B layer shapes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.bench.measure import forward_backward
from app.planning import costs, flops, shapes
from app.planning.costs import GiB, Workload
from app.runtime.models import model_class

ROOT = Path(__file__).resolve().parents[1]

# Parameter counts the hub reports for each released checkpoint (its model page), in billions.
PUBLISHED_BILLIONS = {"qwen2_vl_2b": 2.21, "qwen2_vl_7b": 8.29, "qwen2_5_vl_3b": 3.75, "qwen2_5_vl_7b": 8.29,
                      "qwen2_5_vl_32b": 33.5, "qwen2_5_vl_72b": 73.4, "qwen3_vl_2b": 2.13, "qwen3_vl_4b": 4.44,
                      "qwen3_vl_8b": 8.77, "qwen3_vl_32b": 33.4}


# Qwen3.5's dense sizes: the hub's own counts were not reachable from here; each preset's count must fall where its
# name and public notes put it (the 4B and 9B checkpoints are "about 5B" and "about 10B" with their towers).
NOMINAL_BILLIONS = {"qwen3_5_0_8b": (0.75, 0.95), "qwen3_5_2b": (1.9, 2.4), "qwen3_5_4b": (4.0, 5.0),
                    "qwen3_5_9b": (9.0, 10.0), "qwen3_5_27b": (26.5, 28.0)}


# Mixture-of-experts sizes: "30B-A3B" is 30B parameters in all, 3B met by each token. Each preset's total and active
# counts (vision tower included) must fall where its name puts them.
MOE_NOMINAL = {"qwen3_vl_30b_a3b": ((30, 31.5), (3, 4)), "qwen3_vl_235b_a22b": ((234, 237), (22, 23.5)),
               "qwen3_5_35b_a3b": ((34.5, 36), (3, 4)), "qwen3_5_122b_a10b": ((121, 124), (10, 11)),
               "qwen3_5_397b_a17b": ((395, 400), (17, 18)),
               "qwen3_8_flash_next": ((125, 127.5), (7, 8.5))}  # on the GPUs: its 51.2B PLE table is host memory


def test_every_size_has_a_preset_with_its_source_and_the_published_parameter_count():
    assert set(shapes.preset_names()) == set(PUBLISHED_BILLIONS) | set(NOMINAL_BILLIONS) | set(MOE_NOMINAL)
    for name, ((low, high), (active_low, active_high)) in MOE_NOMINAL.items():
        preset = shapes.load_preset(name)
        assert preset["source"] == f"https://huggingface.co/{preset['hub_id']}/blob/main/config.json"
        assert preset["checked_against"]
        counts = shapes.count_parameters(shapes.hf_config(name))
        assert low <= counts.total / 1e9 <= high, (name, counts.total)
        assert active_low <= counts.active / 1e9 <= active_high, (name, counts.active)
    dense = shapes.count_parameters(shapes.hf_config("qwen3_vl_8b"))
    assert dense.active == dense.total
    for name, (low, high) in NOMINAL_BILLIONS.items():
        preset = shapes.load_preset(name)
        assert preset["source"] == f"https://huggingface.co/{preset['hub_id']}/blob/main/config.json"
        assert preset["checked_against"]
        total = shapes.count_parameters(shapes.hf_config(name)).total / 1e9
        assert low <= total <= high, (name, total)
    for name, billions in PUBLISHED_BILLIONS.items():
        preset = shapes.load_preset(name)
        assert preset["source"] == f"https://huggingface.co/{preset['hub_id']}/blob/main/config.json"
        assert preset["checked_against"]
        counts = shapes.count_parameters(shapes.hf_config(name))  # meta device: nothing allocated
        assert abs(counts.total / 1e9 - billions) <= 0.006 * billions + 0.005, (name, counts.total)


def test_qwen3_8_flash_next_counts_as_its_card_says_with_the_ple_table_on_the_host():
    """176B total (the card; 177.4B counted, its tower and embeddings included), 6B active per token in the decoder,
    the PLE table exactly 51,200,245,760 parameters (16 heads, 320,001,536 padded rows of 160) and counted as host
    memory, not a GPU's."""
    counts = shapes.count_parameters(shapes.hf_config("qwen3_8_flash_next"))
    assert counts.host == 51_200_245_760
    assert 176 <= (counts.total + counts.host) / 1e9 <= 178
    decoder_active = counts.active - counts.embedding - counts.head - counts.vision - counts.projector
    assert 5.8 <= decoder_active / 1e9 <= 6.2, decoder_active


def test_qsa_layers_under_sequence_parallelism_hold_the_whole_rows_keys_and_values(monkeypatch):
    """Qwen3.8-Flash-Next at S = 4: each of its 12 QSA layers holds the whole row's K and V (2 KV heads of 256) for
    its backward, 3/4 of them beyond its share; with checkpointing one layer at a time. At S = 1 and on a model
    without QSA layers, nothing."""
    shape = costs.shape_of(shapes.hf_config("qwen3_8_flash_next"))
    work = costs.Workload(prefix=230_400, completion=768, group_size=8)
    tokens = work.grouped_tokens
    kv = tokens * 2 * 2 * 256 * 2  # K and V, bf16
    assert shape.attention_layers == 12 and costs.qsa_joined(shape, tokens, 2, 4) == pytest.approx(kv * 3 / 4)
    assert costs.qsa_joined(shape, tokens, 2, 1) == 0
    assert costs.qsa_joined(costs.shape_of(shapes.hf_config("qwen3_5_9b")), tokens, 2, 4) == 0

    def activations(checkpointing):
        return costs.training_activations(shape, work, backend="split", dtype_bytes=2, checkpointing=checkpointing,
                                          chunk=1024, sequence_parallel=4)

    got = {c: activations(c) for c in (False, True)}
    monkeypatch.setattr(costs, "qsa_joined", lambda *args: 0.0)
    without = {c: activations(c) for c in (False, True)}
    assert got[False]["saved"] - without[False]["saved"] == pytest.approx(12 * kv * 3 / 4)
    assert got[True]["saved"] == without[True]["saved"]  # checkpointing: the recomputed layer alone holds it
    assert 0 <= got[True]["peak"] - without[True]["peak"] <= kv * 3 / 4 + 1  # beside the recompute, if that peaks


def test_the_7b_preset_is_the_shape_the_issue_names():
    shape = costs.shape_of(shapes.hf_config("qwen2_5_vl_7b"))
    assert (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate,
            shape.vocab) == (3584, 28, 28, 4, 128, 18944, 152064)


def test_reduced_depth_keeps_the_width_and_the_singled_out_blocks_within_depth():
    full = shapes.hf_config("qwen2_5_vl_7b")
    small = shapes.hf_config("qwen2_5_vl_7b", layers=2, vision_layers=3)
    assert small.text_config.num_hidden_layers == 2 and small.vision_config.depth == 3
    assert small.text_config.hidden_size == full.text_config.hidden_size
    assert small.vision_config.fullatt_block_indexes == [2]
    q3 = shapes.hf_config("qwen3_vl_8b", layers=1, vision_layers=9)
    assert q3.vision_config.deepstack_visual_indexes == [8]
    with pytest.raises(ValueError, match="layers=29 is outside 1..28"):
        shapes.hf_config("qwen2_5_vl_7b", layers=29)


def test_unknown_preset_is_refused_with_the_known_ones():
    with pytest.raises(shapes.PresetError, match="unknown model preset 'qwen9_vl'.*qwen2_5_vl_7b"):
        shapes.load_preset("qwen9_vl")


def test_a_checkpoint_path_finds_its_preset_by_name():
    assert shapes.preset_for_path("/models/Qwen2.5-VL-7B-Instruct") == "qwen2_5_vl_7b"
    assert shapes.preset_for_path("/models/Qwen3-VL-32B-Instruct/") == "qwen3_vl_32b"
    assert shapes.preset_for_path("/models/my-finetune") is None


@pytest.mark.slow
def test_a_real_width_checkpoint_is_written_and_loads_as_a_real_one(tmp_path):
    from app.runtime.models import load_model, load_processor

    path = shapes.build_real_width_checkpoint(tmp_path / "ckpt", "qwen2_5_vl_3b", layers=1, vision_layers=1)
    model = load_model(path, dtype=torch.bfloat16)
    assert model.config.text_config.hidden_size == 2048 and model.config.text_config.num_hidden_layers == 1
    processor = load_processor(path)
    assert processor.tokenizer.convert_tokens_to_ids("<|video_pad|>") == 151656
    assert model.config.video_token_id == 151656


# ------------------------------------------------------------------------------------------------------ the CLI
def _plan(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "app.planning.plan", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_plan_of_the_7b_config_on_8_gpus_is_standard_zero_arithmetic(tmp_path):
    """(How long it takes is the planner's own report, planned_in_seconds, not a bound here: timing belongs to the
    run, a timed assertion only to a machine's mood.)"""
    done = _plan("configs/qwen2_5_vl_7b_video.yaml", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "FITS" in done.stdout and "largest video that fits" in done.stdout
    result = json.loads((tmp_path / "plan.json").read_text())
    assert result["planned_in_seconds"] > 0 and "planned in" in done.stdout
    phi, ranks = result["parameters"]["total"], 8
    states = result["states"]  # ZeRO-3, bf16: 2 + 2 + 12 bytes per parameter, all partitioned over 8 ranks
    assert states["weights"] == pytest.approx(2 * phi / ranks)
    assert states["gradients"] == pytest.approx(2 * phi / ranks)
    assert states["optimizer"] == pytest.approx(12 * phi / ranks)
    assert states["reference"] == pytest.approx(2 * phi / ranks)
    assert (tmp_path / "plan.txt").read_text().startswith("model qwen2_5_vl_7b")


@pytest.mark.parametrize("args, message", [
    (["--model", "qwen9_vl"], "--model 'qwen9_vl' is neither a checkpoint folder nor a preset"),
    (["--gpus-per-node", "6", "train.sequence_parallel_size=4"], "a world of 6 ranks cannot be split"),
    (["train.sequence_parallel_size=8"], "sequence parallelism over 8 ranks needs the 28 query heads divisible by 8"),
    (["--gpu-memory-gib", "0"], "--gpu-memory-gib must be > 0, got 0.0"),
    (["rollout.group_sizes=8"], "rollout.group_sizes"),
    (["model.path=/models/my-finetune"], "names no preset; pass --model"),
    (["--measure-video", "/nowhere/clip.mp4"], "--measure-video /nowhere/clip.mp4: no such file"),
    (["--host-cores", "8", "--source-fps", "0"], "--source-fps / --video-size / --bitrate / --keyframe-interval"),
])
def test_bad_input_is_named(args, message, tmp_path, capsys, monkeypatch):
    from app.planning.plan import main

    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as stopped:
        main(["configs/qwen2_5_vl_7b_video.yaml", *args, "--out", str(tmp_path)])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_the_plan_chooses_spread_or_whole_families_by_price_as_the_trainer_does():
    """rollout.sp_split=auto in a plan (``timing.resolve_split``, the trainer's price): the LoRA 7B config at 7
    prompts on S = 4 keeps whole families at 128 frames (12.0 s spread against 11.7 s whole) and spreads at an hour
    of video (125 s against 140 s); forced settings are planned as set."""
    from app.config.loading import load_config
    from app.planning.planner import World, plan

    def planned(frames, *extra):
        cfg = load_config("configs/qwen2_5_vl_7b_video_lora.yaml", [
            "train.sequence_parallel_size=4", "train.prompts_per_rank=7", "train.groups_per_micro_batch=1",
            f"data.max_frames={frames}", *extra])
        return plan(cfg, World(), "qwen2_5_vl_7b", frames=frames)

    short, hour = planned(128)["rollout_split"], planned(3600)["rollout_split"]
    assert short["split"] == "families" and short["families_s"] < short["spread_s"] < 1.05 * short["families_s"]
    assert hour["split"] == "spread" and hour["spread_s"] < 0.95 * hour["families_s"]
    forced = planned(128, "rollout.sp_split=spread")
    assert forced["rollout_split"] is None and forced["phase_seconds"]["grouped"]["rollout"] > planned(128)[
        "phase_seconds"]["grouped"]["rollout"]


def test_the_rollouts_price_is_made_in_a_zero3_process_too(tiny_checkpoints):
    """A ZeRO-3 run's process has transformers' ZeRO-3 integration on (``zero.hf_deepspeed_config``); the rollout's
    price (``app.planning.split.rollout_pricer``, built once at setup) counts the model on the meta device outside
    it (before, the S = 2 ZeRO-3 run died at setup: the long rehearsal's smoke run), and the integration is on after."""
    from transformers import AutoConfig
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from app.config.loading import load_config
    from app.planning.split import rollout_pricer
    from app.runtime import zero

    cfg = load_config("configs/demo_cpu.yaml", ["train.sequence_parallel_size=2"])
    config = AutoConfig.from_pretrained(tiny_checkpoints["qwen2_5_vl"])
    keep = zero.hf_deepspeed_config({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_zero3_enabled()
    priced = rollout_pricer(cfg, config, device="cpu", ranks=2, zero_stage=3)
    spread_s, whole_s = priced([1200], [4], 2)
    assert spread_s > 0 and whole_s > 0 and is_deepspeed_zero3_enabled()
    del keep


def test_a_config_that_does_not_fit_gets_a_change_that_does(tmp_path):
    from app.config.loading import load_config
    from app.planning.planner import World, plan
    from app.planning.remedies import remedies

    cfg = load_config(ROOT / "configs/qwen2_5_vl_7b_video.yaml", ["data.max_frames=1024",
                                                                  "data.max_prompt_length=131072"])
    world = World(gpus_per_node=8, gpu_memory_gib=80)
    assert not plan(cfg, world, "qwen2_5_vl_7b")["fits"]
    fixes = remedies(cfg, world, "qwen2_5_vl_7b")
    assert fixes and fixes[-1]["fits"]
    # only changes the config does not have already: it checkpoints activations and gathers whole (full)
    assert "activation checkpointing" not in [f["change"] for f in fixes]
    assert plan(cfg, World(gpus_per_node=8, gpu_memory_gib=1000), "qwen2_5_vl_7b")["fits"]


HOUR = ["data.max_frames=3600", "data.fps=1", "data.max_prompt_length=262144", "rollout.prefill_chunk_size=4096",
        "forward.vision_chunk_frames=64", "model.freeze_vision_tower=true"]
REMEDY_SCENARIOS = {  # config, overrides, world (nodes, GPUs per node, GiB)
    "an hour at 1 fps, k = 6, one 8 x 80 GB node": ("configs/qwen2_5_vl_7b_video.yaml", HOUR + [
        "data.questions_per_video=6", "train.prompts_per_rank=6", "train.groups_per_micro_batch=6"], (1, 8, 80)),
    "an hour at 1 fps, k = 1": ("configs/qwen2_5_vl_7b_video.yaml", HOUR, (1, 8, 80)),
    "2,048 frames, LoRA, one 80 GB GPU": ("configs/qwen2_5_vl_7b_video_lora.yaml", [
        "data.max_frames=2048", "data.max_prompt_length=262144"], (1, 1, 80)),
    "512 frames with tools (no sequence parallelism for trees)": ("configs/qwen2_5_vl_7b_video.yaml", [
        "data.max_frames=512", "data.max_prompt_length=65536", "rollout.tools=[get_frames]"], (1, 8, 40)),
    "2,048 frames, k = 4, two nodes": ("configs/qwen2_5_vl_7b_video.yaml", [
        "data.max_frames=2048", "data.max_prompt_length=262144", "data.questions_per_video=4",
        "train.prompts_per_rank=4", "train.groups_per_micro_batch=4"], (2, 8, 80)),
}


@pytest.mark.parametrize("scenario", list(REMEDY_SCENARIOS))
def test_every_remedy_the_planner_prints_is_a_config_the_trainer_accepts(scenario):
    """Each printed change, applied with the ones above it as key=value overrides, loads through the trainer's own
    config checks; a change the checks refuse is printed as refused in the checks' own words (and not applied)."""
    from app.config.fields import ConfigError
    from app.config.loading import load_config
    from app.planning.planner import World, plan
    from app.planning.remedies import remedies

    config, overrides, (nodes, gpus, gib) = REMEDY_SCENARIOS[scenario]
    cfg = load_config(ROOT / config, overrides)
    world = World(nodes=nodes, gpus_per_node=gpus, gpu_memory_gib=gib)
    assert not plan(cfg, world, "qwen2_5_vl_7b")["fits"], scenario
    fixes = remedies(cfg, world, "qwen2_5_vl_7b")
    applied = list(overrides)
    for fix in fixes:
        change = [f"{k}={v}" for k, v in fix["overrides"].items()]
        if "refused" in fix:
            with pytest.raises(ConfigError) as refused:
                load_config(ROOT / config, applied + change)
            assert str(refused.value) == fix["refused"], (scenario, fix)
            continue
        load_config(ROOT / config, applied + change)  # accepted by the trainer's checks
        if fix.get("kept", True):  # an expert-parallel size that is not enough is not carried below
            applied += change
    assert any("refused" in f for f in fixes) == ("tools" in scenario), (scenario, fixes)
    if "tools" in scenario:  # the refusal is the config's own: trees have no sequence-parallel forward
        assert all("rollout.tools" in f["refused"] for f in fixes if "refused" in f)


def test_fit_suggestions_name_only_changes_not_already_in_the_config():
    from app.config.loading import load_config
    from app.planning.remedies import already_done

    cfg = load_config(ROOT / "configs/qwen2_5_vl_7b_video.yaml", ["train.sequence_parallel_size=2",
                                                                  "rollout.prefill_chunk_size=2048"])
    assert already_done(cfg, {"model.gradient_checkpointing": True})  # the config's own setting
    assert already_done(cfg, {"train.sequence_parallel_size": 2}) and not already_done(
        cfg, {"train.sequence_parallel_size": 4})
    assert already_done(cfg, {"rollout.prefill_chunk_size": 4096})  # a smaller chunk is set
    assert not already_done(cfg, {"rollout.zero3_gather": "layerwise"})
    assert not already_done(cfg, {"lora.rank": 64})
    lora = load_config(ROOT / "configs/qwen2_5_vl_7b_video_lora.yaml")
    assert already_done(lora, {"lora.rank": 64})  # a larger rank saves nothing


def test_lora_trains_only_the_adapters_and_loads_no_reference():
    from app.config.loading import load_config
    from app.planning.planner import World, plan

    cfg = load_config(ROOT / "configs/qwen2_5_vl_7b_video_lora.yaml")
    result = plan(cfg, World(), "qwen2_5_vl_7b")
    assert 0 < result["trainable"] < 0.05 * result["parameters"]["total"]
    assert result["states"]["reference"] == 0


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_random_models_are_initialised_as_transformers_initialises_them(family):
    """``shapes.random_model`` and ``random_tower`` skip torch's per-module initialisers and let transformers' own
    set every parameter: each one, by name, has the statistics of a plain ``from_config`` model's (constants equal,
    random ones with the same spread), so nothing is left as uninitialised memory."""
    from app.runtime.models import build_tokenizer, tiny_config

    config = tiny_config(family, build_tokenizer())
    torch.manual_seed(0)
    plain = dict(model_class(config).from_config(config, dtype=torch.float32).named_parameters())
    fast = dict(shapes.random_model(config).named_parameters())
    tower = {f"model.visual.{n}": p for n, p in shapes.random_tower(config).named_parameters()}
    assert set(fast) == set(plain) and set(tower) == {n for n in plain if n.startswith("model.visual.")}
    for name, want in plain.items():
        for got in (fast[name], tower.get(name, fast[name])):
            assert got.shape == want.shape and got.isfinite().all(), name
            if want.numel() < 64 or want.std() == 0:  # constants (norms at one, biases at zero) and tiny vectors
                assert torch.equal(got, want) or want.std() > 0, name
            else:
                assert got.std().item() == pytest.approx(want.std().item(), rel=0.25), name
                assert abs(got.mean().item() - want.mean().item()) < 0.25 * want.std().item() + 1e-6, name


# --------------------------------------------------------------------------- the formulas against measurement
@pytest.fixture(scope="module")
def real_width_models():
    """Full-width, reduced-depth models (float32 on this CPU), built once per module."""
    built = {}

    def get(preset: str, layers: int):
        if (preset, layers) not in built:
            built.clear()  # one at a time: the 7B width is 5 GB of float32 weights
            config = shapes.hf_config(preset, layers=layers, vision_layers=1)
            torch.manual_seed(0)
            model = shapes.random_model(config)
            model.train()
            built[(preset, layers)] = model
        return built[(preset, layers)]

    yield get
    built.clear()


def _inputs(prefix: int, group: int, completion: int):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 100000, (1, prefix), generator=generator)  # plain text ids of Qwen's vocabulary
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}
    completions = torch.randint(1000, 100000, (group, completion), generator=generator)
    return prompts, completions, torch.ones_like(completions)


def _check(model, prefix, group, completion, mode, checkpointing=False, deepspeed_linear=False):
    """Measure one pass and compare the planner's numbers. ``torch.nn.functional.linear`` is set for the pass either
    way: plain torch's, or DeepSpeed's ZeRO-3 replacement (which a ZeRO-3 model load installs for the rest of its
    process; an earlier in-process ZeRO-3 test left it in place once, and the measured FLOPs moved by one matmul per
    layer)."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    from app.runtime.models import enable_activation_checkpointing

    if checkpointing:
        enable_activation_checkpointing(model)
    shape = costs.shape_of(model.config)
    prompts, completions, mask = _inputs(prefix, group, completion)
    linear = zero3_linear_wrap if deepspeed_linear else torch._C._nn.linear
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "linear", linear)
        measured = forward_backward(model, prompts, completions, mask, group, mode=mode,
                                    backend=None if mode == "repeated" else "split")
    if checkpointing:
        model.gradient_checkpointing_disable()
    work = Workload(prefix=prefix, completion=completion, group_size=group)
    backend = "repeated" if mode == "repeated" else "split"
    predicted = costs.training_activations(shape, work, backend=backend, dtype_bytes=4, checkpointing=checkpointing,
                                           chunk=1024)
    counted = flops.train_flops(shape, work, backend, checkpointing=checkpointing, chunk=1024,
                                deepspeed_linear=deepspeed_linear)["total"]
    where = f"{mode} P={prefix} G={group} C={completion}"
    if not checkpointing:  # with checkpointing autograd saves the layer inputs, then the recomputed layer's
        assert predicted["saved"] == pytest.approx(measured["saved"], rel=0.15), where
    assert predicted["peak"] == pytest.approx(measured["peak"], rel=0.15), (where, predicted, measured)
    assert counted == pytest.approx(measured["flops"], rel=0.05), where
    return measured, predicted


@pytest.mark.slow  # about 30 s a mode at the 2B width on 2 cores
@pytest.mark.parametrize("mode", ["grouped", "repeated"])
def test_planner_matches_a_measured_pass_at_the_2b_width(real_width_models, mode):
    """Qwen2-VL-2B's width (the smallest real one: quick enough for make test); the 3B and 7B widths below."""
    _check(real_width_models("qwen2_vl_2b", 1), 256, 4, 32, mode)


@pytest.mark.slow
def test_planner_counts_the_recompute_under_deepspeeds_zero3_linear(real_width_models):
    """Under ZeRO-3 DeepSpeed's linear saves its inputs after its matmul, so activation checkpointing recomputes each
    layer's last matmul too. The planner counts it (``deepspeed_linear``, which planning sets for stage 3), and here
    the count without it would be off by more than the check's tolerance."""
    model = real_width_models("qwen2_vl_2b", 1)  # G = 2: the recompute is still 6% of the count (5% allowed)
    _check(model, 1024, 2, 32, "repeated", checkpointing=True, deepspeed_linear=True)
    shape, work = costs.shape_of(model.config), Workload(prefix=1024, completion=32, group_size=2)
    plain, deepspeed = (flops.train_flops(shape, work, "repeated", checkpointing=True, chunk=1024,
                                          deepspeed_linear=d)["total"] for d in (False, True))
    assert deepspeed > plain * 1.05


def test_grouped_flops_tend_to_one_over_g_of_repeated_as_the_prefix_grows():
    shape = costs.shape_of(shapes.hf_config("qwen2_5_vl_7b"))
    ratios = [flops.train_flops(shape, Workload(prefix=p, completion=128, group_size=8), "flash",
                                checkpointing=False, chunk=1024)["total_causal"]
              / flops.train_flops(shape, Workload(prefix=p, completion=128, group_size=8), "repeated",
                                  checkpointing=False, chunk=1024)["total_causal"] for p in (1024, 8192, 65536)]
    assert ratios[0] > ratios[1] > ratios[2] > 1 / 8
    assert ratios[2] < 1 / 8 * 1.2
    assert model_states_gib_7b() == pytest.approx(16 * 8.292e9 / 8 / GiB, rel=1e-3)


def model_states_gib_7b() -> float:
    counts = shapes.count_parameters(shapes.hf_config("qwen2_5_vl_7b"))
    states = costs.model_states(costs.StatesInput(total=counts.total, trainable=counts.total, reference=False,
                                                  stage=3, ranks=8, dtype_bytes=2))
    return states["total"] / GiB


@pytest.mark.parametrize("prefix, group, completion", [
    (1000, 4, 50), (640, 8, 128), (300, 3, 200), (2048, 6, 37), (129, 2, 127), (5000, 12, 300),
])
def test_flex_flops_count_the_tiles_its_block_mask_keeps(prefix, group, completion):
    """FlexAttention skips the tiles its block mask rules out and computes the rest whole: the planner's count is the
    block mask's, for prefixes and responses on and off tile boundaries."""
    from app.grouping.flex import FLEX_BLOCK, flex_block_mask
    from app.grouping.layout import GroupLayout

    layout = GroupLayout((group,), (prefix,), (completion,) * group, prefix, completion)
    mask = flex_block_mask(layout, "cpu")
    tiles = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
    pairs, causal = flops.attention_pairs(Workload(prefix=prefix, completion=completion, group_size=group), "flex")
    assert flops.KERNEL_BLOCK == FLEX_BLOCK
    assert pairs == tiles * FLEX_BLOCK**2
    assert causal <= pairs  # plus the diagonal tiles' waste: up to 1.8x here, for rows a few tiles long


def test_flash_flops_count_its_tiles_per_sequence():
    """flash-attn varlen runs the prefix causally, then each response against [P;Ri] bottom-right causal; a tile of
    query rows runs over every key tile up to its last row's diagonal."""
    assert flops.causal_tiles(256, 256) == 1 + 2  # rows 0-127 see key tile 0, rows 128-255 both
    assert flops.causal_tiles(64, 1000 + 64) == -(-1064 // 128)  # one row tile sees every key tile
    assert flops.causal_tiles(300, 300) == 1 + 2 + 3
    p, g, c = 8192, 8, 512
    pairs, causal = flops.attention_pairs(Workload(prefix=p, completion=c, group_size=g), "flash")
    assert pairs == 128**2 * (64 * 65 // 2 + g * sum(-(-(p + 128 * (t + 1)) // 128) for t in range(4)))
    assert causal < pairs < causal * 1.05  # long sequences: the tiles' waste is small
    split, _ = flops.attention_pairs(Workload(prefix=p, completion=c, group_size=g), "split")
    assert pairs < 0.8 * split  # the masked half of the prefix is skipped


@pytest.mark.slow  # about 45 s on 2 cores (the 2B width's head)
def test_a_family_of_questions_is_counted_as_the_flop_counter_counts_it(real_width_models):
    """Questions sharing a video (data.questions_per_video): three prompts sharing 224 of their 256 tokens, G = 2,
    at the 2B width (one layer). The planner's FLOPs of the family's forward+backward, and of the three groups
    packed apart, are within 5% of torch's flop counter, and so is the ratio between them."""
    from app.bench.measure import forward_backward

    model = real_width_models("qwen2_vl_2b", 1)
    shape = costs.shape_of(model.config)
    prefix, question, k, group, completion = 256, 32, 3, 2, 16
    generator = torch.Generator().manual_seed(0)
    shared = torch.randint(1000, 100000, (1, prefix - question), generator=generator)
    ids = torch.cat([shared.expand(k, -1), torch.randint(1000, 100000, (k, question), generator=generator)], dim=1)
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}
    completions = torch.randint(1000, 100000, (k * group, completion), generator=generator)
    mask = torch.ones_like(completions)
    counted = {name: forward_backward(model, prompts, completions, mask, group, backend="split",
                                      families=families)["flops"]
               for name, families in (("family", [k]), ("apart", None))}
    work = {"family": Workload(prefix=prefix, completion=completion, group_size=group, groups=k, questions=k,
                               question=question),
            "apart": Workload(prefix=prefix, completion=completion, group_size=group, groups=k)}
    planned = {name: flops.train_flops(shape, w, "split", checkpointing=False, chunk=1024)["total"]
               for name, w in work.items()}
    for name in counted:
        assert planned[name] == pytest.approx(counted[name], rel=0.05), name
    ratio = counted["family"] / counted["apart"]
    assert planned["family"] / planned["apart"] == pytest.approx(ratio, rel=0.05) and ratio < 0.8
    assert work["family"].grouped_tokens == prefix - question + k * (question + group * completion)


@pytest.mark.parametrize("k, shared, question, group, completion", [(2, 8000, 60, 8, 256), (4, 4000, 60, 8, 128),
                                                                    (8, 300, 17, 3, 9)])
def test_family_attention_pairs_are_the_split_backends_calls(k, shared, question, group, completion):
    """The planner's attention pairs of a family ([V; Q1; R1*; ...], split) are the rectangles of the kernel calls
    the grouping core makes for it (``families.family_parts``), and its causal pairs those of the dense mask."""
    from app.grouping.families import dense_family_mask, family_parts
    from app.grouping.layout import GroupLayout

    members = [(question, [completion] * group) for _ in range(k)]
    calls = sum((q1 - q0) * (k1 - k0) for q0, q1, k0, k1, _ in family_parts(shared, members))
    work = Workload(prefix=shared + question, completion=completion, group_size=group, groups=k, questions=k,
                    question=question)
    pairs, causal = flops.attention_pairs(work, "split")
    assert pairs == calls
    if shared < 1000:
        layout = GroupLayout((group,) * k, (shared + question,) * k, (completion,) * (k * group),
                             shared + question, completion, (k,), (shared,))
        assert causal == int(dense_family_mask(layout, "cpu").sum())
        assert work.grouped_tokens == layout.total_len


HOUR = ["data.max_frames=3600", "data.fps=1", "data.max_prompt_length=262144", "rollout.prefill_chunk_size=4096",
        "forward.vision_chunk_frames=64", "train.sequence_parallel_size=4", "train.prompts_per_rank=6",
        "data.questions_per_video=6", "train.groups_per_micro_batch=6"]


def test_the_host_rates_reproduce_the_clip_they_were_measured_on():
    """decord at 1 fps from the 2-minute 720p30 clip decodes all 3,600 source frames: 5.2 s of CPU; encode_record on
    its 120 frames at data.max_pixels (grid [60, 16, 30], patch 14): 12.4 s in all (issue 76's measurement). A
    sparser sampling decodes from each sampled frame's keyframe only."""
    from app.planning.host import MEASURED, Source, decoded_frames

    source = Source()
    assert decoded_frames(120, 1.0, source) == 3600
    decode = decoded_frames(120, 1.0, source) * 1280 * 720 * MEASURED.decode_ns / 1e9
    assert decode == pytest.approx(5.2)
    assert decode + 120 * (16 * 14) * (30 * 14) * MEASURED.process_ns / 1e9 == pytest.approx(12.4)
    assert decoded_frames(12, 0.1, source) == 12 * 125  # one frame in 300: half a keyframe interval each


def test_the_hour_long_plan_prices_the_host_beside_the_gpus_and_names_what_would_change_it(tmp_path, capsys,
                                                                                          monkeypatch):
    """scripts/plan.sh --host-cores: an hour at 1 fps on the 7B LoRA config, S = 4, k = 6, 96 cores a node (12 a
    rank). Each rank decodes and processes its quarter of the video (data.decode_shares): 900 of the 3,600 sampled
    frames, about 27,000 source frames decoded with the run-in from a keyframe, decoded and resized on 12 / 2 = 6
    threads by default (one video: the second prefetch thread idles): well under the 92 s GPU step, so the step
    stays the GPUs'. With every rank decoding the whole video (data.decode_shares=false: about 160 s and 230 s of
    CPU) the host is the limit, and the remedies named are the ones that apply, share decoding among them."""
    from app.planning.host import THREAD_GAIN
    from app.planning.plan import main

    monkeypatch.chdir(ROOT)
    plan = ["configs/qwen2_5_vl_7b_video_lora.yaml", "model.path=/models/Qwen2.5-VL-7B-Instruct", *HOUR]
    main([*plan, "--host-cores", "96", "--out", str(tmp_path / "shares")])
    data = json.loads((tmp_path / "shares" / "plan.json").read_text())["data"]
    assert data["share"] == 4 and data["sampled_frames"] == 900
    assert 900 * 30 < data["decoded_frames"] < 900 * 30 + 125  # the run-in: under half a keyframe interval
    assert data["cores"] == 12 and data["decode_threads"] == 6
    gain = 1 + 5 * THREAD_GAIN  # 6 threads on one video, each beyond the first adding what 2 did on 2 cores
    assert data["wall_s"] == pytest.approx((data["decode_cpu_s"] + data["process_cpu_s"]) / gain)
    assert not data["host_limits"] and data["step_s"] == data["gpu_step_s"] > data["wall_s"]
    assert "its 1/4 share of each: 900 sampled" in capsys.readouterr().out
    main([*plan, "data.decode_shares=false", "--host-cores", "96", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    whole = json.loads((tmp_path / "plan.json").read_text())["data"]
    assert whole["share"] == 1 and whole["sampled_frames"] == 3600 and whole["decoded_frames"] == 108000
    assert whole["decode_cpu_s"] == pytest.approx(156, rel=0.01) and 200 < whole["process_cpu_s"] < 260
    assert 0.25 < data["decode_cpu_s"] / whole["decode_cpu_s"] < 0.26
    assert data["process_cpu_s"] == pytest.approx(whole["process_cpu_s"] / 4)
    assert whole["host_limits"] and whole["step_s"] == whole["wall_s"] > whole["gpu_step_s"]
    assert "the host is the limit" in out and "data.decode_threads, now 6" in out
    assert "only its share of the frames (data.decode_shares=true" in out and "data.fps" in out
    # six questions a video at k = 1, whole videos, no prefetch: six one after another, each on 12 threads; a sum
    main(["configs/qwen2_5_vl_7b_video_lora.yaml", "model.path=/models/Qwen2.5-VL-7B-Instruct", *HOUR[:-2],
          "data.questions_per_video=1", "train.groups_per_micro_batch=1", "data.prefetch=0", "data.decode_shares=false",
          "--host-cores", "96",
          "--out", str(tmp_path / "k1")])
    data = json.loads((tmp_path / "k1" / "plan.json").read_text())["data"]
    assert data["videos"] == 6 and data["threads"] == 1 and data["decode_threads"] == 12
    assert data["step_s"] == pytest.approx(data["gpu_step_s"] + data["wall_s"])
    assert "data.prefetch=1" in data["remedy"]
    # no --host-cores: no data phase (the plan as before)
    main(["configs/qwen2_5_vl_7b_video_lora.yaml", "model.path=/models/Qwen2.5-VL-7B-Instruct", "--out",
          str(tmp_path / "none")])
    assert json.loads((tmp_path / "none" / "plan.json").read_text())["data"] is None


def test_measure_video_prices_the_host_on_a_real_h264_file(tmp_path, capsys, monkeypatch):
    """--measure-video: decord and qwen-vl-utils on a file written here (H.264 through PyAV), the rates this
    machine gives, named in the plan."""
    import numpy as np

    from app.data.video import write_mp4
    from app.planning.host import measure_video

    clip = write_mp4(tmp_path / "clip.mp4", np.random.default_rng(0).integers(0, 255, (24, 96, 128, 3),
                                                                            dtype=np.uint8), fps=8)
    rates = measure_video(str(clip), sample_fps=2.0, max_pixels=12544)
    assert rates.decode_ns > 0 and rates.process_ns > 0 and "clip.mp4 (24 frames of 128x96 at 8 fps)" in rates.source
    from app.planning.plan import main

    monkeypatch.chdir(ROOT)
    main(["configs/qwen2_5_vl_7b_video_lora.yaml", "model.path=/models/Qwen2.5-VL-7B-Instruct", "data.fps=2",
          "--measure-video", str(clip), "--out", str(tmp_path / "plan")])
    assert "measured on" in capsys.readouterr().out


# The wider models last: the module fixture holds one model at a time, so the 2B width's tests above share one
# build (each width in between would rebuild it).
@pytest.mark.slow  # about 45 s; repeated passes at these widths: the planner_accuracy and real_width benchmarks
def test_planner_matches_a_measured_pass_at_the_3b_width_under_checkpointing(real_width_models):
    _check(real_width_models("qwen2_5_vl_3b", 2), 256, 4, 64, "grouped", checkpointing=True)


@pytest.mark.slow  # about 35 s: a pass's time is its matmuls (the head's 545M weights among them), about 45 GFLOP/s
def test_planner_matches_a_measured_pass_at_the_7b_width(real_width_models):
    _check(real_width_models("qwen2_5_vl_7b", 1), 256, 2, 32, "grouped")


def test_the_routing_record_is_priced_per_token_and_only_when_replayed():
    """rollout.routing_replay=r3: an int16 id per sparse layer and top-k slot (768 bytes a token at 30B-A3B: 48
    layers x 8; 640 at 35B-A3B: 40 x 8), each prompt's tokens once and each sample's completion tokens; 0 when off
    and on a dense model."""
    from app.config.loading import load_config
    from app.planning.layers import routing_bytes_per_token
    from app.planning.planner import World, plan

    per_token = {name: routing_bytes_per_token(costs.shape_of(shapes.hf_config(name)))
                 for name in ("qwen3_vl_30b_a3b", "qwen3_5_35b_a3b", "qwen3_vl_8b")}
    assert per_token == {"qwen3_vl_30b_a3b": 768, "qwen3_5_35b_a3b": 640, "qwen3_vl_8b": 0}
    cfg = load_config("configs/qwen3_vl_30b_a3b_video_lora.yaml")
    world = World(gpus_per_node=8, gpu_memory_gib=80)
    on = plan(cfg, world, "qwen3_vl_30b_a3b", frames=16)
    off = plan(load_config("configs/qwen3_vl_30b_a3b_video_lora.yaml", ["rollout.routing_replay=off"]), world,
               "qwen3_vl_30b_a3b", frames=16)
    work = on["workload"]
    prompts = cfg.train.prompts_per_rank
    want = 768 * (prompts * work["prefix"] + prompts * cfg.rollout.group_size * work["completion"])
    assert on["rollout"]["routing_record"] == pytest.approx(want) and off["rollout"]["routing_record"] == 0
