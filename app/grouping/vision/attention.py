"""The vision tower's attention in one call per block, without the flash-attn package.

transformers' Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision attention makes ONE call over the block's ``cu_seqlens``
only when ``"flash" in config._attn_implementation``; otherwise it splits q/k/v by ``cu_seqlens`` and makes one
SDPA call per frame (per window in Qwen2.5-VL's windowed blocks), plus a host sync per block: at an hour of video
that is hundreds of thousands of small calls. ``TOWER_ATTENTION`` is a function registered with transformers under
a name containing "flash", so the tower takes the one-call branch, and it runs torch's own varlen flash kernel
(``app.grouping.kernels.varlen_kernel``) over the block's sequences. Where that kernel cannot run (CPU, float32, an
old card or torch) it computes what the per-chunk loop computes, one SDPA call per sequence.

``model.vision_attention`` (``vision_attention_for``): ``auto`` is this on CUDA in float16/bfloat16 when torch's
kernel runs there (flash-attn's own ``flash_attention_2`` when the package is installed), else ``sdpa``.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from app.grouping.kernels import varlen_kernel, varlen_unusable

TOWER_ATTENTION = "torch_flash_varlen"  # the registered name: "flash" in it makes the tower make one call per block
VISION_ATTENTIONS = ("auto", "sdpa", "eager", "flash_attention_2", TOWER_ATTENTION)  # model.vision_attention
log = logging.getLogger("app.grouping.vision.attention")


def tower_varlen_attention(module, query, key, value, attention_mask=None, *, scaling=None, dropout=0.0,
                           cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
    """transformers' attention interface for the tower's one-call branch: q/k/v [1, H, T, D] over the sequences
    ``cu_seq_lens_q`` (frames or windows, no causal mask) -> ([1, T, H, D], None)."""
    if dropout:
        raise NotImplementedError("the tower's varlen attention has no dropout")
    cu = cu_seq_lens_q.to(device=query.device, dtype=torch.int32)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, H, D) views
    kernel = varlen_kernel(query.device, query.dtype, query.shape[-1], use="the vision tower's attention")
    if kernel is not None:
        longest = int(max_length_q) if max_length_q is not None else int((cu[1:] - cu[:-1]).max())
        out = kernel(q, k, v, (cu, cu, longest, longest), scale=scaling)
    else:  # what the per-chunk branch computes: one SDPA call per sequence
        bounds = cu.tolist()
        out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None],
            scale=scaling)[0].transpose(0, 1) for a, b in zip(bounds[:-1], bounds[1:])])
    return out[None], None


def register_tower_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(TOWER_ATTENTION, tower_varlen_attention)
    return TOWER_ATTENTION


def vision_attention_for(setting: str, dtype: torch.dtype, head_dim: int, device=None) -> tuple[str, str]:
    """(the tower's attention implementation, why) for ``model.vision_attention`` = ``setting`` on ``device``
    (default: CUDA when there is one) in ``dtype``."""
    if setting not in VISION_ATTENTIONS:
        raise ValueError(f"unknown vision attention {setting!r}; expected one of {VISION_ATTENTIONS}")
    if setting != "auto":
        return setting, "as set"
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available()
                                                                          else "cpu")
    if device.type != "cuda":
        return "sdpa", "not on CUDA"
    if _flash_attn_installed() and dtype in (torch.float16, torch.bfloat16):
        return "flash_attention_2", "the flash-attn package is installed"
    reason = varlen_unusable(device, dtype, head_dim)
    if reason:
        return "sdpa", f"torch's varlen flash kernel does not run here: {reason} (one call per frame or window)"
    return TOWER_ATTENTION, "torch's varlen flash kernel (one call per block)"


def _flash_attn_installed() -> bool:
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except ValueError:  # a module without a spec (a stand-in put in sys.modules)
        return True


def use_vision_attention(model, setting: str) -> str:
    """Point ``model``'s vision tower at the attention ``model.vision_attention`` asks for (``auto`` resolved here,
    on the model's dtype and the tower's head dim); returns the name used. A text model is left as it is."""
    config = getattr(model, "config", None)
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return ""
    heads = getattr(vision, "num_heads", None) or vision.num_attention_heads
    width = getattr(vision, "embed_dim", None) or vision.hidden_size
    dtype = next(model.parameters()).dtype
    name, why = vision_attention_for(setting, dtype, width // heads)
    if name == TOWER_ATTENTION:
        register_tower_attention()
    if vision._attn_implementation != name:
        model.set_attn_implementation({"vision_config": name})
    if setting == "auto" and torch.cuda.is_available():
        log.info("vision tower attention: %s (%s)", name, why)
    return name
