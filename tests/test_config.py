"""Configuration: YAML + key=value overrides, errors that name the key."""

from __future__ import annotations

import re

import pytest

from app.config.loading import ConfigError, describe, load_config

ROOT_CONFIGS = ["configs/demo_cpu.yaml", "configs/qwen2_5_vl_7b_video.yaml", "configs/qwen2_5_vl_7b_video_lora.yaml"]


@pytest.mark.parametrize("path", ROOT_CONFIGS)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.rollout.group_size >= 2


def test_overrides_are_typed():
    cfg = load_config("configs/demo_cpu.yaml", ["grpo.beta=0.1", "train.max_steps=3", "rewards.functions=[format]",
                                                "rewards.weights=[2]", "data.shuffle=false"])
    assert cfg.grpo.beta == 0.1 and cfg.train.max_steps == 3 and cfg.rewards.functions == ["format"]
    assert cfg.data.shuffle is False


def test_qwen_7b_config_matches_video_r1_settings():
    cfg = load_config("configs/qwen2_5_vl_7b_video.yaml")
    assert (cfg.data.max_frames, cfg.data.max_prompt_length, cfg.rollout.max_completion_length) == (16, 16384, 768)
    assert (cfg.rollout.group_size, cfg.train.learning_rate, cfg.grpo.beta) == (8, 1e-6, 0.04)
    assert cfg.train.deepspeed_config.endswith("zero3.json")


@pytest.mark.parametrize(("override", "message"), [
    ("grpo.betta=0.1", "unknown config key 'grpo.betta' (did you mean 'grpo.beta'?)"),
    ("gropo.beta=0.1", "unknown config key 'gropo'"),
    ("train.max_steps=many", "'train.max_steps' must be an integer"),
    ("forward.grouping=fast", "'forward.grouping' must be one of"),
    ("rollout.group_size=1", "'rollout.group_size' must be >= 2"),
    ("train.groups_per_micro_batch=3", "'train.groups_per_micro_batch' must divide"),
    ("rewards.weights=[1]", "'rewards.weights' needs one weight per function"),
    ("beta=0.1", "must be section.key"),
    ("grpo.beta", "is not of the form"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/demo_cpu.yaml", [override])


MOE_CONFIGS = ["configs/qwen3_vl_30b_a3b_video_lora.yaml", "configs/qwen3_5_35b_a3b_video_lora.yaml"]


@pytest.mark.parametrize("path", MOE_CONFIGS)
def test_the_moe_configs_load_and_their_keys_are_checked_by_name(path):
    cfg = load_config(path)
    assert cfg.lora.target_parameters and cfg.grpo.router_aux_loss_coef == 0 and not cfg.model.train_router
    for overrides, message in [
            (["lora.dropout=0.05"], "'lora.dropout' =0.05 cannot be used with lora.target_parameters"),
            (["lora.rank=0"], "'lora.target_parameters' (['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']) asks"),
            (["grpo.router_aux_loss_coef=-1"], "'grpo.router_aux_loss_coef' must be >= 0"),
            (["train.collective_timeout_s=0"], "'train.collective_timeout_s' must be > 0"),
            (["model.experts_implementation=fast"], "'model.experts_implementation' must be one of")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(path, overrides)


def test_the_full_weight_moe_config_trains_every_weight_but_the_routers():
    cfg = load_config("configs/qwen3_vl_30b_a3b_video.yaml")
    assert cfg.lora.rank == 0 and not cfg.lora.target_parameters and not cfg.model.train_router
    assert cfg.rollout.zero3_gather == "layerwise" and cfg.train.deepspeed_config.endswith("zero3.json")


def test_missing_file_and_help():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("configs/nope.yaml")
    assert "grpo:" in describe() and "KL coefficient" in describe()


@pytest.mark.parametrize(("override", "message"), [
    ("logging.log_every=0", "'logging.log_every' must be >= 1"),
    ("eval.batch_size=0", "'eval.batch_size' must be >= 1"),
    ("train.keep_checkpoints=0", "'train.keep_checkpoints' must be >= 1"),
    ("data.fps=0", "'data.fps' must be > 0"),
    ("rollout.top_p=1.5", "'rollout.top_p' must be in (0, 1]"),
    ("grpo.delta=1.1", "'grpo.delta' must be 0 (off) or > 1 + grpo.epsilon_high"),
    ("grpo.importance_sampling_cap=0.5", "'grpo.importance_sampling_cap' must be 0 (off) or >= 1"),
    ("grpo.dynamic_sampling_max_draws=-1", "'grpo.dynamic_sampling_max_draws' must be >= 0"),
    ("grpo.loss_aggregation=token", "'grpo.loss_aggregation' was renamed: use grpo.loss_type"),
    ("grpo.loss_type=ppo", "'grpo.loss_type' must be one of ['auto', 'grpo', 'bnpo', 'dapo', 'dr_grpo']"),
    ("rewards.functions=[format, length]", "set rewards.length=true"),
    ("data.shuffle=yes", "got 'yes' (yes/no/on/off are not booleans here"),
    ("data.image_min_pixels=999999999", "'data.image_min_pixels' must be <= data.image_max_pixels"),
    ("data.max_prompt_length=0", "'data.max_prompt_length' must be >= 1"),
    ("rollout.prefill_chunk_size=-1", "'rollout.prefill_chunk_size' must be >= 0"),
    ("data.decode_threads=-1", "'data.decode_threads' must be >= 0"),
    ("forward.vision_chunk_frames=-2", "'forward.vision_chunk_frames' must be >= 0"),
])
def test_counts_and_intervals_are_validated(override, message):
    with pytest.raises(ConfigError) as error:
        load_config("configs/demo_cpu.yaml", [override])
    assert message in str(error.value)


def test_renamed_forward_keys_say_where_they_went_and_split_is_selectable():
    for old in ("grpo.grouping=grouped", "grpo.attention_backend=split", "grpo.self_check=false",
                "grpo.logprob_chunk_size=8"):
        with pytest.raises(ConfigError, match=f"'{old.split('=')[0]}' was renamed: use forward\\."):
            load_config("configs/demo_cpu.yaml", [old])
    cfg = load_config("configs/demo_cpu.yaml", ["forward.attention_backend=split"])
    assert cfg.forward.backend == "split"
    from app.grouping import BACKENDS

    for backend in BACKENDS:  # every backend the grouping core has is selectable
        assert load_config("configs/demo_cpu.yaml", [f"forward.attention_backend={backend}"]).forward.backend == backend


def test_choices_come_from_the_modules_that_own_them():
    import dataclasses

    from app.config import sections as config
    from app.objectives import grpo
    from app.rollout import registry as engines
    from app.runtime.zero import GATHER_MODES

    def choices(section, name):
        return next(f for f in dataclasses.fields(section) if f.name == name).metadata["choices"]

    assert choices(config.GRPOConfig, "loss_type") is grpo.LOSS_TYPE_SETTINGS
    assert choices(config.GRPOConfig, "kl_estimator") is grpo.KL_ESTIMATORS
    assert choices(config.RolloutConfig, "engine") is engines.ENGINE_NAMES
    assert choices(config.EvalConfig, "engine") is engines.ENGINE_NAMES
    assert choices(config.RolloutConfig, "zero3_gather") is GATHER_MODES


def test_yaml_booleans_are_yaml_1_2_and_scale_rewards_auto(tmp_path):
    from app.objectives.grpo import resolve_scale

    def scale_rewards(grpo):  # one home for the option: grpo resolves 'auto'
        return resolve_scale(grpo.scale_rewards, grpo.loss_type)

    path = tmp_path / "c.yaml"
    path.write_text("model: {path: m}\ndata: {train_file: t, system_prompt: no, confine_to_root: false}\n")
    cfg = load_config(path)
    assert cfg.data.system_prompt == "no" and cfg.data.confine_to_root is False
    assert scale_rewards(cfg.grpo) == "group"
    assert scale_rewards(load_config(path, ["grpo.loss_type=dr_grpo"]).grpo) == "none"
    assert scale_rewards(load_config(path, ["grpo.loss_type=dr_grpo", "grpo.scale_rewards=batch"]).grpo) == "batch"


def test_sequence_parallel_settings_are_checked_by_name():
    with pytest.raises(ConfigError, match="'train.sequence_parallel_size' must be >= 1"):
        load_config("configs/demo_cpu.yaml", ["train.sequence_parallel_size=0"])
    with pytest.raises(ConfigError, match="needs rollout.engine grouped or hf"):
        load_config("configs/demo_cpu.yaml", ["train.sequence_parallel_size=2", "rollout.engine=vllm"])
    with pytest.raises(ConfigError, match="needs forward.grouping=grouped"):
        load_config("configs/demo_cpu.yaml", ["train.sequence_parallel_size=2", "forward.grouping=repeated"])
    from app.grouping.sequence_parallel import check_heads
    from app.runtime.models import TinySizes, build_tokenizer, tiny_config

    config = tiny_config("qwen2_5_vl", build_tokenizer(), TinySizes(heads=4, kv_heads=2))
    check_heads(config, 2)
    check_heads(config, 4)  # each KV head repeated twice
    with pytest.raises(ValueError, match="4 query heads.*3"):
        check_heads(config, 3)


def test_long_video_settings_that_do_nothing_say_so():
    from app.config.loading import warnings_for

    chunked = load_config("configs/demo_cpu.yaml", ["rollout.prefill_chunk_size=512", "forward.vision_chunk_frames=4",
                                                    "model.freeze_vision_tower=true"])
    assert warnings_for(chunked) == []
    vllm = load_config("configs/demo_cpu.yaml", ["rollout.prefill_chunk_size=512", "rollout.engine=vllm"])
    assert any("rollout.prefill_chunk_size=512 is used by rollout.engine=grouped only" in w for w in warnings_for(vllm))
    training_tower = load_config("configs/demo_cpu.yaml", ["forward.vision_chunk_frames=4"])
    assert any("forward.vision_chunk_frames=4 has no effect while the vision tower trains" in w
               for w in warnings_for(training_tower))


@pytest.mark.parametrize(("override", "message"), [
    ("rollout.vllm_tensor_parallel_size=0", "'rollout.vllm_tensor_parallel_size' must be >= 1"),
    ("rollout.vllm_tensor_parallel_size=2", "'rollout.vllm_tensor_parallel_size' =2 is not supported: with vLLM's "
                                            "external launcher"),
    ("rollout.vllm_gpu_memory_utilization=5", "'rollout.vllm_gpu_memory_utilization' must be in \\(0, 1\\]"),
    ("rollout.vllm_gpu_memory_utilization=0", "'rollout.vllm_gpu_memory_utilization' must be in \\(0, 1\\]"),
    ("rollout.vllm_cpu_kv_cache_gib=0", "'rollout.vllm_cpu_kv_cache_gib' must be > 0"),
    ("rollout.vllm_max_videos=-1", "'rollout.vllm_max_videos' must be >= 0"),
    ("rollout.vllm_max_images=-2", "'rollout.vllm_max_images' must be >= 0"),
])
def test_every_vllm_setting_is_checked_against_its_range_by_name(override, message):
    """Whatever the engine (a typo must not wait for the day vLLM is switched on), in training and evaluation."""
    for training in (True, False):
        with pytest.raises(ConfigError, match=message):
            load_config("configs/demo_cpu.yaml", [override, "model.path=m"], training=training)


def test_vllm_with_filtered_sampling_and_importance_weights_is_refused_off_temperature_one():
    """At temperature 1 vLLM's raw log-probs are the trainer's (unfiltered); elsewhere its log-probs are of the
    top-p/top-k filtered distribution, which truncated importance sampling must not compare with the whole."""
    base = ["rollout.engine=vllm", "model.path=m"]
    load_config("configs/demo_cpu.yaml", [*base, "rollout.top_p=0.9"])  # temperature 1: the same distribution
    with pytest.raises(ConfigError, match="compare different distributions"):
        load_config("configs/demo_cpu.yaml", [*base, "rollout.top_p=0.9", "rollout.temperature=0.7"])
    with pytest.raises(ConfigError, match="compare different distributions"):
        load_config("configs/demo_cpu.yaml", [*base, "rollout.top_k=20", "rollout.temperature=0.7"])
    load_config("configs/demo_cpu.yaml", [*base, "rollout.top_k=20", "rollout.temperature=0.7",
                                          "grpo.importance_sampling_cap=0"])  # no importance weights: allowed
    load_config("configs/demo_cpu.yaml", ["model.path=m", "rollout.top_p=0.9", "rollout.temperature=0.7"])  # grouped


def test_a_model_path_that_is_not_a_checkpoint_is_one_line_naming_it(tmp_path, capsys):
    """From the launcher's entry point: a missing path, a file, a folder without config.json, a config that is
    not JSON, a checkpoint without weights: one line naming the path, before any process group starts."""
    from app.runtime.models import build_tiny_checkpoint
    from app.training.trainer import main

    folder = tmp_path / "empty"
    folder.mkdir()
    not_json = tmp_path / "bad"
    not_json.mkdir()
    (not_json / "config.json").write_text("{not json")
    no_weights = tmp_path / "noweights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    a_file = tmp_path / "model.safetensors"
    a_file.write_text("x")
    good = build_tiny_checkpoint(tmp_path / "tiny", "qwen2_5_vl")
    cases = {tmp_path / "missing": "does not exist", a_file: "is a file, not a checkpoint directory",
             folder: "has no config.json", not_json: "config.json cannot be read as JSON",
             no_weights: "holds no weights"}
    for path, reason in cases.items():
        with pytest.raises(SystemExit) as raised:
            main(["configs/demo_cpu.yaml", f"model.path={path}"])
        message = str(raised.value.code)
        assert message.startswith("model error: model.path") and str(path) in message and reason in message
        assert "\n" not in message
    with pytest.raises(SystemExit, match="model error: model.reference_path"):
        main(["configs/demo_cpu.yaml", f"model.path={good}", f"model.reference_path={folder}"])


def test_the_config_reference_page_is_generated_from_the_declarations():
    """docs/config.md is `python -m app.config --markdown`: a key added, renamed or re-documented without
    regenerating it fails here (run that command and commit the page)."""
    from pathlib import Path

    from app.config.loading import CONFIG_PAGE, reference_markdown

    page = Path(__file__).resolve().parents[1] / CONFIG_PAGE
    assert page.read_text() == reference_markdown(), "stale: python -m app.config --markdown > docs/config.md"


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.engine=hf"], "'rollout.routing_replay' =r3 records routing in rollout.engine=grouped or vllm (its "
     "routed experts, on a GPU), not hf"),
    (["rollout.routing_replay=r2"], "'rollout.routing_replay' must be one of"),
])
def test_routing_replay_is_refused_by_name_where_its_record_is_not_made(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/qwen3_vl_30b_a3b_video_lora.yaml", ["rollout.routing_replay=r3", *overrides])
    for path in [*MOE_CONFIGS, "configs/qwen3_vl_30b_a3b_video.yaml"]:
        assert load_config(path).rollout.routing_replay == "r3"  # the MoE configs replay
    for overrides in (["train.sequence_parallel_size=2"], ["rollout.engine=vllm", "lora.target_parameters=[]"],
                      ["rollout.tools=[get_frames]"],
                      ["data.questions_per_video=2", "train.prompts_per_rank=2", "train.groups_per_micro_batch=2"]):
        load_config("configs/qwen3_vl_30b_a3b_video_lora.yaml", ["rollout.routing_replay=r3", *overrides])
    assert load_config("configs/demo_cpu.yaml").rollout.routing_replay == "off"


def test_routing_replay_on_a_dense_checkpoint_stops_before_the_load_in_one_line(tiny_checkpoints, tmp_path):
    from app.training.preflight import check

    with pytest.raises(SystemExit, match=r"^config error: 'rollout.routing_replay'=r3 needs a mixture-of-experts "
                       r"model; .*qwen2_5_vl has no routed experts"):
        check(["configs/demo_cpu.yaml", f"model.path={tiny_checkpoints['qwen2_5_vl']}", "rollout.routing_replay=r3",
               f"train.output_dir={tmp_path}"])
    check(["configs/demo_cpu.yaml", f"model.path={tiny_checkpoints['qwen3_vl_moe']}", "rollout.routing_replay=r3",
           f"train.output_dir={tmp_path}"])
