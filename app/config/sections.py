"""The configuration's sections: one dataclass per YAML section, every field with its default, its help string and,
where it has them, its choices (each list taken from the module that defines the choice). Loading, overrides and
the generated reference are ``app.config.loading``; the checks across keys are ``app.config.checks``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from app.config.evaluation import EvalConfig
from app.config.fields import ConfigError, _f
from app.config.model import LoRAConfig, ModelConfig

# Every choice list comes from the module that defines the choice (one source of truth).
from app.data.prompts import PROMPT_TEMPLATES
from app.data.video import FRAME_FOLDER_SAMPLING
from app.grouping import BACKENDS, DECODE_MODES, DEFAULT_CHUNK_SIZE, MODES
from app.grouping.vision.cache import VISION_CACHE_SETTINGS
from app.objectives.grpo import (
    DYNAMIC_SAMPLING_METRICS,
    KL_ESTIMATORS,
    LOSS_TYPE_SETTINGS,
    POLICY_LOSSES,
    SCALE_REWARDS_SETTINGS,
    LossOptions,
    objective_settings,
)
from app.rewards.rules import BONUS_RULES, REGRESSION_METRICS
from app.rollout.base import SPLIT_SETTINGS
from app.rollout.generate import SamplingConfig
from app.rollout.registry import ENGINE_NAMES
from app.runtime.zero import GATHER_MODES

__all__ = ["SECTIONS", "Config", "ConfigError", "EvalConfig", "LoRAConfig", "ModelConfig"]


@dataclass
class DataConfig:
    train_file: str = _f("", "JSON or JSONL file in Video-R1's schema.")
    data_root: str = _f("", "Directory that record `path`s are relative to; empty means the train file's folder.")
    confine_to_root: bool = _f(True, "Skip (with a reason) records whose path leaves data_root (absolute, or `..`). "
                               "Symbolic links inside the root are followed.")
    fps: float = _f(2.0, "Frames per second sampled from each video.")
    max_frames: int = _f(16, "Upper bound on sampled frames per video.")
    frame_folder_fps: float = _f(3.0, "Frame rate of frame-folder videos (a directory of images, as MVBench and TVQA "
                                 "ship) whose record has no `fps` field; frames are sampled from it at data.fps.")
    frame_folder_sampling: str = _f("fps", "Which frames of a frame-folder video are used: fps samples at data.fps "
                                    "(data.frame_folder_fps, data.max_frames); videochat_r1_track takes VideoChat-R1's "
                                    "tracking frames (first, 5 spaced, last, the last twice: 8; each sized as an image, read as 2 fps), "
                                    "as its GOT-10k evaluation does.", choices=tuple(FRAME_FOLDER_SAMPLING))
    min_pixels: int = _f(3136, "Lower bound on pixels per video frame (always passed with max_pixels).")
    max_pixels: int = _f(100352, "Upper bound on pixels per video frame.")
    video_total_pixels: int = _f(0, "A pixel budget for a whole video instead of data.max_pixels per frame: "
                                 "qwen-vl-utils caps each frame at total / frames x 2 (TimeZero's evaluation: "
                                 "3584 x 28 x 28). 0: every frame gets data.max_pixels, whatever the video's length "
                                 "(qwen-vl-utils' own budget, MODEL_SEQ_LEN x 28^2 x 0.9, is not applied).")
    image_min_pixels: int = _f(3136, "Lower bound on pixels per image.")
    image_max_pixels: int = _f(401408, "Upper bound on pixels per image.")
    max_prompt_length: int = _f(16384, "Prompts longer than this (tokens, video included) are dropped, never cut.")
    max_skip_fraction: float = _f(0.1, "Fail when more than this fraction of records is unusable.")
    prompt_template: str = _f("video_r1", "Question template: video_r1 reproduces Video-R1's prompt exactly (what its "
                              "checkpoints were trained on); video_r1_eval its evaluation script's; timezero_grounding "
                              "TimeZero's temporal-grounding evaluation prompt (text before the video, no per-type "
                              "instruction); videochat_r1_track and videochat_r1_gqa VideoChat-R1's GOT-10k and "
                              "NExT-GQA prompts (they read record fields: object and initial_box; problem and "
                              "options); vlm_r1_rec VLM-R1's referring-expression prompt; prefix_grpo is this "
                              "project's first template.",
                              choices=tuple(PROMPT_TEMPLATES))
    system_prompt: str = _f("template", "System message: 'template' uses the template's own (video_r1: none, so the "
                            "chat template's default 'You are a helpful assistant.'; prefix_grpo: its "
                            "think/answer instruction); '' for none; any other text is used as is.")
    shuffle: bool = _f(True, "Shuffle the records each epoch (seeded by train.seed).")
    prefetch: int = _f(1, "Steps of prompts (video decoding and processor work) prepared in background threads while "
                       "the current step trains; 0: decode on the critical path. Order, skips and resume unchanged.")
    prefetch_workers: int = _f(2, "Background threads for data.prefetch.")
    decode_threads: int = _f(0, "Threads decoding one video file, each a piece of its frames cut at keyframes (the "
                             "pixels are bitwise those of one thread). 0: what the host allows per video: its cores "
                             "/ the node's ranks / data.prefetch_workers, at least 1 (written in the run log).")
    decode_shares: bool = _f(True, "train.sequence_parallel_size > 1 with rollout.engine=grouped: each rank decodes "
                             "and processes only its share of each video file (its contiguous frames, read from the "
                             "keyframe before them); the prompt, its grid and its tokens stay the whole video's. A "
                             "step whose rollout keeps whole families on one rank gathers them from the group. Off "
                             "(or rollout.sp_split=families, or rollout.record): every rank decodes whole videos.")
    questions_per_video: int = _f(1, "k > 1: questions on one video (or image) come as runs of up to k prompts: "
                                  "decoded, prefilled and packed once per micro-batch; same numbers, groups stay "
                                  "questions (docs/shared_video.md: what k trades). 1: as always.")


@dataclass
class RolloutConfig:
    engine: str = _f("grouped", "grouped: one prefill per prompt (shared prefix); hf: plain HF generate on the "
                     "repeated batch, for A/B; vllm: a vLLM engine colocated in each training process (n = G with "
                     "prefix caching), fed the trainer's exact prompts and media, given the policy's weights after "
                     "every optimizer step; replay: the rollouts of a run recorded with rollout.record=true "
                     "(rollout.replay_dir), so an A/B varies only the training. The training forward follows "
                     "forward.grouping whatever the engine.", choices=ENGINE_NAMES)
    vllm_gpu_memory_utilization: float = _f(0.3, "rollout.engine=vllm on a GPU: the fraction of GPU memory vLLM "
                                            "takes (weights + KV cache); the rest is the trainer's.")
    vllm_sleep: bool = _f(True, "rollout.engine=vllm on a GPU: put vLLM to sleep between rollouts (its KV cache "
                          "freed; its weights discarded when all of them train, since every one is pushed again "
                          "before the next rollout, else kept on the host) so the policy update has the memory back.")
    vllm_cpu_kv_cache_gib: float = _f(1.0, "rollout.engine=vllm on a CPU: vLLM's KV cache in GiB (vLLM's CPU worker "
                                      "otherwise reserves 0.92 of a NUMA node's memory, and a second rank's engine "
                                      "on the same node cannot start). It must hold one prompt plus its completions.")
    vllm_tensor_parallel_size: int = _f(1, "rollout.engine=vllm: GPUs one vLLM engine spans. Only 1 is built: with "
                                        "vLLM's external launcher every rank of a tensor-parallel group must submit "
                                        "the same prompts, and this engine does not gather them within the group.")
    vllm_max_images: int = _f(1, "rollout.engine=vllm: the most images one prompt may hold (reserved by vLLM).")
    vllm_max_videos: int = _f(1, "rollout.engine=vllm: the most videos one prompt may hold.")
    group_size: int = _f(8, "Completions sampled per prompt (G).")
    temperature: float = _f(1.0, "Sampling temperature.")
    top_p: float = _f(1.0, "Nucleus sampling threshold.")
    top_k: int = _f(0, "Top-k filter; 0 disables it.")
    max_completion_length: int = _f(768, "Maximum new tokens per completion.")
    stop_strings: list = _f([], "Extra strings that end a completion (EOS always does).")
    record: bool = _f(False, "Write every prompt's rollout to train.output_dir/rollouts, named by the prompt's "
                      "identity (its tokens and media hashed, with the group size) and the epoch it was drawn in, "
                      "for a later run with rollout.engine=replay.")
    replay_dir: str = _f("", "rollout.engine=replay: a recorded run's train.output_dir (or its rollouts folder). Each "
                         "prompt gets the completions recorded for the very same prompt, whatever the order it comes "
                         "in (another data.questions_per_video, train.prompts_per_rank or shuffle); a prompt the "
                         "record lacks stops the run with its name.")
    prefill_chunk_size: int = _f(0, "rollout.engine=grouped: prompt positions per decoder call in the prefill "
                                 "(chunked prefill): each call attends to the K/V of the positions before it, so a "
                                 "long video's prefill holds one chunk's activations, not the prompt's; the prompt's "
                                 "K/V is kept whole. Same samples up to float summation order. 0: the whole prompt "
                                 "batch in one call. Pair with forward.vision_chunk_frames for long videos.")
    tools: list = _f([], "Multi-turn rollouts with tools (app/rollout/tools.py): built-ins get_frames (a window of the "
                     "record's video) and zoom (one frame, cropped), or path/to/file.py:function. Non-empty: the model "
                     "may write <tool_call>{...}</tool_call>, the tool's result comes back as the next turn, and each "
                     "group is trained as a prefix tree (app/training/agent.py). Engines grouped and hf.")
    max_turns: int = _f(3, "With rollout.tools: model turns per rollout (a call at the last turn ends it).")
    max_total_tokens: int = _f(4096, "With rollout.tools: tokens of a rollout after its prompt (model turns and "
                               "observations); each turn samples at most rollout.max_completion_length.")
    branching: list = _f([], "With rollout.tools: samples per open node at each turn, e.g. [4, 2]: 4 first turns, "
                         "each continued twice (siblings share their parent's tokens); the product must be "
                         "rollout.group_size. Empty: [group_size] (plain multi-turn GRPO).")
    tool_max_frames: int = _f(8, "get_frames: the most frames one call decodes.")
    tool_max_pixels: int = _f(50176, "get_frames: pixels per frame at most (min: data.min_pixels).")
    tool_zoom_max_pixels: int = _f(200704, "zoom: pixels of the cropped frame at most.")
    decode: str = _f("auto", "rollout.engine=grouped: the decode step. auto: on CUDA a static-shape step (own K/V "
                     "in fixed buffers, finished samples stepping on masked) captured as a CUDA graph once per shape "
                     "bucket of the run (prompts' K/V capacity rounded up to 512 positions) and replayed in every "
                     "later rollout, eager steps on CPU and wherever DeepSpeed's hooks gather parameters during the "
                     "rollout (ZeRO-3 with zero3_gather layerwise or per_step); graph: that, or an error where it "
                     "cannot run; compiled: the static step through torch.compile first (norms, rotary, activations "
                     "and adds fused), compiled once per bucket, then captured on CUDA (not yet measured on a GPU, "
                     "so not the default); static: the static step uncompiled and uncaptured; eager: steps whose "
                     "batch shrinks as samples finish. Same samples in every mode, log-probs to float rounding.",
                     choices=DECODE_MODES)
    routing_replay: str = _f("off", "Mixture-of-experts models: r3 records the experts every token went to as the "
                             "grouped engine samples it (each prompt once, each completion token at its step) and "
                             "routes the old-policy, reference and policy forwards through them, the gate weights "
                             "recomputed from the current router (Rollout Routing Replay, arXiv 2510.11370; Megatron "
                             "#4168 saw GRPO on MoE collapse without it). off: every forward routes afresh. Off by "
                             "default as it is new here; the MoE configs turn it on. rollout.engine=grouped only.",
                             choices=("off", "r3"))
    zero3_gather: str = _f("full", "ZeRO-3 only: full gathers the policy's (and reference's) parameters once per "
                           "rollout and decodes with no collectives (fastest, needs the whole model in memory); "
                           "layerwise gathers all but the decoder layers once and each layer (one collective) when it "
                           "runs; per_step leaves DeepSpeed's hooks on: every module re-gathered at every decode "
                           "step (slowest, least memory).", choices=GATHER_MODES)

    sp_split: str = _f("auto", "train.sequence_parallel_size > 1, rollout.engine=grouped: how a sequence-parallel "
                       "group shares its rollout. spread: every rank samples every prompt, with 1/S of each "
                       "video's tower, prefill and K/V, but each decode step's linear layers on every rank; "
                       "families: whole families of questions (or prompts) per rank, a rank left without one "
                       "idle; auto: whichever the planner prices faster for the step's prompt lengths (a long "
                       "video spreads, a short one stays whole), said in the run log when it changes. Same tokens "
                       "either way.", choices=SPLIT_SETTINGS)

    def to_sampling(self, seed: int | None = None) -> SamplingConfig:
        """The sampler's settings (validated there)."""
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_completion_length, stop_strings=tuple(self.stop_strings),
                              seed=seed)


@dataclass
class ForwardConfig:
    grouping: str = _f("grouped", "grouped: one packed row per batch of groups (Prefix Grouper); repeated: the "
                       "ordinary [P;Ri] batch, for A/B. Used by GRPO (policy, old, reference), SFT and the "
                       "self-check.", choices=MODES)
    attention_backend: str = _f("auto", "Grouped attention backend: auto (split on CPU; flash-attn, else flex on "
                                f"GPU) or one of {', '.join(BACKENDS)}. Prefix trees (rollout.tools) use their own: "
                                "the dense tree mask, or with split (CPU) sibling sets, with flex a block mask from "
                                "the trees' node intervals (neither builds a [T, T] mask; flex's backward needs CUDA).",
                                choices=("auto", *BACKENDS))
    self_check: bool = _f(True, "On the first step, compare grouped and repeated log-probs and stop on a mismatch.")
    logprob_chunk_size: int = _f(DEFAULT_CHUNK_SIZE, "Tokens per chunk when the output head computes the completion "
                                 "log-probs (policy, old, reference; both groupings): [tokens, vocab] logits are never "
                                 "held whole, backward recomputes each chunk; same numbers. 0: full logits (the "
                                 "transformers default; at vocab 151,936 and 6k tokens that is 3.7 GB of float32).")
    vision_cache: str = _f("step", "step: when the vision tower is frozen (model.freeze_vision_tower, or LoRA without "
                           "lora.vision_tower), each image/video is encoded once per step and the rollout, reference, "
                           "old-policy and policy forwards reuse it: the same numbers bitwise. With the projector "
                           "training, what the projector reads is cached and it still trains. run: kept across steps "
                           "too (Long-RL's cached embeddings), keyed by the item's pixels, the least recently used "
                           "dropped past forward.vision_cache_gib. off: every forward runs the tower. No effect when "
                           "the tower trains. The counts are logged as vision/*.", choices=VISION_CACHE_SETTINGS)
    vision_cache_gib: float = _f(4.0, "forward.vision_cache=run: GiB of tower outputs kept between steps, at most.")
    vision_chunk_frames: int = _f(0, "Temporal patches (temporal_patch_size frames each: 2 in Qwen-VL) per vision-"
                                  "tower pass while the tower runs without gradient (frozen: model."
                                  "freeze_vision_tower, or LoRA without lora.vision_tower), in every forward and the "
                                  "rollout's prefill: a long video's tower activations are one chunk's. Exact: "
                                  "Qwen's vision attention never crosses a temporal patch. 0: an item in one pass. "
                                  "A tower that trains runs whole.")

    @property
    def backend(self) -> str | None:
        """The backend to ask for; None lets grouping choose for the device."""
        return None if self.attention_backend == "auto" else self.attention_backend


@dataclass
class GRPOConfig:
    beta: float = _f(0.04, "KL coefficient. 0 loads no reference model.")
    kl_estimator: str = _f("k3", "Per-token KL penalty: k3 (GRPO/TRL/Video-R1; its gradient follows KL(ref||pi)), "
                           "low_var_kl (k3 clamped, verl), k1 (log pi - log ref; zero expected gradient).",
                           choices=KL_ESTIMATORS)
    epsilon_low: float = _f(-1.0, "Lower clip of the importance ratio (1 - eps_low). -1 (default): the selected "
                            "policy_loss's source value: 0.2 for clip (GRPO) and sapo, 3e-4 for gspo and gspo_token "
                            "(GSPO's paper), 1.0 for cispo (no lower bound on its weight, as MiniMax-M1).")
    epsilon_high: float = _f(-1.0, "Upper clip of the importance ratio (1 + eps_high); DAPO uses 0.28. -1 (default): "
                             "the selected policy_loss's source value: 0.2 for clip and sapo, 4e-4 for gspo and "
                             "gspo_token, 4.0 for cispo (its weight capped at 5, as TRL recommends for CISPO).")
    delta: float = _f(0.0, "Two-sided clipping (TRL `delta`, INTELLECT-2): for negative advantages the ratio is "
                      "capped at delta too; 0 disables. Must exceed 1 + epsilon_high.")
    loss_type: str = _f("auto", "grpo: mean over each completion's tokens, then over completions (DeepSeekMath); "
                        "bnpo: mean over each micro-batch's tokens (TRL); dapo: mean over ALL tokens of the step, "
                        "across micro-batches and ranks (DAPO); dr_grpo: sum over tokens / "
                        "rollout.max_completion_length (Dr. GRPO). auto (default): the selected policy_loss's "
                        "source: dapo for cispo (MiniMax-M1 normalises over all tokens), grpo otherwise.",
                        choices=LOSS_TYPE_SETTINGS)
    scale_rewards: str = _f("auto", "Divide centred rewards by the group's std (group: GRPO), the whole step's std "
                            "over all ranks (batch), or not at all (none: Dr. GRPO). auto: none under "
                            "loss_type=dr_grpo, group otherwise.", choices=SCALE_REWARDS_SETTINGS)
    mask_truncated_completions: bool = _f(False, "Completions cut by rollout.max_completion_length carry no loss "
                                          "(DAPO's overlong filtering; TRL).")
    importance_sampling_cap: float = _f(-1.0, "Truncated importance sampling: weight each token's loss by "
                                        "min(pi_train / pi_rollout, cap) using the rollout's own sampling "
                                        "log-probs (TRL/verl TIS); 0 disables; -1 (default): 2.0 with "
                                        "rollout.engine=vllm (another engine samples: TRL's default), off "
                                        "otherwise. The mismatch is logged either way.")
    dynamic_sampling: bool = _f(False, "Drop groups whose dynamic_sampling_metric is the same for every completion "
                                "(all correct / all wrong: zero advantage) and draw more prompts until the step "
                                "has train.prompts_per_rank groups per rank (DAPO, EasyR1).")
    dynamic_sampling_metric: str = _f("accuracy", "What must vary within a kept group: accuracy (DAPO) or reward "
                                      "(the total reward).", choices=DYNAMIC_SAMPLING_METRICS)
    dynamic_sampling_max_draws: int = _f(4, "Extra prompt batches a step may draw; when still short, the step is "
                                         "filled with dropped groups (warned and counted).")
    num_iterations: int = _f(1, "Policy updates per rollout batch (mu); >1 uses old log-probs.")
    policy_loss: str = _f("clip", "The per-token objective: clip (PPO/GRPO: the token ratio clipped to [1-epsilon_low, "
                          "1+epsilon_high]); gspo (GSPO: one ratio per sequence, the geometric mean of its token "
                          "ratios, clipped; needs loss_type=grpo); gspo_token (its token variant: the sequence "
                          "ratio's value, each token's own gradient); cispo (CISPO, MiniMax-M1: the clipped token "
                          "ratio as a detached weight on log pi, so no token loses its gradient); sapo (SAPO: a soft "
                          "sigmoid gate instead of the clip, temperatures sapo_tau_pos / sapo_tau_neg). Selecting one "
                          "gives epsilon_low, epsilon_high and loss_type its source's values unless they are set. "
                          "docs/grpo.md has the equations and sources.", choices=POLICY_LOSSES)
    sapo_tau_pos: float = _f(1.0, "policy_loss=sapo: gate temperature for positive advantages (SAPO's: 1.0).")
    sapo_tau_neg: float = _f(1.05, "policy_loss=sapo: gate temperature for negative advantages (SAPO's default "
                             "1.05: a faster decay, so negative updates stay closer to the old policy).")
    router_aux_loss_coef: float = _f(0.0, "Mixture-of-experts models: the weight of the routers' load-balancing loss "
                                     "(Switch Transformer's, as transformers computes it) added to the GRPO loss, "
                                     "over the step's logical tokens (a prompt token shared by G responses counts G "
                                     "times, as in the repeated layout), however the step is packed or cut into "
                                     "micro-batches; above 0 it costs one no-gradient forward per micro-batch. "
                                     "0 (default, as verl's Qwen3.5 "
                                     "recipes and unsloth; TRL's GRPO uses 0.001, the checkpoints' pretraining "
                                     "value): the routers' load, entropy and this loss are still logged as "
                                     "router/*. docs/grpo.md has the sources.")

    def to_options(self, max_completion_length: int, engine: str = "grouped") -> LossOptions:
        """The loss's settings (validated there, once)."""
        cap = self.importance_sampling_cap
        if cap == -1:
            cap = VLLM_DEFAULT_IS_CAP if engine == "vllm" else 0.0
        low, high, loss_type = objective_settings(self.policy_loss, self.epsilon_low, self.epsilon_high,
                                                  self.loss_type)
        return LossOptions(loss_type=loss_type, beta=self.beta, epsilon_low=low, epsilon_high=high, delta=self.delta,
                           kl_estimator=self.kl_estimator, max_completion_length=max_completion_length,
                           importance_sampling_cap=cap, mask_truncated_completions=self.mask_truncated_completions,
                           policy_loss=self.policy_loss, sapo_tau_pos=self.sapo_tau_pos, sapo_tau_neg=self.sapo_tau_neg)


@dataclass
class RewardConfig:
    functions: list = _f(["format", "accuracy"], "Reward functions: format, accuracy, or path/to/file.py:function "
                         "for a custom one (called as fn(completions, records)).")
    weights: list = _f([], "One weight per function; empty means all 1.")
    judge_path: str = _f("", "rewards.functions entry judge: a local Qwen-VL checkpoint that scores each "
                         "completion's answer against the reference, the G completions of a group judged in one "
                         "grouped forward (the question and video once); partitioned like the reference model under "
                         "ZeRO-3.")
    judge_verdict: str = _f("yes", "What the judge's reward is: yes (its probability of 'yes') or score (its expected "
                            "digit 0-9 over 9, read from its distribution over the digits at the answer position, "
                            "renormalised; no generation).", choices=("yes", "score"))
    judge_template: str = _f("", "The judge's verdict question, asked after each completion; {reference} is the "
                             "record's answer. Empty: 'Is the answer above correct? The reference answer is: "
                             "{reference}. Reply with yes or no.' (yes) or 'How correct is the answer above? The "
                             "reference answer is: {reference}. Reply with one digit from 0 (wrong) to 9 (fully "
                             "correct).' (score).")
    tool_call_cost: float = _f(0.0, "With rollout.tools: subtracted from a rollout's reward per tool call it made.")
    valid_call_bonus: float = _f(0.0, "With rollout.tools: added to a rollout's reward when at least one of its tool "
                                 "calls was valid (it ran).")
    length: bool = _f(False, "Length bonus (Video-R1's len_control): correct completions with length_min_tokens..."
                      "length_max_tokens completion tokens earn length_bonus, when more than one completion of the "
                      "group is correct.")
    length_min_tokens: int = _f(320, "Length bonus: lower bound of the rewarded completion length (tokens).")
    length_max_tokens: int = _f(512, "Length bonus: upper bound of the rewarded completion length (tokens).")
    length_bonus: float = _f(0.2, "Length bonus added to correct completions inside the bounds.")
    temporal: bool = _f(False, "Temporal GRPO (Video-R1): a second group on shuffled frames; correct completions "
                        "earn temporal_alpha when ordered accuracy >= temporal_ratio x shuffled accuracy.")
    temporal_alpha: float = _f(0.3, "Temporal GRPO bonus.")
    temporal_ratio: float = _f(0.8, "Temporal GRPO margin.")
    regression: str = _f("relative_error", "Accuracy of regression answers during training: relative_error is "
                         "Video-R1's training reward 1 - min(1, |pred - truth| / |truth|) (smooth, 0.8 for 20% off); "
                         "mra is VSI-Bench's mean relative accuracy (a step function). Evaluation always reports MRA.",
                         choices=tuple(REGRESSION_METRICS))
    bonus_rules: str = _f("video_r1", "When the length and temporal bonuses apply. video_r1: exactly Video-R1's "
                          "(correct = accuracy > 0.1; temporal when ordered >= ratio x shuffled). strict: correct "
                          "= accuracy > 0.5 and temporal only when ordered > ratio x shuffled, so partial free-form "
                          "matches and equal accuracies earn nothing.", choices=tuple(BONUS_RULES))


@dataclass
class SFTConfig:
    max_target_length: int = _f(768, "SFT: targets longer than this (tokens, <|im_end|> included) are skipped with "
                                "their reason, never cut.")
    without_process: str = _f("skip", "SFT: a record whose `process` (chain of thought) is missing or empty. skip: "
                              "skipped with that reason; answer_only: trained on its solution alone.",
                              choices=("skip", "answer_only"))


@dataclass
class TrainConfig:
    output_dir: str = _f("outputs/run", "Where checkpoints, metrics and the final export go.")
    seed: int = _f(0, "Seed for data order, sampling and initialisation.")
    max_steps: int = _f(100, "Optimizer steps (each on a fresh rollout batch when num_iterations is 1).")
    stop_at_step: int = _f(0, "End the run after this step (saved and exported as at the end) while the schedule "
                           "still spans max_steps: the first N steps of a longer run, e.g. for an A/B. 0: max_steps.")
    prompts_per_rank: int = _f(1, "Prompts (groups) each rank takes per step; a group never spans ranks.")
    groups_per_micro_batch: int = _f(1, "Groups per forward/backward; the rest is gradient accumulation.")
    sequence_parallel_size: int = _f(1, "S: ranks that share each packed row [P;R1..RG] for long videos "
                                     "(Ulysses attention over the grouped layout, the vision tower split by frames); "
                                     "S consecutive ranks form one data-parallel replica, so the world must be a "
                                     "multiple of S and prompts_per_rank counts per replica. Query heads (and KV "
                                     "heads, or S a multiple of them) must divide by S. GRPO with "
                                     "rollout.engine=grouped/hf and forward.grouping=grouped only; the vision cache "
                                     "is off under it. 1: off.")
    expert_parallel_size: int = _f(1, "EP: mixture-of-experts models (Qwen3-VL-MoE, Qwen3.5-MoE) only: each sparse "
                                   "layer's routed experts split over EP ranks (DeepSpeed AutoEP), each token sent to "
                                   "its experts' ranks by an all-to-all, so a ZeRO-3 forward gathers E / EP experts "
                                   "of a layer instead of all E (the rest of the model stays ZeRO-3). EP must divide "
                                   "the world and the experts per layer; ZeRO-3 and full weights only (AutoEP cannot "
                                   "checkpoint LoRA's frozen experts); not with sequence parallelism, "
                                   "rollout.engine=vllm or rollout.tools. Rollouts step in lock step across ranks. "
                                   "1: off.")
    learning_rate: float = _f(1e-6, "Peak learning rate (AdamW).")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    warmup_steps: int = _f(0, "Linear warmup steps before the cosine decay.")
    min_lr_ratio: float = _f(0.0, "Cosine decays to learning_rate x this.")
    max_grad_norm: float = _f(1.0, "Gradient clipping (0 disables).")
    deepspeed_config: str = _f("deepspeed_configs/zero3.json", "DeepSpeed JSON (ZeRO stage, offload).")
    save_every: int = _f(50, "Checkpoint every N steps (and at the end); 0 saves only at the end.")
    keep_checkpoints: int = _f(2, "How many recent checkpoints to keep.")
    resume: bool = _f(False, "Continue from the latest checkpoint in output_dir (same data order and steps). The "
                      "checkpoint's fingerprint must match this run's: the settings that define the data order and "
                      "the objective, the data file's content and the model (docs/grpo.md, Resume).")
    resume_if_different: str = _f("stop", "train.resume=true when the checkpoint was written with other data, model "
                                  "or settings that define the data order or the objective: stop (name each "
                                  "difference) or continue (resume anyway, on purpose; each difference is logged).",
                                  choices=("stop", "continue"))
    export_hf: bool = _f(True, "Write the final model + processor in Hugging Face format to output_dir/final.")
    collective_timeout_s: float = _f(1800.0, "Seconds a collective (a ZeRO-3 gather, an all-reduce) may wait for the "
                                     "other ranks before the run stops with a message naming the operation and the "
                                     "rank (the process group's timeout; DeepSpeed's own default is 600 s, too short "
                                     "for a rank that waits while another rolls out an hour of video). A rank that "
                                     "waits on a collective the others never join never hangs silently.")


@dataclass
class LoggingConfig:
    wandb_mode: str = _f("offline", "wandb mode: online, offline or disabled.", choices=("online", "offline", "disabled"))
    project: str = _f("prefix-grpo", "wandb project.")
    run_name: str = _f("", "wandb run name; empty lets wandb choose.")
    tags: list = _f([], "wandb tags.")
    log_every: int = _f(1, "Log metrics every N steps.")
    sample_table_every: int = _f(10, "Log a table of sample completions every N steps (0 disables).")
    progress_bar: bool = _f(True, "Show a progress bar on rank 0.")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    forward: ForwardConfig = field(default_factory=ForwardConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
VLLM_DEFAULT_IS_CAP = 2.0  # grpo.importance_sampling_cap=-1 with rollout.engine=vllm (TRL's default cap)
