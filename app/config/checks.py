"""Checks across configuration keys: what cannot run is refused with the key named (``validate``), what runs but is
probably not meant is said once at start-up (``warnings_for``); vLLM's own ranges are checked before vLLM starts.
"""

from __future__ import annotations

import dataclasses
import re

from app.common.options import OptionError
from app.config.sections import (
    Config,
    ConfigError,
    RolloutConfig,
)
from app.rollout.registry import IN_PROCESS, TRAINING_ONLY

OPTION_FIELDS = {"max_new_tokens": "max_completion_length"}  # an options field -> its config key, where they differ


def _validate_tools(config: Config, need) -> None:
    """rollout.tools: what the multi-turn recipe supports so far, refused by name otherwise."""
    r = config.rollout
    branching = r.branching or [r.group_size]
    product = 1
    for b in branching:
        need(isinstance(b, int) and b >= 1, "rollout.branching", f"must list whole numbers >= 1, got {r.branching}")
        product *= b
    need(product == r.group_size, "rollout.branching", f"{branching} makes {product} rollouts per prompt; "
         f"rollout.group_size is {r.group_size}")
    need(len(branching) <= r.max_turns, "rollout.branching", f"splits at {len(branching)} turns but "
         f"rollout.max_turns is {r.max_turns}")
    need(r.max_turns >= 1, "rollout.max_turns", "must be >= 1")
    need(r.max_total_tokens >= 1, "rollout.max_total_tokens", "must be >= 1")
    need(r.engine in ("grouped", "hf", "vllm"), "rollout.engine", f"{r.engine!r} has no multi-turn rollouts (with "
         "rollout.tools: grouped, hf or vllm)")
    if r.engine == "vllm":  # every call may add a clip or an image to the prompt vLLM is given
        calls = r.max_turns - 1
        need(r.vllm_max_videos >= 1 + calls, "rollout.vllm_max_videos", f"({r.vllm_max_videos}) is below what a "
             f"rollout with tools may hold: its video and one clip per call, 1 + (rollout.max_turns - 1) = "
             f"{1 + calls}")
        need(r.vllm_max_images >= 1 + calls, "rollout.vllm_max_images", f"({r.vllm_max_images}) is below what a "
             f"rollout with tools may hold: its image and one per call, 1 + (rollout.max_turns - 1) = {1 + calls}")
    need(config.train.sequence_parallel_size == 1, "train.sequence_parallel_size",
         "must be 1 with rollout.tools (prefix trees have no sequence-parallel forward yet)")
    need(not config.rewards.temporal, "rewards.temporal", "is not available with rollout.tools")
    need(not r.record, "rollout.record", "is not available with rollout.tools (a replay of trees is not built)")


def _validate_shared_video(config: Config, need) -> None:
    """data.questions_per_video > 1: what shares a video across questions, refused by name where it does not."""
    k = config.data.questions_per_video
    if k == 1:
        return
    need(not config.rollout.tools, "data.questions_per_video", f"={k} is not available with rollout.tools (a "
         "multi-turn group is a prefix tree of its own; trees of one video are not joined)")
    need(config.forward.attention_backend not in ("packed", "paper"), "forward.attention_backend",
         f"={config.forward.attention_backend} does not share a video across questions; with "
         f"data.questions_per_video={k} use auto, split (CPU), masked, flash or flex")


def validate(config: Config, training: bool = True) -> None:
    def need(condition: bool, key: str, message: str) -> None:
        if not condition:
            raise ConfigError(f"'{key}' {message}")

    need(bool(config.model.path), "model.path", "is required (a local checkpoint directory)")
    for key, value, least in (
        ("eval.batch_size", config.eval.batch_size, 1), ("eval.max_new_tokens", config.eval.max_new_tokens, 1),
        ("data.max_frames", config.data.max_frames, 2),  # qwen-vl-utils samples an even count, >= 2 frames
        ("data.max_prompt_length", config.data.max_prompt_length, 1),
        ("data.min_pixels", config.data.min_pixels, 1), ("data.image_min_pixels", config.data.image_min_pixels, 1),
        ("data.video_total_pixels", config.data.video_total_pixels, 0),
        ("logging.log_every", config.logging.log_every, 1), ("logging.sample_table_every",
                                                             config.logging.sample_table_every, 0),
        ("train.save_every", config.train.save_every, 0), ("train.keep_checkpoints", config.train.keep_checkpoints, 1),
        ("train.warmup_steps", config.train.warmup_steps, 0),
        ("forward.logprob_chunk_size", config.forward.logprob_chunk_size, 0),
        ("forward.vision_chunk_frames", config.forward.vision_chunk_frames, 0),
        ("rollout.prefill_chunk_size", config.rollout.prefill_chunk_size, 0),
        ("sft.max_target_length", config.sft.max_target_length, 1), ("lora.rank", config.lora.rank, 0),
        ("data.prefetch", config.data.prefetch, 0),
        ("train.stop_at_step", config.train.stop_at_step, 0),
        ("data.prefetch_workers", config.data.prefetch_workers, 1),
        ("data.decode_threads", config.data.decode_threads, 0),
        ("data.questions_per_video", config.data.questions_per_video, 1),
    ):
        need(value >= least, key, f"must be >= {least}, got {value}")
    need(config.data.fps > 0, "data.fps", f"must be > 0, got {config.data.fps}")
    need(0 <= config.lora.dropout < 1, "lora.dropout", f"must be in [0, 1), got {config.lora.dropout}")
    need(config.lora.alpha > 0, "lora.alpha", f"must be > 0, got {config.lora.alpha}")
    need(not (config.lora.rank and config.lora.vision_tower and config.model.freeze_vision_tower), "lora.vision_tower",
         "puts trainable adapters on the vision tower, which model.freeze_vision_tower=true asks to keep frozen: "
         "choose one")
    need(not (config.lora.rank and config.lora.projector and config.model.freeze_projector), "lora.projector",
         "puts trainable adapters on the projector, which model.freeze_projector=true asks to keep frozen: choose one")
    need(not (config.lora.rank and config.model.reference_path), "model.reference_path",
         "cannot be used with LoRA (lora.rank > 0): the reference is the policy with its adapters off")
    need(config.train.learning_rate >= 0, "train.learning_rate", "must be >= 0")
    need(config.grpo.router_aux_loss_coef >= 0, "grpo.router_aux_loss_coef", "must be >= 0")
    need(config.train.collective_timeout_s > 0, "train.collective_timeout_s", "must be > 0 (seconds)")
    need(not (config.lora.target_parameters and not config.lora.rank), "lora.target_parameters",
         f"({config.lora.target_parameters}) asks for adapters on expert weights, but lora.rank is 0 (no LoRA)")
    need(not (config.lora.target_parameters and config.lora.dropout), "lora.dropout",
         f"={config.lora.dropout} cannot be used with lora.target_parameters: peft's adapters on fused expert weights "
         "(ParamWrapper) have no dropout; set lora.dropout=0")
    need(config.train.max_grad_norm >= 0, "train.max_grad_norm", "must be >= 0")
    need(config.eval.samples >= 1, "eval.samples", "must be >= 1")
    need(config.eval.temperature >= 0, "eval.temperature", "must be >= 0")
    need(config.eval.repetition_penalty > 0, "eval.repetition_penalty",
         f"must be > 0 (1 leaves the logits alone), got {config.eval.repetition_penalty}")
    need(config.eval.temperature > 0 or config.eval.samples == 1, "eval.samples",
         "> 1 needs eval.temperature > 0 (greedy samples would all be the same)")
    validate_vllm_ranges(config.rollout)
    need(config.eval.engine not in TRAINING_ONLY, "eval.engine",
         f"={config.eval.engine} is for training only (a recorded run's rollouts); use grouped, hf or vllm")
    if not training:
        return
    need(config.rollout.engine != "replay" or bool(config.rollout.replay_dir), "rollout.replay_dir",
         "is required with rollout.engine=replay (a run recorded with rollout.record=true)")
    need(bool(config.data.train_file), "data.train_file", "is required")
    need(config.rollout.group_size >= 2, "rollout.group_size", "must be >= 2 (advantages compare a group)")
    if config.rollout.tools:
        _validate_tools(config, need)
    need(config.rollout.temperature > 0, "rollout.temperature", "must be > 0 for GRPO sampling")
    need(config.grpo.num_iterations >= 1, "grpo.num_iterations", "must be >= 1")
    for section, build in (("rollout", lambda: config.rollout.to_sampling()),
                           ("grpo", lambda: config.grpo.to_options(config.rollout.max_completion_length,
                                                                   config.rollout.engine))):
        try:  # the options objects validate their own fields; the error names the key
            build()
        except OptionError as error:
            name = OPTION_FIELDS.get(error.field, error.field)
            fields = "|".join(f.name for f in dataclasses.fields(getattr(config, section)))
            message = re.sub(rf"(?<![\w.])({fields})\b", rf"{section}.\1", error.message)  # sibling keys named
            raise ConfigError(f"'{section}.{name}' {message}") from None
    need(config.grpo.dynamic_sampling_max_draws >= 0, "grpo.dynamic_sampling_max_draws", "must be >= 0")
    need("length" not in config.rewards.functions, "rewards.functions",
         "no longer takes 'length': the length bonus is group-aware now, set rewards.length=true")
    need(config.rewards.length_min_tokens <= config.rewards.length_max_tokens, "rewards.length_min_tokens",
         "must be <= rewards.length_max_tokens")
    need(config.train.max_steps >= 1, "train.max_steps", "must be >= 1")
    need(config.train.prompts_per_rank >= 1, "train.prompts_per_rank", "must be >= 1")
    need(config.train.groups_per_micro_batch >= 1, "train.groups_per_micro_batch", "must be >= 1")
    validate_vllm(config)
    sp = config.train.sequence_parallel_size
    need(sp >= 1, "train.sequence_parallel_size", "must be >= 1")
    need(sp == 1 or config.rollout.engine != "vllm", "train.sequence_parallel_size",
         f"={sp} needs rollout.engine grouped or hf (the vLLM engine is not built for it yet)")
    need(sp == 1 or config.forward.grouping == "grouped", "train.sequence_parallel_size",
         f"={sp} needs forward.grouping=grouped (the sequence-parallel forward splits the packed row)")
    need(sp == 1 or config.rollout.engine != "grouped" or config.rollout.zero3_gather == "full", "rollout.zero3_gather",
         f"={config.rollout.zero3_gather} cannot run a rollout spread over a sequence-parallel group (train."
         f"sequence_parallel_size={sp}): under ZeRO-3 it gathers parameters collectively in every forward, while "
         "the group's ranks run different pieces of a family between their own exchanges; use full")
    _validate_shared_video(config, need)
    _validate_routing_replay(config, need)
    _validate_expert_parallel(config, need)
    need(config.train.prompts_per_rank % config.train.groups_per_micro_batch == 0, "train.groups_per_micro_batch",
         f"must divide train.prompts_per_rank ({config.train.prompts_per_rank})")
    need(0 <= config.data.max_skip_fraction <= 1, "data.max_skip_fraction", "must be in [0, 1]")
    need(config.data.min_pixels <= config.data.max_pixels, "data.min_pixels", "must be <= data.max_pixels")
    need(config.data.image_min_pixels <= config.data.image_max_pixels, "data.image_min_pixels",
         "must be <= data.image_max_pixels")
    need(config.rewards.length_min_tokens >= 0, "rewards.length_min_tokens", "must be >= 0")
    need(not config.rewards.length or config.rewards.length_min_tokens <= config.rollout.max_completion_length,
         "rewards.length_min_tokens", f"({config.rewards.length_min_tokens}) is above rollout.max_completion_length "
         f"({config.rollout.max_completion_length}): with rewards.length=true no completion could earn the bonus")
    weights = config.rewards.weights
    need(not weights or len(weights) == len(config.rewards.functions), "rewards.weights",
         f"needs one weight per function ({len(config.rewards.functions)})")
    need(bool(config.rewards.functions), "rewards.functions", "needs at least one reward function")
    need("judge" not in config.rewards.functions or bool(config.rewards.judge_path), "rewards.judge_path",
         "is required when rewards.functions lists judge (a local checkpoint of the judge model)")
    need(not config.rewards.judge_template or "{reference}" in config.rewards.judge_template, "rewards.judge_template",
         "must contain {reference} (where the record's answer goes)")


def _validate_routing_replay(config: Config, need) -> None:
    """rollout.routing_replay=r3: where the record is made and carried so far, refused by name elsewhere."""
    if config.rollout.routing_replay == "off":
        return
    from app.rollout.base import replay_problems

    for problem in replay_problems(engine=config.rollout.engine):
        need(False, "rollout.routing_replay", f"={config.rollout.routing_replay} {problem}")


def _validate_expert_parallel(config: Config, need) -> None:
    """train.expert_parallel_size > 1 (DeepSpeed AutoEP): what the settings alone decide
    (``app.runtime.expert_parallel.problems``, the one rule; the checkpoint, the world and the DeepSpeed JSON are the
    preflight's)."""
    from app.runtime.expert_parallel import problems

    ep = config.train.expert_parallel_size
    for problem in problems(size=ep, sequence_parallel=config.train.sequence_parallel_size, lora_rank=config.lora.rank,
                            lora_targets=config.lora.target_parameters, engine=config.rollout.engine,
                            in_process=config.rollout.engine in IN_PROCESS, tools=bool(config.rollout.tools)):
        need(False, "train.expert_parallel_size", problem if ep < 1 else f"={ep} {problem}")


def validate_vllm_ranges(r: RolloutConfig) -> None:
    """Every rollout.vllm_* value within its range (checked whatever the engine, so a typo never waits for the day
    the engine is switched on)."""
    def need(condition: bool, key: str, message: str) -> None:
        if not condition:
            raise ConfigError(f"'rollout.{key}' {message}")

    need(0 < r.vllm_gpu_memory_utilization <= 1, "vllm_gpu_memory_utilization",
         f"must be in (0, 1] (a fraction of the GPU's memory), got {r.vllm_gpu_memory_utilization}")
    need(r.vllm_cpu_kv_cache_gib > 0, "vllm_cpu_kv_cache_gib", f"must be > 0 (GiB), got {r.vllm_cpu_kv_cache_gib}")
    need(r.vllm_tensor_parallel_size >= 1, "vllm_tensor_parallel_size",
         f"must be >= 1, got {r.vllm_tensor_parallel_size}")
    need(r.vllm_tensor_parallel_size == 1, "vllm_tensor_parallel_size",
         f"={r.vllm_tensor_parallel_size} is not supported: with vLLM's external launcher every rank of a "
         "tensor-parallel group must submit the same prompts, and this engine does not gather them within the group "
         "(each rank would submit its own); use 1 (one engine per rank)")
    need(r.vllm_max_images >= 0, "vllm_max_images", f"must be >= 0, got {r.vllm_max_images}")
    need(r.vllm_max_videos >= 0, "vllm_max_videos", f"must be >= 0, got {r.vllm_max_videos}")


def validate_vllm(config: Config) -> None:
    """Training with rollout.engine=vllm: settings whose numbers would compare different things."""
    r = config.rollout
    if r.engine != "vllm":
        return
    if config.lora.target_parameters:
        raise ConfigError(f"'lora.target_parameters' ({config.lora.target_parameters}) with rollout.engine=vllm: "
                          "the routed experts' merged adapters are not pushed into vLLM yet (its fused-MoE layers "
                          "would keep the base experts); use rollout.engine=grouped")
    filtered = (r.top_p < 1 or r.top_k > 0) and r.temperature != 1.0  # at T=1 vLLM's raw log-probs are unfiltered
    cap = config.grpo.to_options(r.max_completion_length, r.engine).importance_sampling_cap
    if filtered and cap > 0:
        raise ConfigError(
            f"'rollout.top_p'/'rollout.top_k' (top_p={r.top_p}, top_k={r.top_k}) with rollout.engine=vllm at "
            f"rollout.temperature={r.temperature} and truncated importance sampling (grpo.importance_sampling_cap="
            f"{cap}) compare different distributions: at a temperature other than 1 vLLM reports log-probs of the "
            "top-p/top-k filtered distribution, the trainer's are of the whole vocabulary, so the importance weights "
            "would be off. Use top_p=1 and top_k=0, rollout.temperature=1, or grpo.importance_sampling_cap=0 (then "
            "mismatch/* also compares the filtered with the whole)")


def warnings_for(config: Config, training: bool = True) -> list[str]:
    """Settings that run but contradict each other or do nothing: one sentence each, naming the keys."""
    out = []
    c = config
    if training and c.train.stop_at_step > c.train.max_steps:
        out.append(f"train.stop_at_step={c.train.stop_at_step} is past train.max_steps={c.train.max_steps}: the run "
                   f"ends at step {c.train.max_steps}")
    if training and c.train.warmup_steps >= c.train.max_steps:
        out.append(f"train.warmup_steps={c.train.warmup_steps} >= train.max_steps={c.train.max_steps}: the learning "
                   "rate never reaches train.learning_rate")
    if training and c.rewards.length and c.rewards.length_max_tokens > c.rollout.max_completion_length:
        out.append(f"rewards.length_max_tokens={c.rewards.length_max_tokens} is above rollout.max_completion_length="
                   f"{c.rollout.max_completion_length}: the upper bound is never reached")
    if c.model.train_router and c.lora.rank:
        out.append("model.train_router=true has no effect with LoRA (lora.rank > 0): the routers are base weights "
                   "and stay frozen")
    if training and c.grpo.beta == 0 and c.model.reference_path:
        out.append("model.reference_path is set but grpo.beta=0: no reference model is used")
    frozen_tower = c.model.freeze_vision_tower or (c.lora.rank and not c.lora.vision_tower)  # where the cache acts
    if c.rollout.prefill_chunk_size and c.rollout.engine != "grouped":
        out.append(f"rollout.prefill_chunk_size={c.rollout.prefill_chunk_size} is used by rollout.engine=grouped "
                   f"only, not {c.rollout.engine}")
    if training and c.forward.vision_chunk_frames and not frozen_tower:
        out.append(f"forward.vision_chunk_frames={c.forward.vision_chunk_frames} has no effect while the vision tower "
                   "trains (model.freeze_vision_tower=false, no LoRA or lora.vision_tower=true): it runs whole")
    if (training and c.rollout.engine == "vllm" and (c.rollout.top_p < 1 or c.rollout.top_k > 0)
            and c.rollout.temperature != 1.0):
        out.append(f"rollout.top_p={c.rollout.top_p}, top_k={c.rollout.top_k} with rollout.engine=vllm at "
                   f"rollout.temperature={c.rollout.temperature}: vLLM's sampling log-probs are of the filtered "
                   "distribution, so mismatch/* compares it with the trainer's whole-vocabulary log-probs and is not "
                   "0 even when the weights agree")
    k = c.data.questions_per_video
    if training and k > 1 and c.train.groups_per_micro_batch < k:
        out.append(f"data.questions_per_video={k} with train.groups_per_micro_batch={c.train.groups_per_micro_batch}: "
                   "the training forward shares a video only among the questions of one micro-batch (the rollout "
                   f"shares it among the step's); set train.groups_per_micro_batch to a multiple of {k}")
    if not c.lora.rank and (c.lora.vision_tower or c.lora.projector):
        out.append("lora.vision_tower / lora.projector have no effect with lora.rank=0 (no adapters)")
    return out


