"""A decode step's attention through torch's varlen flash kernel (``app.grouping.kernels``), on CUDA in float16 /
bfloat16 without the flash-attn package: the bmm path (``prefill.attention_with_lse_matmul``) materialises float32
scores and reads the K/V at about a tenth of the card's bandwidth; the kernel reads them in place, split over keys.
``decode.decode_attention`` calls ``varlen_decode_parts`` when its cache holds a kernel (``GroupedKVCache.varlen``)
and merges its parts as it merges the bmm path's."""

from __future__ import annotations

import torch

from app.grouping.kernels import varlen_against_keys


def varlen_decode_parts(cache, layer_idx: int, slots, q, own: tuple, *, scale: float):
    """The prefix and own parts of a decode step through torch's varlen flash kernel (``cache.varlen``):

    - prefix: each group's samples against its prompt's K/V in key chunks (``kernels.varlen_against_keys``: one
      call per group, split-KV by hand, merged by lse; the left padding skipped by where its keys begin);
    - own: every sample's single query against its own keys, one call with one query per sequence (the kernel
      splits the keys itself there), ``seqused_k`` saying how many are written (a static cache's buffers are read
      whole otherwise); the buffers' (N, capacity, Hkv, D) storage is read as one (N * capacity, Hkv, D) tensor.

    Returns (out_a [B * Gmax, Hkv, rep, D], lse_a [B * Gmax, Hkv, rep], out_b [N, Hkv, rep, D], lse_b [N, Hkv, rep])
    as the bmm path does (float32; the caller merges them)."""
    kernel = cache.varlen
    groups, gmax, kv_heads, rep, dim = slots.shape
    heads = kv_heads * rep
    prefix_k, prefix_v = cache.prefix[layer_idx]
    out_a, lse_a = varlen_against_keys(kernel, slots.reshape(groups, gmax, heads, dim), prefix_k, prefix_v,
                                       cache.prefix_start, scale=scale)
    own_keys, own_values = own
    samples, written = own_keys.shape[0], own_keys.shape[2]
    storage_k, storage_v = own_keys.transpose(1, 2), own_values.transpose(1, 2)  # (N, capacity, Hkv, D)
    if storage_k.stride()[1:] != (kv_heads * dim, dim, 1) or storage_v.stride() != storage_k.stride():
        raise RuntimeError("the own K/V buffers are not laid out for the varlen kernel (N, capacity, Hkv, D)")
    capacity = storage_k.stride(0) // (kv_heads * dim)
    flat = [x.as_strided((samples * capacity, kv_heads, dim), (kv_heads * dim, dim, 1)) for x in (storage_k,
                                                                                               storage_v)]
    cu_q = torch.arange(samples + 1, device=q.device, dtype=torch.int32)
    used = cache.written + 1 if cache.static else torch.full((), written, device=q.device)
    out_b, lse_b = kernel(q.reshape(samples, heads, dim), flat[0], flat[1], (cu_q, cu_q * capacity, 1, capacity),
                          lse=True, scale=scale, seqused_k=used.to(torch.int32).expand(samples).contiguous())
    return (out_a.reshape(groups * gmax, kv_heads, rep, dim), lse_a.reshape(groups * gmax, kv_heads, rep),
            out_b.reshape(samples, kv_heads, rep, dim), lse_b.float().t().reshape(samples, kv_heads, rep))
