"""The instance patches of a QSA attention layer (transformers' ``Qwen4ExpTextAttention``: an ``indexer`` beside gated
attention with q/k norms and partial M-RoPE).

- In a packed row (a training plan in the forward kwargs, ``attention.PLAN_KWARG``): the layer runs over the row
  chunk by chunk of queries, each chunk's keys the ones its queries choose (``selection``) among those their path
  shows them (``segments_of(plan)``), so response Ri attends to what it would in [P;Ri] with [P;Ri]'s blocks.
- In an ordinary batch (the repeated layout, HF generate, a decode step with transformers' cache): the layer's own
  forward, its indexer replaced by the vectorised selection over transformers' 4-D mask (no loop over queries),
  the attention and its mask left to transformers.

Under sequence parallelism (a plan with ``sp`` and ``bounds``) each rank runs its shard's queries against the whole
row's keys: its keys and values, few (Qwen3.8-Flash-Next: 2 KV heads against 24 query heads), joined from every
shard (``collectives.whole_row``, their gradients sent back), and the indexer's raw keys and rotary tables likewise
(no gradient: the choice is a hard top-k), so each query chooses among the blocks it would see on one rank. No head
count constrains S.

``QUERY_CHUNK`` queries at a time: a chunk's scores are [chunk, heads, blocks], its mask [chunk, T]; never [T, T].
Where torch's varlen flash kernel runs (CUDA, bf16/fp16: ``app.grouping.kernels.varlen_kernel``), each query of a
chunk attends over its own gathered keys (``gathered_attention``: a sequence of one query against at most the
indexer's budget of keys); elsewhere a masked attention over the chunk's [chunk, T] mask. The CPU tests drive the
varlen wiring with a stand-in kernel.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F

from app.grouping.collectives import whole_row
from app.grouping.kernels import varlen_kernel
from app.grouping.recurrent.segments import current_forward, segments_of, sequence_shard
from app.grouping.sparse.selection import BatchGeometry, choose, key_blocks, key_mask

MARK = "_prefix_grouping_qsa"
QUERY_CHUNK = 256


def is_qsa(module) -> bool:
    return hasattr(module, "indexer") and hasattr(module, "q_proj") and hasattr(module.indexer, "index_qk_proj")


def _rotary(module):
    """The model's own ``apply_rotary_pos_emb`` (partial rotary, as its layers apply it)."""
    return sys.modules[type(module).__module__].apply_rotary_pos_emb


def install(model, plan_kwarg: str) -> int:
    """Patch every QSA layer of ``model`` (once; idempotent): grouped over a packed row when a plan arrives, the
    vectorised indexer otherwise. Returns how many QSA layers the model has."""
    layers = [m for m in model.modules() if is_qsa(m)]
    for layer in layers:
        if getattr(layer, MARK, False):
            continue
        original = current_forward(layer)

        def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None,
                    _original=original, **kwargs):
            plan = kwargs.get(plan_kwarg)
            if plan is None:
                return _original(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
            return grouped_qsa(self, hidden_states, position_embeddings, plan), None

        def indexer(self, hidden_states, position_embeddings, attention_mask, past_key_values):
            return vectorised_indexer(self, hidden_states, position_embeddings, attention_mask, past_key_values)

        object.__setattr__(layer, "forward", types.MethodType(forward, layer))
        object.__setattr__(layer.indexer, "forward", types.MethodType(indexer, layer.indexer))
        object.__setattr__(layer, MARK, True)
    return len(layers)


def index_projections(indexer, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(index queries [B, L, H, d] normed and rotated at ``cos`` / ``sin`` [B, L, r], raw keys [B, L, d]) as
    ``Qwen4ExpTextQSAIndexer`` computes them."""
    b, length, _ = hidden_states.shape
    q, keys = torch.split(indexer.index_qk_proj(hidden_states),
                          [indexer.index_n_heads * indexer.index_head_dim, indexer.index_head_dim], dim=-1)
    q = indexer.q_layernorm(q.reshape(b, length, -1, indexer.index_head_dim))
    q = _rotary(indexer)(q, cos=cos, sin=sin, unsqueeze_dim=2)
    return q, keys.reshape(b, length, indexer.index_head_dim)


@torch.no_grad()
def vectorised_indexer(indexer, hidden_states, position_embeddings, attention_mask, past_key_values):
    """``Qwen4ExpTextQSAIndexer.forward`` without its loop over queries: the same selection (ties to the earlier
    block), as a mask [B, 1, L, T] of transformers' kind (bool, or 0 / min for eager)."""
    full_cos, full_sin = position_embeddings
    length = hidden_states.shape[1]
    q, raw = index_projections(indexer, hidden_states, full_cos[:, -length:], full_sin[:, -length:])
    if past_key_values is not None:
        raw = past_key_values.update_indexer(raw, indexer.layer_idx)
    geometry = BatchGeometry(attention_mask)
    compress = indexer.compress_ratio
    blocks = key_blocks(geometry.ranks, geometry.predecessors(max(compress - 1, 1)), raw.flatten(0, 1),
                        full_cos.flatten(0, 1), full_sin.flatten(0, 1), compress=compress, k_norm=indexer.k_layernorm,
                        rotate=_rotary(indexer))
    batch, keys_per_row = attention_mask.shape[0], geometry.keys_per_row
    flat_q = q.flatten(0, 1)
    out = torch.zeros(batch * length, keys_per_row, dtype=torch.bool, device=hidden_states.device)
    for start in range(0, batch * length, QUERY_CHUNK):
        queries = torch.arange(start, min(start + QUERY_CHUNK, batch * length), device=hidden_states.device)
        seen = geometry.visible(queries)
        chosen = choose(blocks, seen, flat_q[queries], indexer.block_topk)
        mask = key_mask(blocks, seen, geometry.query_ranks(queries), geometry.ranks, chosen, compress)
        rows = queries // length
        columns = rows[:, None] * keys_per_row + torch.arange(keys_per_row, device=mask.device)[None]
        out[queries] = mask.gather(1, columns)
    selected = out.view(batch, 1, length, keys_per_row)
    if attention_mask.is_floating_point():
        return torch.where(selected, attention_mask.new_zeros(()), torch.finfo(attention_mask.dtype).min)
    return selected


def grouped_qsa(module, hidden_states: torch.Tensor, position_embeddings, plan) -> torch.Tensor:
    """The QSA layer over one packed row ([1, t, hidden]: the whole row, or this rank's shard of it under sequence
    parallelism): q/k/v, norms, rotary and output gate as ``Qwen4ExpTextAttention`` computes them; each query's keys
    chosen along its path (``selection``), attended to chunk by chunk (softmax over exactly those keys) -> [1, t,
    hidden]."""
    if hidden_states.shape[0] != 1:
        raise ValueError(f"a grouped QSA layer takes one packed row (batch 1), got batch {hidden_states.shape[0]}")
    segments = segments_of(plan)
    sp, bounds = sequence_shard(plan)
    cos, sin = position_embeddings
    local = hidden_states.shape[1]
    start = bounds[sp.rank][0] if sp is not None else 0
    shape = (1, local, -1, module.head_dim)
    query, gate = torch.chunk(module.q_proj(hidden_states).view(1, local, -1, module.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(1, local, -1)
    query = module.q_norm(query.reshape(shape)).transpose(1, 2)
    key = module.k_norm(module.k_proj(hidden_states).view(shape)).transpose(1, 2)
    value = module.v_proj(hidden_states).view(shape).transpose(1, 2)
    query, key = _rotary(module)(query, key, cos, sin)
    indexer, compress = module.indexer, module.indexer.compress_ratio
    device = hidden_states.device
    with torch.no_grad():
        index_q, raw = index_projections(indexer, hidden_states, cos, sin)
    if sp is not None:
        lengths = [end - begin for begin, end in bounds]
        key, value = (whole_row(x, lengths, 2, sp) for x in (key, value))
        with torch.no_grad():
            raw, cos, sin = (whole_row(x, lengths, 1, sp) for x in (raw, cos, sin))
    if key.shape[2] != segments.total:
        raise ValueError(f"the QSA layer holds {key.shape[2]} keys; the plan's row has {segments.total} tokens")
    kernel = varlen_kernel(device, query.dtype, module.head_dim, use="QSA attention (a masked attention per chunk)")
    if kernel is None:  # the masked path attends over every head's keys
        groups = module.num_key_value_groups
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    with torch.no_grad():
        ranks = segments.path_positions.to(device)
        blocks = key_blocks(ranks, segments.predecessors(max(compress - 1, 1)).to(device), raw[0], cos[0], sin[0],
                            compress=compress, k_norm=indexer.k_layernorm, rotate=_rotary(indexer))
    out = []
    for first in range(0, local, QUERY_CHUNK):
        mine = torch.arange(first, min(first + QUERY_CHUNK, local), device=device)  # this shard's
        queries = mine + start  # the row's
        with torch.no_grad():
            seen = segments.visible(queries.cpu()).to(device)
            chosen = choose(blocks, seen, index_q[0, mine], indexer.block_topk)
            mask = key_mask(blocks, seen, ranks[queries], ranks, chosen, compress)
        if kernel is None:
            out.append(F.scaled_dot_product_attention(query[:, :, mine], key, value, attn_mask=mask[None, None],
                                                      dropout_p=0.0, scale=module.scaling))
        else:
            out.append(gathered_attention(kernel, query[0, :, mine], key[0], value[0], mask, module.scaling)[None])
    attention = torch.cat(out, dim=2).transpose(1, 2).reshape(1, local, -1)
    return module.o_proj(attention * torch.sigmoid(gate))


def gathered_attention(kernel, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Each query over exactly its own keys through a varlen kernel (``app.grouping.kernels.Varlen``): query [H, n,
    D], key/value [Hkv, T, D], ``mask`` [n, T] (True: attended) -> [H, n, D]. Each query is a sequence of one; its
    keys, gathered in order, a sequence of at most budget + C - 1: no [n, T] score matrix, only the chosen keys are
    read. Every query has a key: itself, in its tail block."""
    queries, keys = mask.nonzero(as_tuple=True)  # row-major: query by query, each one's keys in order
    counts = torch.bincount(queries, minlength=mask.shape[0])
    cu_k = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    cu_q = torch.arange(mask.shape[0] + 1, device=mask.device, dtype=torch.int32)
    out = kernel(query.transpose(0, 1), key[:, keys].transpose(0, 1), value[:, keys].transpose(0, 1),
                 (cu_q, cu_k, 1, int(counts.max())), scale=scale)
    return out.transpose(0, 1)
