"""A hybrid model's Gated DeltaNet layers in a rollout spread over a sequence-parallel group
(``app.grouping.decoding.spread``): the GDN heads are shared out as the attention heads are, each rank holding its
heads' conv tail and recurrent state.

- ``ulysses_linear``: a prefill piece's GDN layer. Each rank's positions go through one all-to-all that turns them
  into its key and value heads over the whole piece (``layer.head_slices``: rank r holds block r of both), the
  ``core`` callback runs the conv and the delta rule for those heads (continuing the root's state chunk by chunk,
  or each question from its root's), and the inverse all-to-all brings the heads' outputs back to the positions;
- ``RootStates``: a root's states of this rank's heads, carried from chunk to chunk;
- ``spread_step``: a decode step: every rank projects every sample, steps its heads' states in place, and the
  heads' outputs are gathered (one all-gather per layer), as the attention's are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from app.grouping.recurrent.layer import head_slices
from app.grouping.recurrent.state import continue_core, finish_rows


def my_heads(module, sp) -> slice:
    return head_slices(module, sp.rank, sp.size)[1]


def ulysses_linear(module, hidden_states: torch.Tensor, sp, lengths: list[int], core) -> torch.Tensor:
    """hidden [B, t_mine, hidden] (this rank's positions of a piece) -> [B, t_mine, hidden]; ``core(module, mixed,
    beta, g, heads)`` gets the whole piece [B, T, ...] for this rank's heads and returns [B, T, HV', V]."""
    from app.grouping.collectives import exchange

    mixed = module.in_proj_qkv(hidden_states)
    b, a = module.in_proj_b(hidden_states), module.in_proj_a(hidden_states)
    parts = [head_slices(module, r, sp.size) for r in range(sp.size)]
    pieces = [torch.cat([mixed[..., c.to(mixed.device)], b[..., h], a[..., h]], dim=-1) for c, h in parts]
    got = torch.cat(exchange(pieces, lengths, 1, sp), dim=1)  # [B, T, C' + 2 HV']
    heads = parts[sp.rank][1]
    count = heads.stop - heads.start
    width = got.shape[-1] - 2 * count
    beta = got[..., width:width + count].sigmoid()
    g = -module.A_log[heads].float().exp() * torch.nn.functional.softplus(
        got[..., width + count:].float() + module.dt_bias[heads])
    out = core(module, got[..., :width], beta, g, heads)  # [B, T, HV', V]
    back = exchange(list(out.split(lengths, dim=1)), [lengths[sp.rank]] * sp.size, 1, sp)
    return finish_rows(module, torch.cat(back, dim=2), hidden_states)


class RootStates:
    """A root's GDN states of this rank's heads, layer by layer, carried from chunk to chunk."""

    def __init__(self):
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def core(self, module, mixed, beta, g, heads: slice):
        """The root's next chunk (one row, no padding) from its states so far (zeros before the first)."""
        count = heads.stop - heads.start
        start = self.layers.get(module.layer_idx)
        if start is None:
            start = (mixed.new_zeros(1, mixed.shape[-1], module.conv_kernel_size - 1),
                     torch.zeros(1, count, module.head_k_dim, module.head_v_dim, device=mixed.device))
        mask = torch.ones(mixed.shape[:2], dtype=torch.long, device=mixed.device)
        out, self.layers[module.layer_idx] = continue_core(module, mixed, beta, g, mask, start=start, heads=heads)
        return out


def question_core(roots, group_root: torch.Tensor, mask: torch.Tensor, kept: dict):
    """The questions' core callback: each question (left-padded by ``mask``) continues its root's states of this
    rank's heads (``roots``: layer -> (tails [R, C', W - 1], states [R, HV', K, V])); their states after them go
    into ``kept``."""

    def core(module, mixed, beta, g, heads: slice):
        tails, states = roots[module.layer_idx]
        out, kept[module.layer_idx] = continue_core(module, mixed, beta, g, mask, start=(
            tails.index_select(0, group_root), states.index_select(0, group_root)), heads=heads)
        return out

    return core


def spread_step(states, module, hidden_states: torch.Tensor, sp) -> torch.Tensor:
    """One decode step of GDN layer ``module`` for every sample ([N, 1, hidden]), this rank's heads' states
    advanced in place, the heads' outputs gathered -> [N, 1, hidden]."""
    local = states.step(module, hidden_states, heads=my_heads(module, sp))  # [N, 1, HV', V]
    parts = [torch.empty_like(local) for _ in range(sp.size)]
    dist.all_gather(parts, local.contiguous(), group=sp.group)
    return finish_rows(module, torch.cat(parts, dim=2), hidden_states)
