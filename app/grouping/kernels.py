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


# ---------------------------------------------------------------------------------------------------------------
# torch's own varlen flash kernel (``torch.nn.attention.varlen.varlen_attn``: FlashAttention-2 built into torch),
# for a GPU without the flash-attn package. CUDA-only (sm80+), float16/bfloat16, head dim <= 256 and a multiple of
# 8; inputs (T, H, D); its log-sum-exp comes as (H, T_q) float32. Found once (``varlen_kernel``); where it cannot
# run, the callers keep their other path and the reason is logged once. ``varlen_stand_in`` swaps in another kernel
# of the same signature (the CPU tests' per-sequence SDPA), to test the wiring where torch's cannot run.

VARLEN_NAME = "torch.nn.attention.varlen.varlen_attn"
KEY_CHUNK = 1024  # decoding reads a prefix's K/V through the kernel in chunks of this many keys, merged by lse
_VARLEN: dict = {"stand_in": None, "off": False, "said": set()}  # a stand-in in force, switched off, reasons logged


class Varlen:
    """A varlen flash kernel as the grouping core calls it: q (Tq, H, D), k/v (Tk, Hkv, D) (strided views with a
    contiguous last dim are read in place), ``seqs`` = (cu_seq_q, cu_seq_k, max_q, max_k); ``causal`` aligned
    bottom-right (a query sees every key up to its own place counted from the end); ``lse``: also the log-sum-exp
    (H, Tq) float32; ``seqused_k``: keys used per sequence (a static cache's written slots). Keyword arguments the
    kernel does not take are worked around (GQA by repeating K/V heads) or refused with the reason."""

    def __init__(self, fn, name: str = VARLEN_NAME):
        import inspect

        self.fn, self.name = fn, name
        self.takes = frozenset(inspect.signature(fn).parameters)

    def missing(self, *, lse: bool = False, seqused_k: bool = False) -> str:
        """What this kernel lacks for a call that needs ``lse`` / ``seqused_k`` ("" when nothing)."""
        needs = [name for name, wanted in (("return_aux", lse), ("seqused_k", seqused_k)) if wanted]
        absent = [name for name in needs if name not in self.takes]
        return f"{self.name} takes no {' or '.join(absent)}" if absent else ""

    def __call__(self, q, k, v, seqs, *, causal: bool = False, scale=None, lse: bool = False, seqused_k=None):
        cu_q, cu_k, max_q, max_k = seqs
        kwargs: dict = {"scale": scale}
        if causal:
            kwargs.update({"window_size": (-1, 0)} if "window_size" in self.takes else {"is_causal": True})
        if k.shape[-2] != q.shape[-2]:
            if "enable_gqa" in self.takes:
                kwargs["enable_gqa"] = True
            else:
                k, v = _expand_kv(k.transpose(0, 1), q.shape[-2]).transpose(0, 1), \
                    _expand_kv(v.transpose(0, 1), q.shape[-2]).transpose(0, 1)
        if seqused_k is not None:
            kwargs["seqused_k"] = seqused_k
        if lse:
            from torch.nn.attention.varlen import AuxRequest

            kwargs["return_aux"] = AuxRequest(lse=True)
        return self.fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def varlen_unusable(device, dtype: torch.dtype, head_dim: int) -> str:
    """Why torch's varlen kernel cannot run here ("" when it can)."""
    if torch.device(device).type != "cuda":
        return "not on CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{str(dtype).removeprefix('torch.')} (the kernel takes float16 and bfloat16)"
    if head_dim > 256 or head_dim % 8:
        return f"head dim {head_dim} (the kernel takes at most 256, a multiple of 8)"
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if major < 8:
        return f"compute capability {major}.{minor} (the kernel needs 8.0 or newer)"
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no {VARLEN_NAME}"
    return ""


def varlen_kernel(device, dtype: torch.dtype, head_dim: int, *, lse: bool = False, seqused_k: bool = False,
                  use: str = "") -> Varlen | None:
    """The varlen kernel for attention on ``device`` in ``dtype`` (the stand-in when one is in force), or None:
    the caller keeps its other path, and on CUDA the reason is logged once, naming ``use`` (what falls back)."""
    if _VARLEN["stand_in"] is not None:
        return _VARLEN["stand_in"]
    if _VARLEN["off"]:
        return None
    reason = varlen_unusable(device, dtype, head_dim)
    kernel = None
    if not reason:
        from torch.nn.attention.varlen import varlen_attn

        kernel = Varlen(varlen_attn)
        reason = kernel.missing(lse=lse, seqused_k=seqused_k)
    if not reason:
        return kernel
    quiet = reason == "not on CUDA" or reason.startswith(("float32", "float64"))  # today's path, as it always was
    if not quiet and (use, reason) not in _VARLEN["said"]:
        _VARLEN["said"].add((use, reason))
        import logging

        logging.getLogger("app.grouping.kernels").warning("%s: torch's varlen flash kernel is not used (%s)",
                                                          use or "attention", reason)
    return None


class varlen_stand_in:  # noqa: N801 - a context manager named for what it does
    """Within the block, ``varlen_kernel`` gives ``fn`` (a kernel with ``varlen_attn``'s signature) on any device
    and dtype: how the CPU tests drive the wiring that torch's CUDA kernel runs on a GPU."""

    def __init__(self, fn, name: str = "a stand-in varlen kernel"):
        self.kernel = Varlen(fn, name)

    def __enter__(self) -> Varlen:
        self.previous, _VARLEN["stand_in"] = _VARLEN["stand_in"], self.kernel
        return self.kernel

    def __exit__(self, *exc) -> None:
        _VARLEN["stand_in"] = self.previous


class varlen_off:  # noqa: N801 - a context manager named for what it does
    """Within the block, ``varlen_kernel`` gives None: every caller takes its other path (the benchmarks' and GPU
    tests' "old" side)."""

    def __enter__(self) -> None:
        self.previous, _VARLEN["off"] = _VARLEN["off"], True

    def __exit__(self, *exc) -> None:
        _VARLEN["off"] = self.previous


def chunk_merge(out: torch.Tensor, lse: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunks`` partial attentions of the same queries over disjoint keys, merged exactly by log-sum-exp:
    out (chunks * M, H, D), lse (H, chunks * M) -> (out (M, H, D) float32, lse (M, H) float32). A chunk with no key
    gives -inf (torch's stand-ins) or +inf (flash kernels write +inf for an empty row): both weigh 0 here."""
    rows, heads, dim = out.shape[0] // chunks, out.shape[1], out.shape[2]
    lse = lse.float().reshape(heads, chunks, rows).permute(1, 2, 0)  # [C, M, H]
    lse = torch.where(torch.isposinf(lse), torch.full_like(lse, float("-inf")), lse)
    total = torch.logsumexp(lse, dim=0)  # [M, H]
    safe = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    weight = torch.where(torch.isfinite(lse), torch.exp(lse - safe), torch.zeros_like(lse))
    merged = (weight[..., None] * out.float().reshape(chunks, rows, heads, dim)).sum(0)
    return merged, total


def varlen_against_keys(kernel: Varlen, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        start: torch.Tensor, *, scale: float, chunk: int = 0):
    """Each row owner r's M queries against its own keys, split-KV by hand: q [R, M, H, D], keys/values
    [R, Hkv, L, D] (read in place, the first ``start[r]`` positions of row r being padding) -> (out [R, M, H, D]
    float32, lse [R, M, H] float32). One kernel call per row owner over ``ceil(L / chunk)`` key chunks (each its own
    sequence: the kernel splits over keys only for single queries without a block table; ``chunk`` keys each,
    default ``KEY_CHUNK``), merged by lse. The
    chunk bounds are made on the device from ``start``: nothing waits for the host, so a CUDA graph can hold it."""
    owners, rows, heads, dim = q.shape
    length = keys.shape[2]
    chunks = max(1, -(-length // (chunk or KEY_CHUNK)))
    device = q.device
    steps = torch.arange(chunks + 1, device=device)
    cu_q = (steps * rows).to(torch.int32)
    outs, lses = [], []
    for r in range(owners):
        real = length - start[r]
        cu_k = (start[r] + torch.div(steps * real, chunks, rounding_mode="floor")).to(torch.int32)
        q_rep = q[r].repeat(chunks, 1, 1)  # the owner's queries once per key chunk (queries are few)
        out, lse = kernel(q_rep, keys[r].transpose(0, 1), values[r].transpose(0, 1),
                          (cu_q, cu_k, rows, -(-length // chunks)), lse=True, scale=scale)
        merged, total = chunk_merge(out, lse, chunks)
        outs.append(merged)
        lses.append(total)
    return torch.stack(outs), torch.stack(lses)


def flash_varlen_fn(q: torch.Tensor):
    """The varlen function the ``flash`` backend calls, with flash-attn's signature: flash-attn's own when the
    package is installed, else torch's varlen kernel behind ``FlashAttnSignature``; a clear error where neither
    runs (CPU, float32, an old card or torch)."""
    try:
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func
    except ImportError:
        pass
    kernel = varlen_kernel(q.device, q.dtype, q.shape[-1], use="forward.attention_backend=flash")
    if kernel is None:
        raise RuntimeError(f"forward.attention_backend=flash needs the flash-attn package or torch's varlen flash "
                           f"kernel, and neither runs here ({varlen_unusable(q.device, q.dtype, q.shape[-1])}); "
                           "use flex on CUDA or split on CPU")
    return FlashAttnSignature(kernel)


class FlashAttnSignature:
    """A varlen kernel (``kernels.Varlen``) called as ``flash_attn_varlen_func`` is: (q, k, v, cu_q, cu_k, max_q,
    max_k, dropout_p=, softmax_scale=, causal=). torch's kernel has no dropout: one asked for is refused."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, q, k, v, *seqs, dropout_p: float = 0.0, softmax_scale=None, causal: bool = False):
        if dropout_p:
            raise NotImplementedError("torch's varlen flash kernel has no attention dropout")
        return self.kernel(q, k, v, tuple(seqs), causal=causal, scale=softmax_scale)
