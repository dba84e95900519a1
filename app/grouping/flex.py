"""The ``flex`` backend of the grouped attention, and of the prefix-tree attention: torch's FlexAttention with a
block mask built straight from the layout or the trees (``flex_block_mask``, ``tree_mask_mod``: no T x T mask is
ever materialised), compiled once for every packed length. It refuses to run uncompiled (that path materialises the
T x T scores) with ``FlexCompileError``.
"""

from __future__ import annotations

import torch

from app.grouping.layout import GroupLayout

FLEX_BLOCK = 128  # FlexAttention's default block size
_compiled_flex = None
_UNFUSED_WARNING = "flex_attention called without torch.compile"
FLEX_ALTERNATIVE = ("forward.attention_backend=packed (no compiler needed), or flash with flash-attn installed "
                    "(forward.attention_backend=flash)")


class FlexCompileError(RuntimeError):
    """FlexAttention could not run compiled; the unfused fallback (O(T^2) memory) is never taken silently."""


def flex_mask_mod(segment_ids: torch.Tensor, group_ids: torch.Tensor):
    """Causal, same group, and either a prefix key or a key of the query's own response."""

    def mask_mod(b, h, qi, ki):
        return (ki <= qi) & (group_ids[qi] == group_ids[ki]) & ((segment_ids[ki] == 0)
                                                                  | (segment_ids[ki] == segment_ids[qi]))

    return mask_mod


def flex_block_mask(layout: GroupLayout, device, block: int = FLEX_BLOCK, rows_per_chunk: int = 1024):
    """The layout's BlockMask, built block row by block row: never a T x T tensor, nothing compiled.

    Equals ``create_block_mask(flex_mask_mod(...), None, None, T, T)`` (tested).
    """
    return block_mask_from(flex_mask_mod, [layout.segment_ids, layout.group_ids], layout.total_len, device,
                           block=block, rows_per_chunk=rows_per_chunk)


def tree_mask_mod(first: torch.Tensor, last: torch.Tensor):
    """Prefix trees (``app.grouping.tree.layout``): causal, and the key's node is the query's node or one of its ancestors.
    Each token carries its node's interval in a depth-first numbering of all the trees' nodes (``first``: the
    node's own number, ``last``: the largest number in its subtree), so "ancestor or self" is
    ``first[k] <= first[q] <= last[k]``: per-token vectors only (a captured node table would add a dimension
    that inductor's CPU template fails to compile)."""

    def mask_mod(b, h, qi, ki):
        return (ki <= qi) & (first[ki] <= first[qi]) & (first[qi] <= last[ki])

    return mask_mod


def block_mask_from(make_mask_mod, vectors: list[torch.Tensor], length: int, device, *, block: int = FLEX_BLOCK,
                    rows_per_chunk: int = 1024):
    """A BlockMask for ``make_mask_mod(*vectors)`` (each vector one value per token), built block row by block row
    on the index vectors padded to whole blocks (the padding never allowed): no T x T tensor, nothing compiled."""
    from torch.nn.attention.flex_attention import BlockMask

    blocks = -(-length // block)
    padded = blocks * block
    padded_mod = make_mask_mod(*[torch.nn.functional.pad(v.to(device), (0, padded - length)) for v in vectors])
    keys = torch.arange(padded, device=device)
    any_parts, all_parts = [], []
    step = max(1, rows_per_chunk // block) * block
    for start in range(0, padded, step):
        rows = torch.arange(start, min(start + step, padded), device=device)
        allowed = padded_mod(None, None, rows[:, None], keys[None, :])
        allowed &= (rows[:, None] < length) & (keys[None, :] < length)  # padding: never a full block
        tiles = allowed.view(-1, block, blocks, block)
        any_parts.append(tiles.any(dim=3).any(dim=1))
        all_parts.append(tiles.all(dim=3).all(dim=1))
    some, full = torch.cat(any_parts), torch.cat(all_parts)
    partial = some & ~full

    def ordered(dense):
        count = dense.sum(-1).to(torch.int32)
        index = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return count[None, None], index[None, None]

    kv_num, kv_index = ordered(partial)
    full_num, full_index = ordered(full)
    # The kernel's mask_mod captures length-T vectors, as create_block_mask's would (inductor's CPU template fails
    # to compile when the captured length differs from T under dynamic shapes).
    mask_mod = make_mask_mod(*[v.to(device).clone() for v in vectors])
    return BlockMask.from_kv_blocks(kv_num, kv_index, full_num, full_index, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(length, length))


def compiled_flex_attention():
    """FlexAttention compiled ONCE for every packed length (dynamic shapes): GRPO packs a new length every step,
    and a static compile would recompile per step until dynamo's recompile limit, then fall back to the unfused
    O(T^2) implementation."""
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        # One process meets a few signatures (dtype, head size, query heads per KV head, mask kind: grouped or
        # tree); past dynamo's recompile limit (8) it would fall back to the unfused path, which run_flex refuses.
        config = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if isinstance(getattr(config, name, None), int):
                setattr(config, name, max(getattr(config, name), 64))
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex


def flex(plan, q, k, v, scale, dropout):
    """The grouped ``flex`` backend: q [H, T, D], k/v [Hkv, T, D] -> [H, T, D]."""
    if dropout:
        raise NotImplementedError("the flex backend has no attention dropout")
    block_mask = plan.cached("flex", q.device, lambda: flex_block_mask(plan.layout, q.device))
    return run_flex(q[None], k[None], v[None], block_mask, scale, alternative=FLEX_ALTERNATIVE)[0]


def run_flex(q, k, v, block_mask, scale, *, alternative: str) -> torch.Tensor:
    """Compiled FlexAttention on q [B, H, T, D], k/v [B, Hkv, T, D]; stops with ``FlexCompileError`` (naming
    ``alternative`` and why compiling failed) rather than run uncompiled."""
    import warnings

    from torch.nn.attention import flex_attention as flex_module

    # torch warns about the unfused path once per process; forget that it did, and make the warning an error.
    getattr(flex_module, "_WARNINGS_SHOWN", set()).discard("flex_attention_performance")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=f".*{_UNFUSED_WARNING}.*")
        try:
            return compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        except UserWarning:
            reason = why_not_compiled(q, k, v, block_mask, scale)
    raise FlexCompileError(
        f"FlexAttention could not run compiled (T={q.shape[2]}): {reason}. Running it uncompiled would materialise "
        f"the full T x T scores, so it stops here. Use {alternative} instead.")


def why_not_compiled(q, k, v, block_mask, scale) -> str:
    """Why ``torch.compile`` fell back to running FlexAttention eagerly: an active Python dispatch mode (dynamo
    never compiles under one; a memory meter built on ``TorchDispatchMode`` is one), or the compiler's own error,
    surfaced by compiling again with ``fullgraph=True`` (which raises instead of falling back)."""
    from torch.nn.attention.flex_attention import flex_attention
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    mode = _get_current_dispatch_mode()
    if mode is not None:
        return (f"a Python dispatch mode ({type(mode).__name__}) is active, and torch.compile does not compile "
                "under one; measure with the allocator's own counters (torch.cuda.max_memory_allocated) instead")
    try:
        torch.compile(flex_attention, dynamic=True, fullgraph=True)(q, k, v, block_mask=block_mask, scale=scale,
                                                                    enable_gqa=q.shape[1] != k.shape[1])
    except Exception as error:  # noqa: BLE001 - the compiler's own error is the message
        lines = [line for line in str(error).splitlines() if line.strip()]
        return f"the compiler's error: {type(error).__name__}: {' / '.join(lines[:6])[:1500]}"
    return ("the dynamic-shape compile fell back to eager, but a full-graph compile of the same call succeeds "
            "(dynamo's recompile limit? see TORCH_LOGS=recompiles)")
