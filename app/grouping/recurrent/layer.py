"""Gated DeltaNet (Qwen3.5's linear-attention layers) in a packed row: each segment continues its parent's state.

transformers runs one GDN recurrence (and one causal conv) over a whole row, so in [P; R1; R2] R2 would continue
R1's state and its conv window would read R1's last tokens. Here each layer's ``forward`` is replaced on the
instance (the class and other models keep theirs) by one that, when a training plan arrives in the forward
kwargs (``attention.PLAN_KWARG``, as it reaches the attention layers), runs the layer segment by segment
(``segments.segments_of``): by depth, every segment of a level in one kernel call, each from its parent's final
recurrent state and with its path's last ``W - 1`` inputs in front of its conv (``kernels``). A prompt's GDN runs
once; its state goes to every continuation and receives the sum of their gradients. Without a plan (the repeated
layout, ``generate``, SFT) the class's forward runs. A plan that carries recurrent state (the rollout's cache, a
prefill chunk, the questions on a shared video) answers ``linear_attention(module, hidden_states, cache_params=,
original=)`` itself (``original``: the class's forward, bound).

Under sequence parallelism (a plan with ``sp`` and ``bounds``: Ulysses) the row's shards go through one
all-to-all that turns them into head shards (the heads are independent and the conv is per channel): every rank
runs the layer over the WHOLE row for its 1/S of the key and value heads, with the segment rules above, and the
inverse all-to-all brings the output back to its shard. S must divide the key heads and the value heads
(``sequence_parallel.check_heads``).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from app.grouping.recurrent.kernels import level_kernels, use_accurate_fallback
from app.grouping.recurrent.segments import segments_of, sequence_shard

MARK = "_prefix_grouping_gdn"


def is_linear_attention(module) -> bool:
    """A Gated DeltaNet layer (transformers' ``Qwen3_5GatedDeltaNet`` and its kin): what this module knows how to
    run in a packed row."""
    return type(module).__name__.endswith("GatedDeltaNet") and hasattr(module, "in_proj_qkv")


def linear_attention_layers(model) -> list:
    return [m for m in model.modules() if is_linear_attention(m)]


def install(model, plan_kwarg: str) -> int:
    """Replace the ``forward`` of every GDN layer of ``model`` (once; idempotent) with one that reads a plan from
    ``plan_kwarg``. Returns how many layers the model has. Set on the instance with ``object.__setattr__``, as
    ``modules.patch_instance`` does: hooks around the class's ``__call__`` (ZeRO-3's gathering) still run."""
    layers = linear_attention_layers(model)
    for layer in layers:
        use_accurate_fallback(layer)  # ordinary batches run the same torch kernel as the grouped row
        if getattr(layer, MARK, False):
            continue
        original = type(layer).forward  # unbound: a deep copy of the model calls its own layer's class forward

        def forward(self, hidden_states, cache_params=None, attention_mask=None, _original=original, **kwargs):
            plan = kwargs.get(plan_kwarg)
            if plan is None:
                return _original(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask,
                                 **kwargs)
            own = getattr(plan, "linear_attention", None)
            if own is not None:  # a plan that keeps its own state (a decode step, a prefill chunk, a question)
                return own(self, hidden_states, cache_params=cache_params, original=_original.__get__(self))
            return grouped_linear_attention(self, hidden_states, plan)

        object.__setattr__(layer, "forward", types.MethodType(forward, layer))
        object.__setattr__(layer, MARK, True)
    return len(layers)


def head_slices(module, rank: int, size: int) -> tuple[torch.Tensor, slice]:
    """The conv channels (q, k and v of this rank's heads, in that order) and the value heads that rank ``rank`` of
    ``size`` holds: key heads and value heads each cut in ``size`` equal blocks (value head j reads key head
    j // (value heads / key heads), so block r of the values reads block r of the keys)."""
    key_heads, value_heads = module.num_k_heads, module.num_v_heads
    if key_heads % size or value_heads % size:
        raise ValueError(f"{key_heads} linear key heads and {value_heads} value heads cannot be shared out over "
                         f"{size} sequence-parallel ranks")
    dk, dv = module.head_k_dim, module.head_v_dim
    k_block, v_block = key_heads // size * dk, value_heads // size * dv
    channels = torch.cat([torch.arange(rank * k_block, (rank + 1) * k_block),
                          module.key_dim + torch.arange(rank * k_block, (rank + 1) * k_block),
                          2 * module.key_dim + torch.arange(rank * v_block, (rank + 1) * v_block)])
    heads = value_heads // size
    return channels, slice(rank * heads, (rank + 1) * heads)


def grouped_linear_attention(module, hidden_states: torch.Tensor, plan) -> torch.Tensor:
    """The GDN layer over one packed row ([1, t, hidden]: the whole row, or this rank's shard of it under sequence
    parallelism) with every segment continuing its parent (``segments_of(plan)``) -> [1, t, hidden]."""
    if hidden_states.shape[0] != 1:
        raise ValueError(f"a grouped GDN layer takes one packed row (batch 1), got batch {hidden_states.shape[0]}")
    segments = segments_of(plan)
    sp, bounds = sequence_shard(plan)
    local = hidden_states.shape[1]
    mixed = module.in_proj_qkv(hidden_states)[0]  # [t, C]
    z = module.in_proj_z(hidden_states)
    b, a = module.in_proj_b(hidden_states)[0], module.in_proj_a(hidden_states)[0]  # [t, HV]
    weight, heads, size = module.conv1d.weight[:, 0], slice(None), 1  # [C, W]
    if sp is not None:
        channels, heads = head_slices(module, sp.rank, sp.size)
        weight, size = weight[channels.to(weight.device)], sp.size
        mixed, b, a = _to_heads(module, mixed, b, a, sp, bounds)
    elif local != segments.total:
        raise ValueError(f"the packed row has {local} tokens but the plan's segments cover {segments.total}")
    key_heads, value_heads = module.num_k_heads // size, module.num_v_heads // size
    beta = b.sigmoid()
    g = -module.A_log[heads].float().exp() * F.softplus(a.float() + module.dt_bias[heads])
    out = run_segments(module, segments, mixed, beta=beta, g=g, weight=weight, heads=(key_heads, value_heads))
    if sp is not None:
        out = _to_shard(out, sp, bounds)
    core = module.norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(1, local, -1))


def run_segments(module, segments, mixed, *, beta, g, weight, heads: tuple[int, int]) -> torch.Tensor:
    """The conv and the delta rule over the whole row, level by level: mixed [T, C'] (q|k|v channels), beta and g
    [T, HV'] -> [T, HV', V] in the input's dtype; ``heads``: the key and value heads held here."""
    key_heads, value_heads = heads
    kernels = level_kernels(mixed.device)
    width = module.conv_kernel_size
    dk, dv = module.head_k_dim, module.head_v_dim
    zero = lambda x: torch.cat([x, x.new_zeros(1, *x.shape[1:])])  # noqa: E731  (position T: the pad row)
    rows, beta_rows, g_rows = zero(mixed), zero(beta), zero(g)
    finals: dict[int, torch.Tensor] = {}
    places, pieces = [], []
    repeat = value_heads // key_heads
    for level in segments.levels:
        index = segments.level_index(level, width)
        x = kernels.conv(rows, index, weight)  # [..., C']
        q, k, v = torch.split(x, [key_heads * dk, key_heads * dk, value_heads * dv], dim=-1)
        q = q.reshape(*q.shape[:-1], key_heads, dk)
        k = k.reshape(*k.shape[:-1], key_heads, dk)
        v = v.reshape(*v.shape[:-1], value_heads, dv)
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)
        parents = index.parent_rows
        initial = None
        if any(p >= 0 for p in parents):
            blank = None
            states = []
            for p in parents:
                if p >= 0:
                    states.append(finals[p])
                else:
                    blank = blank if blank is not None else torch.zeros_like(next(iter(finals.values())))
                    states.append(blank)
            initial = torch.stack(states)
        out, final = kernels.rule(q, k, v, g=kernels.gather(g_rows, index), beta=kernels.gather(beta_rows, index),
                                  initial_state=initial, index=index)
        for i, s in enumerate(level):
            if segments.has_children[s]:
                finals[s] = final[i]
        where, values = kernels.scatter(out, index)
        places.append(where)
        pieces.append(values)
    order = torch.cat(places)
    values = torch.cat(pieces)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return values.index_select(0, inverse).to(mixed.dtype)


def _to_heads(module, mixed, b, a, sp, bounds):
    """This rank's shard [t, ...] of the row -> the whole row [T, ...] for this rank's heads (one all-to-all)."""
    from app.grouping.collectives import exchange

    lengths = [end - start for start, end in bounds]
    heads_b = module.num_v_heads // sp.size
    # one exchange: piece r = rank r's channels, then its value heads' b and a
    pieces = [torch.cat([mixed[:, c.to(mixed.device)], b[:, h], a[:, h]], dim=1)
              for c, h in (head_slices(module, r, sp.size) for r in range(sp.size))]
    got = torch.cat(exchange(pieces, lengths, 0, sp), dim=0)  # [T, C' + 2 HV']
    width = got.shape[1] - 2 * heads_b
    return got[:, :width], got[:, width:width + heads_b], got[:, width + heads_b:]


def _to_shard(out, sp, bounds):
    """[T, HV', V] for this rank's heads -> [t, HV, V] for this rank's shard (the inverse all-to-all)."""
    from app.grouping.collectives import exchange

    lengths = [end - start for start, end in bounds]
    mine = lengths[sp.rank]
    back = exchange(list(out.split(lengths, dim=0)), [mine] * sp.size, 0, sp)
    return torch.cat(back, dim=1)
