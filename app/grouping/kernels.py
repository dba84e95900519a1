"""The attention building blocks the grouped backends share: key/value heads expanded for grouped-query attention,
SDPA on 3-D or 4-D inputs through torch's fused CPU kernels, and the exact two-part softmax over [P ; own earlier
tokens] (``_PrefixPlusOwnAttention``) that the ``split`` backends (plain groups, families, prefix trees) use."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------------------
# Building blocks. q: [H, L, D]; k, v: [Hkv, L, D]; return [H, L, D].


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    rep = heads // x.shape[-3]
    return x if rep == 1 else x.repeat_interleave(rep, dim=-3)


def _sdpa(q, k, v, mask=None, *, is_causal=False, scale=None, dropout=0.0):
    k, v = _expand_kv(k, q.shape[-3]), _expand_kv(v, q.shape[-3])
    if q.dim() == 3:  # the fused CPU kernels take 4-D inputs only; 3-D falls back to the O(L^2)-memory math path
        return _sdpa(q[None], k[None], v[None], mask, is_causal=is_causal, scale=scale, dropout=dropout)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          dropout_p=dropout)


class _PrefixPlusOwnAttention(torch.autograd.Function):
    """Softmax over [P ; own earlier tokens] for every response query, as two fused CPU calls merged exactly.

    Part A: all the group's response queries against P in one unmasked call (no copy of P, no mask). Part B: each
    response against itself with ``is_causal=True`` (the kernel skips the upper triangle). The outputs merge by
    log-sum-exp; the backward hands each part the MERGED output and log-sum-exp, so its kernel computes the joint
    probabilities and exact gradients (as ring attention does).
    """

    @staticmethod
    def forward(ctx, q, keys, values, geometry):
        """q [1, H, S, D] of the group's responses; keys/values [1, H, P + S, D]: the prefix's, then the responses'
        own. Each part goes to its kernel as a contiguous copy, as the kernels were always given them (a strided
        view gives the same numbers on most shapes but not on all: one demo run parted at its 200th step)."""
        prefix, lens, scale = geometry  # the prefix's length, the responses' lengths, the softmax scale
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        ctx.dtype = q.dtype
        prefix_k, own_k = keys[:, :, :prefix].contiguous(), keys[:, :, prefix:].contiguous()
        prefix_v, own_v = values[:, :, :prefix].contiguous(), values[:, :, prefix:].contiguous()
        if q.dtype in (torch.bfloat16, torch.float16):
            # Low precision: both parts and their merge in float32, so the two kernel outputs, the merge and the
            # summed dq are rounded once (at the end) instead of three times; grouped stays no worse than repeated.
            q, prefix_k, prefix_v, own_k, own_v = (x.float() for x in (q, prefix_k, prefix_v, own_k, own_v))
        out_a, lse_a = flash(q, prefix_k, prefix_v, 0.0, False, scale=scale)
        parts, lses, start = [], [], 0
        for length in lens:
            sl = slice(start, start + length)
            o, lse = flash(q[:, :, sl], own_k[:, :, sl], own_v[:, :, sl], 0.0, True, scale=scale)
            parts.append(o)
            lses.append(lse)
            start += length
        out_b, lse_b = torch.cat(parts, dim=2), torch.cat(lses, dim=2)
        lse = torch.logaddexp(lse_a, lse_b)
        out = (torch.exp(lse_a - lse)[..., None] * out_a.to(lse.dtype)
               + torch.exp(lse_b - lse)[..., None] * out_b.to(lse.dtype))
        ctx.save_for_backward(q, prefix_k, prefix_v, own_k, own_v, out, lse)
        ctx.lens, ctx.scale = lens, scale
        return out.to(ctx.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, prefix_k, prefix_v, own_k, own_v, out, lse = ctx.saved_tensors
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad_out = grad_out.to(q.dtype).contiguous()
        dq, dpk, dpv = backward(grad_out, q, prefix_k, prefix_v, out, lse, 0.0, False, scale=ctx.scale)
        dq = dq.clone()
        dok, dov = torch.zeros_like(own_k), torch.zeros_like(own_v)
        start = 0
        for length in ctx.lens:
            sl = slice(start, start + length)
            gq, gk, gv = backward(grad_out[:, :, sl].contiguous(), q[:, :, sl].contiguous(),
                                  own_k[:, :, sl].contiguous(), own_v[:, :, sl].contiguous(),
                                  out[:, :, sl].contiguous(), lse[:, :, sl].contiguous(), 0.0, True, scale=ctx.scale)
            dq[:, :, sl] += gq
            dok[:, :, sl] = gk
            dov[:, :, sl] = gv
            start += length
        dtype = ctx.dtype
        return dq.to(dtype), torch.cat([dpk, dok], dim=2).to(dtype), torch.cat([dpv, dov], dim=2).to(dtype), None


def varlen_calls(fn, idx: dict, q, k, v, *, scale, dropout):
    """flash-attn's two varlen calls over a packed row (q [H, T, D], k/v [Hkv, T, D] -> [H, T, D]): the rows
    ``prefix_idx`` causally per sequence (``cu_p``), then the rows ``suffix_q_idx`` against the gathered keys
    ``suffix_k_idx`` per sequence pair (``cu_sq`` / ``cu_sk``). flash-attn takes [tokens, heads, dim] and handles
    GQA itself; ``causal=True`` aligns the mask bottom-right when keys are longer than queries (a response sees all
    of what precedes it)."""
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    out = torch.empty_like(qt)
    p = idx["prefix_idx"]
    out[p] = fn(qt[p], kt[p], vt[p], idx["cu_p"], idx["cu_p"], idx["max_p"], idx["max_p"], dropout_p=dropout,
                softmax_scale=scale, causal=True)
    sq, sk = idx["suffix_q_idx"], idx["suffix_k_idx"]
    out[sq] = fn(qt[sq], kt[sk], vt[sk], idx["cu_sq"], idx["cu_sk"], idx["max_sq"], idx["max_sk"],
                 dropout_p=dropout, softmax_scale=scale, causal=True)
    return out.transpose(0, 1)
