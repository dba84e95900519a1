"""Position ids for the packed row: each response gets exactly the ids it has in [P;Ri].

1-D RoPE: prefix 0..p-1, every response p..p+s-1.
M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the prefix ids come from the model's own ``get_rope_index`` on the
(left-padded) prompts; each response continues from the LAST prefix position + 1 on all three axes. ``max + 1`` and
``rope_deltas`` are both wrong with video, whose temporal ids can run past the last text id.
"""

from __future__ import annotations

import torch

from app.grouping.layout import GroupLayout, LayoutError

# Keys of a processor's output that describe the vision inputs of a prompt batch.
VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def rope_index_owner(model):
    """The module that holds ``get_rope_index`` (VL models), or None for 1-D RoPE models."""
    for candidate in (model, getattr(model, "model", None)):
        if candidate is not None and hasattr(candidate, "get_rope_index"):
            return candidate
    return None


def prompt_positions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     mm_inputs: dict | None = None) -> torch.Tensor:
    """Position ids [axes, B, Lp] of left-padded prompts as the model itself computes them (pads get 0..)."""
    owner = rope_index_owner(model)
    if owner is None:
        positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        return positions[None]
    mm_inputs = mm_inputs or {}
    if mm_inputs.get("mm_token_type_ids") is None:
        raise LayoutError(
            "VL prompts need 'mm_token_type_ids' (the processor returns it); without it transformers silently "
            "falls back to 1-D positions"
        )
    kwargs = {k: mm_inputs[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
              if mm_inputs.get(k) is not None}
    positions, _ = owner.get_rope_index(
        input_ids, mm_token_type_ids=mm_inputs["mm_token_type_ids"], attention_mask=attention_mask, **kwargs
    )
    return positions


def packed_positions(layout: GroupLayout, prompt_pos: torch.Tensor) -> torch.Tensor:
    """[axes, B, Lp] prompt positions -> [axes, 1, T] packed positions (responses continue from last prefix + 1)."""
    axes = prompt_pos.shape[0]
    last = prompt_pos[:, :, -1]  # left padding: the last column is each prompt's last real token
    group = torch.tensor(layout.group_of_completion, device=prompt_pos.device)
    steps = torch.arange(1, layout.completion_width + 1, device=prompt_pos.device)
    completion_pos = last[:, group, None] + steps  # [axes, N, Lc]
    per_axis = [layout.pack(prompt_pos[a], completion_pos[a]) for a in range(axes)]
    return torch.stack(per_axis)[:, None, :]


def check_max_positions(positions: torch.Tensor, max_positions: int | None, layout: GroupLayout) -> None:
    if max_positions is None:
        return
    flat = positions.amax(dim=(0, 1))  # [T]
    if int(flat.max()) < max_positions:
        return
    for g, (start, prefix, lens) in enumerate(layout.group_spans):
        end = start + prefix + sum(lens)
        if int(flat[start:end].max()) >= max_positions:
            raise LayoutError(
                f"group {g} reaches position {int(flat[start:end].max())} but the model supports "
                f"max_position_embeddings={max_positions} (prefix {prefix} tokens, longest completion {max(lens)})"
            )
