"""Attention backends against a naive per-query reference, and against the paper's `prefix-grouper` package."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.grouping import GroupedAttentionPlan, GroupLayout, grouped_attention

CPU_BACKENDS = ("packed", "paper", "masked", "split", "flash")


def naive_attention(layout: GroupLayout, q, k, v):
    """Loop over queries; each sees exactly the keys the grouped semantics allow. q [1,H,T,D], k/v [1,Hkv,T,D]."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    seg, grp = layout.segment_ids.tolist(), layout.group_ids.tolist()
    rows = []
    for i in range(layout.total_len):
        allowed = [j for j in range(i + 1) if grp[j] == grp[i] and (seg[j] == 0 or seg[j] == seg[i])]
        scores = q[0, :, i : i + 1] @ k[0, :, allowed].transpose(-1, -2) / q.shape[-1] ** 0.5
        rows.append(torch.softmax(scores, dim=-1) @ v[0, :, allowed])
    return torch.cat(rows, dim=1)[None]


def sdpa_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=True):
    """Stand-in for flash_attn_varlen_func (same signature and bottom-right causal alignment) for CPU tests."""
    outs = []
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1)
        ki = k[cu_k[i] : cu_k[i + 1]].transpose(0, 1)
        vi = v[cu_k[i] : cu_k[i + 1]].transpose(0, 1)
        rep = qi.shape[0] // ki.shape[0]
        ki, vi = ki.repeat_interleave(rep, 0), vi.repeat_interleave(rep, 0)
        mask = torch.ones(qi.shape[1], ki.shape[1], dtype=torch.bool).tril(ki.shape[1] - qi.shape[1])
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale).transpose(0, 1))
    return torch.cat(outs)


@st.composite
def layouts(draw):
    groups = draw(st.integers(1, 3))
    sizes = tuple(draw(st.integers(1, 4)) for _ in range(groups))
    prefixes = tuple(draw(st.integers(1, 12)) for _ in range(groups))
    completions = tuple(draw(st.integers(1, 8)) for _ in range(sum(sizes)))
    return GroupLayout(sizes, prefixes, completions, max(prefixes), max(completions))


def qkv(layout, heads, kv_heads, dim=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape_q, shape_kv = (1, heads, layout.total_len, dim), (1, kv_heads, layout.total_len, dim)
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in (shape_q, shape_kv, shape_kv)]


def check_backends(layout, heads, seed, backends, reference) -> None:
    """Each backend's output and q/k/v gradients equal ``reference``'s (float64, 1e-10) on random inputs."""
    q, k, v = qkv(layout, *heads, seed=seed)
    expected = reference(layout, q, k, v)
    weight = torch.randn(expected.shape, generator=torch.Generator().manual_seed(seed), dtype=expected.dtype)
    expected_grads = torch.autograd.grad((expected * weight).sum(), (q, k, v))
    for backend in backends:
        plan = GroupedAttentionPlan(layout, backend, varlen_fn=sdpa_varlen if backend == "flash" else None)
        out = grouped_attention(plan, q, k, v)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10, msg=f"{backend} output")
        grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
        for name, got, want in zip("qkv", grads, expected_grads):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"{backend} d{name}")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(), heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]), seed=st.integers(0, 2**16))
def test_backends_match_naive_reference(layout, heads, seed):
    check_backends(layout, heads, seed, CPU_BACKENDS, naive_attention)


def test_flex_forward_on_cpu():
    """FlexAttention runs forward on CPU (compiled); its backward needs CUDA, where the same code runs."""
    layout = GroupLayout((1, 3, 2), (5, 7, 3), (2, 1, 4, 3, 1, 6), 7, 6)
    q, k, v = (t.detach() for t in qkv(layout, 4, 2, dim=16, dtype=torch.float32))
    out = grouped_attention(GroupedAttentionPlan(layout, "flex"), q, k, v)
    torch.testing.assert_close(out, naive_attention(layout, q, k, v), rtol=1e-5, atol=1e-5)


def random_layout(rng, max_prefix=300, max_response=90):
    prefixes = [rng.randint(1, max_prefix) for _ in range(rng.randint(1, 3))]
    sizes = [rng.randint(1, 4) for _ in prefixes]
    lens = [rng.randint(1, max_response) for _ in range(sum(sizes))]
    width = max(prefixes)
    prompt_mask = (torch.arange(width)[None] >= width - torch.tensor(prefixes)[:, None]).long()
    completion_mask = (torch.arange(max(lens))[None] < torch.tensor(lens)[:, None]).long()
    return GroupLayout.from_masks(prompt_mask, completion_mask, sizes)


def test_flex_block_mask_equals_create_block_mask():
    """The block mask built block row by block row (no T x T tensor) is torch's own, including T < one block."""
    from torch.nn.attention.flex_attention import create_block_mask

    from app.grouping.flex import flex_block_mask, flex_mask_mod

    rng = random.Random(0)
    for case in range(12):
        layout = random_layout(rng, max_prefix=30 if case < 3 else 300)
        length = layout.total_len
        ours = flex_block_mask(layout, "cpu", rows_per_chunk=256)
        torch_mask = create_block_mask(flex_mask_mod(layout.segment_ids, layout.group_ids), None, None, length,
                                       length, device="cpu")
        assert torch.equal(ours.to_dense(), torch_mask.to_dense()), case
        assert torch.equal(ours.kv_num_blocks, torch_mask.kv_num_blocks), case


def test_flex_compiles_once_for_many_packed_lengths():
    """GRPO packs a new length every step: 16 layouts compile a bounded number of times, never run unfused."""
    from torch._dynamo.utils import counters

    rng = random.Random(1)
    layouts = [random_layout(rng) for _ in range(16)]
    assert len({layout.total_len for layout in layouts}) >= 14
    before = counters["stats"]["unique_graphs"]
    for layout in layouts:
        q, k, v = (t.detach() for t in qkv(layout, 4, 2, dim=16, dtype=torch.float32))
        out = grouped_attention(GroupedAttentionPlan(layout, "flex"), q, k, v)
    assert counters["stats"]["unique_graphs"] - before <= 2
    torch.testing.assert_close(out, naive_attention(layout, q, k, v), rtol=1e-5, atol=1e-5)


def test_flex_refuses_the_unfused_fallback(monkeypatch):
    """If FlexAttention would run uncompiled (O(T^2) scores), the backend stops with a named alternative, every
    time (torch itself warns only once per process)."""
    from torch.nn.attention.flex_attention import flex_attention

    import app.grouping.flex as flex_module

    monkeypatch.setattr(flex_module, "compiled_flex_attention", lambda: flex_attention)
    layout = random_layout(random.Random(2), max_prefix=20, max_response=5)
    q, k, v = (t.detach() for t in qkv(layout, 4, 2, dim=16, dtype=torch.float32))
    for _ in range(2):
        with pytest.raises(flex_module.FlexCompileError, match="attention_backend=flash"):
            grouped_attention(GroupedAttentionPlan(layout, "flex"), q, k, v)


def test_matches_prefix_grouper_package():
    """Same q/k/v through the paper's library (its AttentionForward with an SDPA attention function) and ours."""
    from prefix_grouper import PrefixGrouper
    from prefix_grouper.forward import AttentionForward

    layout = GroupLayout((2, 3, 1), (9, 4, 6), (3, 5, 1, 7, 2, 4), 9, 7)
    heads = 4
    q, k, v = (t.detach() for t in qkv(layout, heads, heads, dim=16, dtype=torch.float32, seed=3))

    # The package's layout: one right-padded row per group, [P; R1; ...; RG].
    width = max(p + sum(ls) for _, p, ls in layout.group_spans)
    def to_rows(x):
        rows = torch.zeros(layout.num_groups, x.shape[1], width, x.shape[3])
        for g, (start, prefix, lens) in enumerate(layout.group_spans):
            rows[g, :, : prefix + sum(lens)] = x[0, :, start : start + prefix + sum(lens)]
        return rows

    def attn_func(q_, k_, v_, padding_mask):
        # padding_mask [b, Lk]; queries are the last Lq keys' positions (bottom-right causal alignment).
        lq, lk = q_.shape[2], k_.shape[2]
        causal = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        mask = causal[None, None] & padding_mask[:, None, None, :].bool()
        diagonal = torch.zeros(lq, lk, dtype=torch.bool)
        diagonal[torch.arange(lq), torch.arange(lq) + lk - lq] = True
        mask = mask | diagonal  # padded query rows stay finite (they are dropped by the package)
        return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask).transpose(1, 2)

    group_info = [[prefix, *lens] for _, prefix, lens in layout.group_spans]
    grouper = PrefixGrouper(group_info, device="cpu", padding_mode="right")
    theirs = AttentionForward(attn_func)(grouper, to_rows(q), to_rows(k), to_rows(v))  # [b, L, H, D]
    ours = grouped_attention(GroupedAttentionPlan(layout, "packed"), q, k, v)  # [1, H, T, D]
    for g, (start, prefix, lens) in enumerate(layout.group_spans):
        length = prefix + sum(lens)
        torch.testing.assert_close(ours[0, :, start : start + length].transpose(0, 1), theirs[g, :length],
                                   rtol=1e-5, atol=1e-6)


def test_attention_without_plan_is_refused():
    from app.grouping.attention import prefix_grouper_attention

    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="without a 'prefix_grouping' plan"):
        prefix_grouper_attention(torch.nn.Module(), q, q, q, None)


def test_unknown_backend_is_refused():
    layout = GroupLayout((1,), (2,), (1,), 2, 1)
    with pytest.raises(ValueError, match="unknown grouped-attention backend 'fast'"):
        GroupedAttentionPlan(layout, "fast")


def test_packed_backend_chunks_long_responses():
    from app.grouping.attention import response_chunks

    assert response_chunks(8, [3, 3, 3, 1]) == [[3, 3], [3, 1]]
    assert response_chunks(2, [5, 1, 1, 4]) == [[5], [1, 1], [4]]
    layout = GroupLayout((4, 2), (2, 9), (5, 1, 1, 4, 3, 8), 9, 8)
    q, k, v = qkv(layout, 4, 2, seed=11)
    expected = naive_attention(layout, q, k, v)
    out = grouped_attention(GroupedAttentionPlan(layout, "packed"), q, k, v)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v))):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
