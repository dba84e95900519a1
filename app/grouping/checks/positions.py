"""The exact half of the self-check: the positions every token is given are integers, so the grouped row and the
repeated rows [P;Ri] must give each completion token the very same ids (M-RoPE's three axes too), at every dtype. A
numeric check in bf16 cannot see a small shift on every family (a quarter of Qwen3.5's head dims rotate, slowly:
a response shifted by one position stays within bf16's noise there); this one sees any shift.

``recorded_positions``: the position ids the text model's rotary embedding receives, per forward, in order (the
repeated forward builds its own from the model's ``get_rope_index``, independently of the packing code);
``position_mismatch``: the first completion token whose ids differ, as a sentence, or None.
"""

from __future__ import annotations

import contextlib

import torch

from app.grouping.modules import unwrap


def _rotary(model):
    inner = unwrap(model)
    body = getattr(inner, "model", inner)
    body = getattr(body, "language_model", body)
    return getattr(body, "rotary_emb", None)


@contextlib.contextmanager
def recorded_positions(model):
    """The position ids of every forward of the block, one [axes, rows, length] tensor each (empty list: a model
    without a text rotary embedding; nothing is checked then)."""
    seen: list[torch.Tensor] = []
    rotary = _rotary(model)
    if rotary is None:
        yield seen
        return

    def record(module, args, kwargs):
        ids = args[1] if len(args) > 1 else kwargs.get("position_ids")
        if ids is not None:
            seen.append(ids.detach().clone() if ids.ndim == 3 else ids.detach()[None].clone())

    handle = rotary.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def position_mismatch(grouped: torch.Tensor, repeated: torch.Tensor, layout, prompt_width: int) -> str | None:
    """``grouped`` [axes, 1, T] (the packed row), ``repeated`` [axes, N, Lp + Lc] (completion n's row, its token j at
    ``prompt_width + j``): the first completion token whose ids differ on any axis, named, or None."""
    axes = min(grouped.shape[0], repeated.shape[0])  # the last axes are the rotary ones
    grouped, repeated = grouped[-axes:], repeated[-axes:]
    for n, (start, length) in enumerate(zip(layout.response_starts, layout.completion_lens)):
        mine = grouped[:, 0, start:start + length]
        theirs = repeated[:, n, prompt_width:prompt_width + length].to(mine.device)
        differ = (mine != theirs).any(0).nonzero()
        if len(differ):
            j = int(differ[0, 0])
            return (f"completion {n}, token {j} has position ids {mine[:, j].tolist()} in the grouped row and "
                    f"{theirs[:, j].tolist()} in its repeated row [P;R{n}]")
    return None
