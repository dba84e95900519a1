"""A hybrid model's rollout state for its Gated DeltaNet layers: per sequence and per GDN layer, the conv's last
``W - 1`` inputs [N, C, W - 1] and the recurrent state [N, HV, K, V] (float32, as training holds it). That is the
whole prefix, for those layers: a prompt's state is computed once (its prefill) and copied into each of its G
samples' slots (``expanded``), a few MB each, where attention layers need the shared-prefix K/V machinery.

- a prefill's states per prompt are read off transformers' cache (the ordinary or chunked prefill through
  transformers' own GDN forward, which carries the state from chunk to chunk; ``decoding.cache.prompt_states_of``)
  or handed over by a plan that computed them itself (the questions on top of a shared video: ``continue_from``);
- ``RecurrentStates.step``: one decode step of a GDN layer for every sample, the states updated in place (the same
  tensors every step: what a CUDA graph replays and a compiled step reads);
- ``continue_from``: prompts (left-padded) that continue given states (a question on its video's state), run as one
  level of segments (``layer.run_segments``' kernels), returning the output and the new states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.grouping.recurrent.kernels import level_kernels, recurrent_step_rule, rows_of


@dataclass
class RecurrentStates:
    """``layers``: GDN layer index -> (conv tail [N, C, W - 1], recurrent state [N, HV, K, V] float32)."""

    layers: dict

    def __bool__(self) -> bool:
        return bool(self.layers)

    def expanded(self, rows: torch.Tensor) -> RecurrentStates:
        """Row ``rows[i]``'s states in slot i (copies: each sample's own, written in place as it decodes)."""
        return RecurrentStates({i: (conv.index_select(0, rows).contiguous(), state.index_select(0, rows).contiguous())
                                for i, (conv, state) in self.layers.items()})

    def keep(self, rows: torch.Tensor) -> None:
        self.layers = {i: (conv[rows], state[rows]) for i, (conv, state) in self.layers.items()}

    def load(self, other: RecurrentStates, rows: torch.Tensor) -> None:
        """``other``'s rows ``rows`` copied into these buffers (a kept static step's: same shapes and addresses)."""
        for i, (conv, state) in self.layers.items():
            source_conv, source_state = other.layers[i]
            conv.copy_(source_conv.index_select(0, rows))
            state.copy_(source_state.index_select(0, rows))

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for pair in self.layers.values() for x in pair)

    def step(self, module, hidden_states: torch.Tensor, heads: slice | None = None) -> torch.Tensor:
        """One token per sample ([N, 1, hidden]) through GDN layer ``module``, its states updated in place ->
        [N, 1, hidden]. ``heads``: the value heads this rank holds (a spread rollout: ``gather`` brings the other
        ranks' outputs; None: all)."""
        conv, state = self.layers[module.layer_idx]
        mixed = module.in_proj_qkv(hidden_states)  # [N, 1, C]
        channels = None
        if heads is not None:
            channels = heads_channels(module, heads)
            mixed = mixed[..., channels.to(mixed.device)]
        weight = module.conv1d.weight[:, 0]
        weight = weight if channels is None else weight[channels.to(weight.device)]
        window = torch.cat([conv, mixed.transpose(1, 2).to(conv.dtype)], dim=2)  # [N, C', W]
        conv.copy_(window[:, :, 1:])
        x = F.silu(F.conv1d(window.to(weight.dtype), weight[:, None, :], groups=weight.shape[0]))[..., -1]
        x = x.to(hidden_states.dtype)  # [N, C']
        value_heads = module.num_v_heads if heads is None else heads.stop - heads.start
        key_heads = module.num_k_heads * value_heads // module.num_v_heads
        dk, dv = module.head_k_dim, module.head_v_dim
        q, k, v = torch.split(x, [key_heads * dk, key_heads * dk, value_heads * dv], dim=-1)
        repeat = value_heads // key_heads  # each key head read by ``repeat`` value heads (expand: no host sync)
        q = q.reshape(-1, 1, key_heads, 1, dk).expand(-1, 1, key_heads, repeat, dk).reshape(-1, 1, value_heads, dk)
        k = k.reshape(-1, 1, key_heads, 1, dk).expand(-1, 1, key_heads, repeat, dk).reshape(-1, 1, value_heads, dk)
        v = v.reshape(-1, 1, value_heads, dv)
        beta, g = gates(module, hidden_states, heads)
        out, new = recurrent_step_rule(q.device)(q, k, v, g=g, beta=beta, initial_state=state,
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
        state.copy_(new)
        return out  # [N, 1, HV', V]

    def finish(self, module, core: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """The gated norm and output projection of a step's core output [N, 1, HV, V] -> [N, 1, hidden]."""
        return finish_rows(module, core, hidden_states)


def heads_channels(module, heads: slice) -> torch.Tensor:
    """The conv channels (q, k, v) of value heads ``heads`` (a contiguous block; its key heads with it)."""
    ratio = module.num_v_heads // module.num_k_heads
    k_first, k_last = heads.start // ratio, heads.stop // ratio
    dk, dv = module.head_k_dim, module.head_v_dim
    return torch.cat([torch.arange(k_first * dk, k_last * dk),
                      module.key_dim + torch.arange(k_first * dk, k_last * dk),
                      2 * module.key_dim + torch.arange(heads.start * dv, heads.stop * dv)])


def continue_from(module, hidden_states: torch.Tensor, mask: torch.Tensor, start: RecurrentStates,
                  rows: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Left-padded prompts ([B, L, hidden], ``mask`` [B, L] 0/1) each continuing the states of ``start``'s row
    ``rows[b]`` (its conv tail in front, its recurrent state as the initial one) through GDN layer ``module`` ->
    (output [B, L, hidden], 0 at pads; (their conv tails [B, C, W - 1], final states [B, HV, K, V]))."""
    conv_start, state_start = start.layers[module.layer_idx]
    beta, g = gates(module, hidden_states)
    core, states = continue_core(module, module.in_proj_qkv(hidden_states), beta, g, mask,
                                 start=(conv_start.index_select(0, rows), state_start.index_select(0, rows)))
    return finish_rows(module, core, hidden_states) * mask[..., None].to(hidden_states.dtype), states


def gates(module, hidden_states: torch.Tensor, heads: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """beta (sigmoid of b) and g (the log decay, float32) of ``heads`` value heads (all: None), [..., HV']."""
    part = slice(None) if heads is None else heads
    beta = module.in_proj_b(hidden_states)[..., part].sigmoid()
    g = -module.A_log[part].float().exp() * F.softplus(module.in_proj_a(hidden_states)[..., part].float()
                                                      + module.dt_bias[part])
    return beta, g


def finish_rows(module, core: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """The gated norm and output projection: core [B, L, HV, V] -> [B, L, hidden]."""
    dv = module.head_v_dim
    z = module.in_proj_z(hidden_states).reshape(-1, dv)
    return module.out_proj(module.norm(core.reshape(-1, dv), z).reshape(*hidden_states.shape[:2], -1))


def continue_core(module, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, mask: torch.Tensor, *,
                  start: tuple[torch.Tensor, torch.Tensor], heads: slice | None = None):
    """The conv and the delta rule of left-padded rows ([B, L, C'] q|k|v channels of ``heads``, beta and g
    [B, L, HV']) each from its own start (conv tail [B, C', W - 1], state [B, HV', K, V]) -> (core [B, L, HV', V],
    0 at pads; (conv tails [B, C', W - 1], final states float32)). ``heads``: the value heads held here (a spread
    rollout's share; None: all)."""
    from app.grouping.recurrent.segments import ExplicitLevel

    batch, width, _ = mixed.shape
    conv_start, state_start = start
    kernel = module.conv_kernel_size
    lengths = mask.sum(1).tolist()
    tails = conv_start.transpose(1, 2)  # [B, W - 1, C']
    # rows of the level: every token (b * L + j), then every row's tail, then a zero row
    table = torch.cat([mixed.reshape(batch * width, -1), tails.reshape(batch * (kernel - 1), -1).to(mixed.dtype),
                       mixed.new_zeros(1, mixed.shape[-1])])
    tokens = [list(range(b * width + width - n, b * width + width)) for b, n in enumerate(lengths)]
    before = [list(range(batch * width + b * (kernel - 1), batch * width + (b + 1) * (kernel - 1)))
              for b in range(batch)]
    level = ExplicitLevel(tokens, before, pad=table.shape[0] - 1)
    kernels = level_kernels(mixed.device)
    weight = module.conv1d.weight[:, 0]
    value_heads = module.num_v_heads
    if heads is not None:
        weight = weight[heads_channels(module, heads).to(weight.device)]
        value_heads = heads.stop - heads.start
    key_heads = module.num_k_heads * value_heads // module.num_v_heads
    x = kernels.conv(table, level, weight)
    dk, dv = module.head_k_dim, module.head_v_dim
    q, k, v = torch.split(x, [key_heads * dk, key_heads * dk, value_heads * dv], dim=-1)
    repeat = value_heads // key_heads
    q = q.reshape(*q.shape[:-1], key_heads, dk).repeat_interleave(repeat, dim=-2)
    k = k.reshape(*k.shape[:-1], key_heads, dk).repeat_interleave(repeat, dim=-2)
    v = v.reshape(*v.shape[:-1], value_heads, dv)
    zero = lambda t: torch.cat([t.reshape(batch * width, -1),  # noqa: E731
                                t.new_zeros(1 + batch * (kernel - 1), t.shape[-1])])
    out, final = kernels.rule(q, k, v, g=kernels.gather(zero(g), level), beta=kernels.gather(zero(beta), level),
                              initial_state=state_start, index=level)
    where, values = kernels.scatter(out, level)
    core = values.new_zeros(batch * width, value_heads, dv).index_copy(0, where, values)
    # each row's path tail: the last W - 1 inputs of [its start's tail; its tokens]
    path = [before[b] + tokens[b] for b in range(batch)]
    tail_rows = torch.tensor([p[-(kernel - 1):] for p in path], device=table.device)
    conv_tail = rows_of(table, tail_rows).transpose(1, 2).to(conv_start.dtype).contiguous()  # [B, C', W - 1]
    return core.reshape(batch, width, value_heads, dv), (conv_tail, final.float())
