"""Position ids for the packed row: each response gets exactly the ids it has in [P;Ri].

1-D RoPE: prefix 0..p-1, every response p..p+s-1.
M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the prefix ids come from the model's own ``get_rope_index`` on the
(left-padded) prompts, with every run of text or media starting one past the largest id before it
(``continue_after_media``: Qwen's own code and vLLM do this; transformers 5.x does not after a video); each response
then continues from the prefix's last position + 1 on all three axes (= its largest + 1).
"""

from __future__ import annotations

import inspect
import types

import torch

from app.grouping.layout import GroupLayout, LayoutError
from app.grouping.modules import patch_instance

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
    return continue_after_media(positions, mm_inputs["mm_token_type_ids"], attention_mask)


def continue_after_media(positions: torch.Tensor, mm_token_type_ids: torch.Tensor,
                         attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """M-RoPE ids [axes, B, L] with each run of text, image or video tokens (``mm_token_type_ids``) starting at
    1 + the largest id of any axis before it, as Qwen's released code (``st_idx = llm_pos_ids_list[-1].max() + 1``)
    and vLLM place them.

    transformers 5.x (checked 5.17-5.19) starts the text after a video at the video's start + max(h, w) / merge,
    ignoring how far its temporal ids ran: with Qwen2-VL / Qwen2.5-VL and a video longer than it is wide (temporal
    ids ``t * second_per_grid * tokens_per_second``), the question and the response then reuse the video's ids and
    disagree with generation (``rope_deltas`` = largest + 1) and with vLLM. Images and Qwen3-VL's one-frame slices
    never reach past that, so for them this changes nothing; on ids already placed this way it is the identity.
    Padding (``attention_mask`` 0) is left as it was."""
    out = positions.clone()
    for b in range(positions.shape[1]):
        real = (attention_mask[b].bool().nonzero().flatten() if attention_mask is not None
                else torch.arange(positions.shape[2], device=positions.device))
        if real.numel() < 2:
            continue
        kinds = mm_token_type_ids[b].to(real.device)[real]
        starts = torch.cat([real.new_zeros(1), (kinds[1:] != kinds[:-1]).nonzero().flatten() + 1])
        if starts.numel() == 1:
            continue
        row = positions[:, b, real]  # [axes, n]
        lengths = torch.diff(torch.cat([starts, starts.new_tensor([real.numel()])])).tolist()
        firsts = row[:, starts].amin(0).tolist()
        tops = [int(piece.max()) for piece in torch.split(row, lengths, dim=1)]
        shifts, largest = [0], tops[0]
        for first, top in zip(firsts[1:], tops[1:]):
            shift = largest + 1 - first
            shifts.append(shift)
            largest = max(largest, top + shift)
        if any(shifts):
            shift = torch.repeat_interleave(torch.tensor(shifts, device=row.device), torch.tensor(lengths, device=row.device))
            out[:, b, real] = row + shift
    return out


def use_qwen_positions(model) -> None:
    """Make the model's own ``get_rope_index`` place ids as ``continue_after_media`` does (its ``rope_deltas``
    too), so that HF's forward and ``generate`` agree with the grouped forward, the rollout engines and vLLM.
    Bound to this model instance only (a deep copy keeps it); a no-op for 1-D RoPE models or when already done."""
    owner = rope_index_owner(model)
    if owner is None or getattr(owner.get_rope_index, "continues_after_media", False):
        return
    original = type(owner).get_rope_index
    signature = inspect.signature(original)

    def get_rope_index(self, *args, **kwargs):
        positions, deltas = original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs).arguments
        if bound.get("mm_token_type_ids") is None:
            return positions, deltas
        mask = bound.get("attention_mask")
        fixed = continue_after_media(positions, bound["mm_token_type_ids"], mask)
        if deltas is not None and not torch.equal(fixed, positions):
            grew = [(int(fixed[:, b][:, m].max()) - int(positions[:, b][:, m].max()))
                    for b, m in enumerate(mask.bool() if mask is not None else
                                          torch.ones(positions.shape[1:], dtype=torch.bool, device=positions.device))]
            deltas = deltas + torch.tensor(grew, device=deltas.device, dtype=deltas.dtype).view(deltas.shape[0], -1)
        return fixed, deltas

    get_rope_index.continues_after_media = True
    patch_instance(owner, "get_rope_index", types.MethodType(get_rope_index, owner))


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
