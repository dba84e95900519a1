"""Grouped self-attention for a packed row, plugged into transformers through ``AttentionInterface``.

Within a group, prefix tokens attend causally within P; tokens of response Ri attend to all of P and to their own
earlier tokens, never to another Rj; groups never see each other. Every backend computes exactly that; they differ
only in how the work is cut:

- ``split``   (CPU default) P causally; then all response queries against P in one unmasked call (P is never
              copied) and each response against itself with is_causal, merged exactly by log-sum-exp in a custom
              autograd function over torch's fused CPU kernel and its backward. Fastest and leanest on CPU.
- ``packed``  P causally, then the responses chunk by chunk (chunks of at most max(P, longest response)
              tokens) against [P; chunk] under a block mask. The first chunk follows P in the row, so when the
              responses are short next to P there is one call and no copy of P.
- ``paper``   the paper's two calls: P causally, then each response against [P;Ri], with P's keys/values
              materialised once per response (what the ``prefix-grouper`` package does).
- ``masked``  one call over the whole row with a dense boolean mask (the naive reference; O(T^2) memory).
- ``flex``    one FlexAttention call with a block-sparse mask (CUDA; torch has no FlexAttention backward on CPU).
- ``flash``   flash-attn varlen: prefixes causally, then each response against [P;Ri] (causal, bottom-right).

Families of questions sharing a video ([V; Q1; R1*; Q2; R2*...], ``families.py``): split, masked, flash and flex.

Decoding (``decode.py``): the same function, given a ``GroupedKVCache`` instead of a plan, attends each sample's
single new query to its prompt's prefix K/V (held once per prompt) and its own generated K/V.

The plan (layout + backend) reaches the function as the forward kwarg ``prefix_grouping``; transformers forwards
extra kwargs to every attention call, also when activation checkpointing recomputes a layer.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from app.grouping.families import family_attention
from app.grouping.flex import flex
from app.grouping.kernels import (
    _expand_kv,
    _PrefixPlusOwnAttention,
    _sdpa,
    flash_varlen_fn,
    varlen_calls,
    varlen_unusable,
)
from app.grouping.layout import GroupLayout

ATTENTION_NAME = "prefix_grouper"
PLAN_KWARG = "prefix_grouping"
BACKENDS = ("packed", "paper", "masked", "flex", "flash", "split")


def flash_attn_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def flash_available(device=None) -> bool:
    """Whether the ``flash`` backend runs here: the flash-attn package, or torch's own varlen kernel (CUDA, sm80+,
    a torch that has it), in float16/bfloat16."""
    if flash_attn_available():
        return True
    on = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return not varlen_unusable(on, torch.bfloat16, 128)


def default_backend(device: torch.device | str | None = None) -> str:
    """The best backend that runs here: flash-attn varlen, else FlexAttention on CUDA, else ``split`` on CPU.
    (torch's own varlen kernel makes ``flash`` run without the package too, but it is not the default: whether it
    beats flex there has not been measured, docs/grouping.md.)"""
    on_cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    if on_cuda and flash_attn_available():
        return "flash"
    if on_cuda:
        return "flex"
    return "split"


def usable_backends(device: torch.device | str) -> tuple[str, ...]:
    """Backends that run forward and backward on ``device``."""
    if torch.device(device).type == "cuda":
        gpu = ("packed", "paper", "masked", "flex", "flash")
        return gpu if flash_available(device) else gpu[:-1]
    return ("packed", "paper", "masked", "split")


@dataclass
class GroupedAttentionPlan:
    """What the attention function needs for one packed forward: the layout, the backend, device-side indices."""

    layout: GroupLayout
    backend: str = "packed"
    varlen_fn: Callable | None = None  # flash backend only; defaults to flash_attn.flash_attn_varlen_func
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown grouped-attention backend {self.backend!r}; expected one of {BACKENDS}")

    def cached(self, key: str, device: torch.device, build: Callable[[], object]):
        slot = (key, str(device))
        if slot not in self._cache:
            self._cache[slot] = build()
        return self._cache[slot]

    def attend(self, module, query, key, value, *, scale=None, dropout=0.0) -> torch.Tensor:
        """The attention-plan protocol (every plan has it: this one, ``decode.GroupedKVCache``,
        ``decode.PrefillChunk``, ``sequence_parallel.SequenceParallelPlan``): transformers' q [B, H, L, D], k/v
        [B, Hkv, L, D] -> [B, L, H, D]."""
        if query.shape[2] != key.shape[2]:
            raise RuntimeError("grouped attention runs without a KV cache (use_cache=False)")
        return grouped_attention(self, query, key, value, scale=scale, dropout=dropout).transpose(1, 2).contiguous()


# ---------------------------------------------------------------------------------------------------------------
# Building blocks. q: [H, L, D]; k, v: [Hkv, L, D]; return [H, L, D].


def suffix_block_mask(prefix_len: int, completion_lens: list[int], device) -> torch.Tensor:
    """[S, P+S] boolean: every response query sees all of P and its own earlier tokens."""
    # Small index vectors come from the CPU; the S x (P+S) mask itself is built on the device.
    seg = torch.repeat_interleave(torch.arange(len(completion_lens)), torch.tensor(completion_lens)).to(device)
    idx = torch.arange(sum(completion_lens), device=device)
    own = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    return torch.cat([own.new_ones(own.shape[0], prefix_len), own], dim=1)


def dense_group_mask(layout: GroupLayout, device) -> torch.Tensor:
    """[T, T] boolean mask of the whole packed row (reference semantics)."""
    seg, grp = layout.segment_ids.to(device), layout.group_ids.to(device)
    idx = torch.arange(layout.total_len, device=device)
    causal = idx[None, :] <= idx[:, None]
    return causal & (grp[:, None] == grp[None, :]) & ((seg[None, :] == 0) | (seg[None, :] == seg[:, None]))


def response_chunks(prefix_len: int, completion_lens: list[int]) -> list[list[int]]:
    """Consecutive responses packed into chunks of at most max(P, longest response) tokens.

    A chunk's queries attend to [P; chunk] under a block mask, so the work spent on masked-out pairs (responses of
    the same chunk seeing each other) stays below the prefix work. The first chunk sits right after P in the
    packed row and needs no copy; later chunks take a copy of P's keys/values.
    """
    budget = max(prefix_len, max(completion_lens))
    chunks, current, total = [], [], 0
    for length in completion_lens:
        if current and total + length > budget:
            chunks.append(current)
            current, total = [], 0
        current.append(length)
        total += length
    return [*chunks, current]


def _packed(plan: GroupedAttentionPlan, q, k, v, scale, dropout):
    out = torch.empty_like(q)
    for g, (start, prefix, lens) in enumerate(plan.layout.group_spans):
        mid = start + prefix
        out[:, start:mid] = _sdpa(q[:, start:mid], k[:, start:mid], v[:, start:mid], is_causal=True, scale=scale,
                                  dropout=dropout)
        offset = mid
        for c, chunk in enumerate(response_chunks(prefix, lens)):
            end = offset + sum(chunk)
            mask = plan.cached(f"suffix{g}.{c}", q.device, lambda p=prefix, ls=chunk: suffix_block_mask(p, ls, q.device))
            if offset == mid:  # [P; chunk] is contiguous in the packed row
                keys, values = k[:, start:end], v[:, start:end]
            else:
                keys = torch.cat([k[:, start:mid], k[:, offset:end]], dim=1)
                values = torch.cat([v[:, start:mid], v[:, offset:end]], dim=1)
            out[:, offset:end] = _sdpa(q[:, offset:end], keys, values, mask=mask, scale=scale, dropout=dropout)
            offset = end
    return out


def _paper(plan: GroupedAttentionPlan, q, k, v, scale, dropout):
    """Two calls per group; the prefix K/V is copied once per response, as the paper's implementation does."""
    heads, _, dim = q.shape
    out = torch.empty_like(q)
    for g, (start, prefix, lens) in enumerate(plan.layout.group_spans):
        mid = start + prefix
        out[:, start:mid] = _sdpa(q[:, start:mid], k[:, start:mid], v[:, start:mid], is_causal=True, scale=scale,
                                  dropout=dropout)
        longest, count = max(lens), len(lens)

        def build(prefix=prefix, lens=lens, longest=longest):
            dev = q.device
            valid = torch.arange(longest, device=dev)[None, :] < torch.tensor(lens, device=dev)[:, None]
            own = torch.ones(longest, longest, dtype=torch.bool, device=dev).tril()
            suffix = own[None] & valid[:, None, :]
            mask = torch.cat([suffix.new_ones(len(lens), longest, prefix), suffix], dim=2)
            offsets = torch.tensor([0, *lens[:-1]], device=dev).cumsum(0) + prefix
            rows = (offsets[:, None] + torch.arange(longest, device=dev)[None, :]).clamp_max(sum(lens) + prefix - 1)
            # Index of the real (unpadded) query rows, from Python ints: no data-dependent op on the device.
            keep = torch.cat([torch.arange(n) + i * longest for i, n in enumerate(lens)]).to(dev)
            return mask[:, None], rows, keep

        mask, rows, keep = plan.cached(f"paper{g}", q.device, build)
        span_q, span_k, span_v = q[:, start:], k[:, start:], v[:, start:]
        # [G, H, longest, D] queries; keys [G, Hkv, prefix + longest, D] with P repeated per response.
        qs = span_q[:, rows].transpose(0, 1)
        ks = torch.cat([span_k[:, :prefix][None].expand(count, -1, -1, -1), span_k[:, rows].transpose(0, 1)], dim=2)
        vs = torch.cat([span_v[:, :prefix][None].expand(count, -1, -1, -1), span_v[:, rows].transpose(0, 1)], dim=2)
        res = _sdpa(qs, ks, vs, mask=mask, scale=scale, dropout=dropout)  # [G, H, longest, D]
        flat = res.transpose(0, 1).reshape(heads, count * longest, dim)
        out[:, mid : mid + sum(lens)] = flat.index_select(1, keep)
    return out


def _masked(plan: GroupedAttentionPlan, q, k, v, scale, dropout):
    mask = plan.cached("dense", q.device, lambda: dense_group_mask(plan.layout, q.device))
    return _sdpa(q, k, v, mask=mask, scale=scale, dropout=dropout)


def _flash(plan: GroupedAttentionPlan, q, k, v, scale, dropout):
    fn = plan.varlen_fn if plan.varlen_fn is not None else flash_varlen_fn(q)

    def build():
        layout, dev = plan.layout, q.device
        prefix_idx, suffix_q_idx, suffix_k_idx = [], [], []
        cu_p, cu_sq, cu_sk = [0], [0], [0]
        for start, prefix, lens in layout.group_spans:
            prefix_idx.append(torch.arange(start, start + prefix))
            cu_p.append(cu_p[-1] + prefix)
            cursor = start + prefix
            for length in lens:
                suffix_q_idx.append(torch.arange(cursor, cursor + length))
                suffix_k_idx += [torch.arange(start, start + prefix), torch.arange(cursor, cursor + length)]
                cu_sq.append(cu_sq[-1] + length)
                cu_sk.append(cu_sk[-1] + prefix + length)
                cursor += length
        i32 = dict(dtype=torch.int32, device=dev)
        return dict(
            prefix_idx=torch.cat(prefix_idx).to(dev), suffix_q_idx=torch.cat(suffix_q_idx).to(dev),
            suffix_k_idx=torch.cat(suffix_k_idx).to(dev), cu_p=torch.tensor(cu_p, **i32),
            cu_sq=torch.tensor(cu_sq, **i32), cu_sk=torch.tensor(cu_sk, **i32),
            max_p=max(layout.prefix_lens), max_sq=max(layout.completion_lens),
            max_sk=max(layout.prefix_lens[g] + n for g, n in zip(layout.group_of_completion, layout.completion_lens)),
        )

    return varlen_calls(fn, plan.cached("flash", q.device, build), q, k, v, scale=scale, dropout=dropout)


def _split(plan: GroupedAttentionPlan, q, k, v, scale, dropout):
    if dropout:
        raise NotImplementedError("the split backend has no attention dropout")
    if q.device.type != "cpu":
        raise NotImplementedError("the split backend uses torch's fused CPU attention kernel; on GPU use flash/flex")
    heads = q.shape[0]
    out = torch.empty_like(q)
    for start, prefix, lens in plan.layout.group_spans:
        mid, end = start + prefix, start + prefix + sum(lens)
        out[:, start:mid] = _sdpa(q[:, start:mid], k[:, start:mid], v[:, start:mid], is_causal=True, scale=scale)

        def four_d(x, expand=True):
            return (_expand_kv(x, heads) if expand else x)[None].contiguous()

        out[:, mid:end] = _PrefixPlusOwnAttention.apply(
            four_d(q[:, mid:end], expand=False), four_d(k[:, start:end]), four_d(v[:, start:end]),
            (prefix, list(lens), scale))[0]
    return out


_BACKEND_FNS = {"packed": _packed, "paper": _paper, "masked": _masked, "flex": flex, "flash": _flash,
                "split": _split}


def grouped_attention(plan: GroupedAttentionPlan, query, key, value, scale=None, dropout=0.0) -> torch.Tensor:
    """q [1, H, T, D], k/v [1, Hkv, T, D] of one packed row -> [1, H, T, D]."""
    if query.shape[0] != 1:
        raise ValueError(f"grouped attention expects one packed row (batch 1), got batch {query.shape[0]}")
    if query.shape[2] != plan.layout.total_len:
        raise ValueError(f"packed row has {query.shape[2]} tokens but the layout describes {plan.layout.total_len}")
    backend = family_attention if plan.layout.shares else _BACKEND_FNS[plan.backend]  # families sharing a video
    out = backend(plan, query[0], key[0], value[0], scale, dropout)
    return out[None]


def prefix_grouper_attention(module, query, key, value, attention_mask, *, dropout=0.0, scaling=None,
                             sliding_window=None, **kwargs):
    """transformers ``AttentionInterface`` entry point."""
    plan = kwargs.get(PLAN_KWARG)
    if plan is None:
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME!r} was called without a '{PLAN_KWARG}' plan; run the model "
            "through app.grouping.completion_logprobs, or set the text attention back to 'sdpa'"
        )
    if sliding_window is not None:
        raise NotImplementedError("grouped attention does not support sliding-window layers")
    # one protocol for every plan (a packed row, a decode step, a prefill chunk, a sequence-parallel shard)
    return plan.attend(module, query, key, value, scale=scaling, dropout=dropout if module.training else 0.0), None


def register() -> str:
    """Register the grouped attention with transformers (idempotent). Returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, prefix_grouper_attention)
    return ATTENTION_NAME
