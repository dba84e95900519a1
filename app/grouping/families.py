"""Questions that share a video: one packed row [V; Q1; R11..R1G; Q2; R21..R2G; ...] per family of prompts.

A family is a run of consecutive prompts (groups) that begin with the same tokens V (with Video-R1's template: the
system prompt and the video) and differ after it (Qi: the question). The row holds V once; Qi sees V and its own
earlier tokens; Rij sees V, all of Qi and its own earlier tokens; positions (M-RoPE too) are those of [V; Qi; Rij]
(each prompt's own, computed by the model's ``get_rope_index`` as for [Pi; Rij]); V's media go through the tower
once. So a family's log-probs and every gradient are those of its groups run one by one (or repeated).

- ``shared_prefix_lengths``: V for each family: the members' longest common prefix of real tokens, cut before the
  first media item that is not the very same in every member (pixels, grid) or that V would cut in two, and before
  each member's last token (every Qi keeps at least one);
- ``family_vision``: the row's vision inputs, V's media once (from the first member), then each member's own;
- attention (the ``attention`` module dispatches here when ``layout.shares``): ``split`` (CPU; an exact merge of
  fused-kernel calls by log-sum-exp, no mask), ``masked`` (the dense reference), ``flash`` (varlen calls, V's K/V
  gathered per question as the plain flash backend gathers P per response), ``flex`` (a block mask from per-token
  ids). None of split, flash and flex builds a [T, T] mask. ``packed`` and ``paper`` are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from app.grouping.layout import GroupLayout, LayoutError

SHARING_BACKENDS = ("split", "masked", "flash", "flex")
_MEDIA = (("image", "image_token_id", "pixel_values", "image_grid_thw"),
          ("video", "video_token_id", "pixel_values_videos", "video_grid_thw"))


def family_sizes(keys: Sequence) -> list[int]:
    """Runs of consecutive equal keys (None never joins a run): the families a batch of prompts may form."""
    sizes: list[int] = []
    for i, key in enumerate(keys):
        if i and key is not None and key == keys[i - 1]:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return sizes


def _config(model):
    return getattr(model, "module", model).config  # behind a wrapper (``modules.unwrap``, which imports attention)


def _merge(model) -> int:
    return getattr(getattr(_config(model), "vision_config", None), "spatial_merge_size", 2)


def media_items(model, prompts: Mapping) -> list[list[dict]]:
    """Per prompt, its media items in token order: modality, first and last token (in the prompt's real tokens),
    pixel rows, grid row and (Qwen2.5-VL videos) its second_per_grid_ts."""
    config = _config(model)
    merge = _merge(model)
    ids, mask = prompts["input_ids"], prompts["attention_mask"].bool()
    out: list[list[dict]] = [[] for _ in range(ids.shape[0])]
    from app.grouping.media import item_rows, share_of

    for kind, token_key, pixel_key, grid_key in _MEDIA:
        grid = prompts.get(grid_key)
        if grid is None:
            continue
        token = getattr(config, token_key)
        patch_counts = grid.prod(-1).tolist()
        rows = item_rows(prompts, pixel_key)  # a family's pixels may be held once for all its questions
        held = share_of(prompts, pixel_key)  # or only this rank's share of them (sequence parallelism)
        item = 0
        for b in range(ids.shape[0]):
            where = (ids[b][mask[b]] == token).nonzero().flatten().tolist()
            cursor = 0
            while cursor < len(where):
                if item >= len(patch_counts):
                    raise LayoutError(f"prompt {b} has more {kind} tokens than its {grid_key} rows describe")
                count = patch_counts[item] // (merge * merge)
                span = where[cursor : cursor + count]
                entry = {"kind": kind, "first": span[0], "last": span[-1], "grid": grid[item],
                         "pixels": prompts[pixel_key][rows[item][0] : rows[item][1]], "index": item, "held": held}
                if kind == "video" and prompts.get("second_per_grid_ts") is not None:
                    entry["seconds"] = prompts["second_per_grid_ts"][item]
                out[b].append(entry)
                cursor += count
                item += 1
    for items in out:
        items.sort(key=lambda e: e["first"])
    return out


def _same_item(a: dict, b: dict) -> bool:
    pa, pb = a["pixels"], b["pixels"]
    held_once = pa.data_ptr() == pb.data_ptr() and pa.shape == pb.shape and pa.stride() == pb.stride()
    same = (a["kind"] == b["kind"] and a["first"] == b["first"] and a["last"] == b["last"]
            and torch.equal(a["grid"], b["grid"]) and pa.shape == pb.shape and (held_once or torch.equal(pa, pb)))
    if same and "seconds" in a:
        same = "seconds" in b and torch.equal(a["seconds"], b["seconds"])
    return same


def shared_prefix_lengths(model, prompts: Mapping, families: Sequence[int]) -> list[int]:
    """Per family, the prompt tokens its members share (V; 0 for a family of one). See the module doc."""
    ids, mask = prompts["input_ids"], prompts["attention_mask"].bool()
    items = media_items(model, prompts) if any(size > 1 for size in families) else None
    out, g = [], 0
    for size in families:
        members = list(range(g, g + size))
        g += size
        if size == 1:
            out.append(0)
            continue
        rows = [ids[m][mask[m]] for m in members]
        length = min(len(r) for r in rows) - 1  # every question keeps one token of its own
        for row in rows[1:]:
            differ = (row[:length] != rows[0][:length]).nonzero()
            if len(differ):
                length = int(differ[0, 0])
        for entry in items[members[0]]:
            if entry["first"] >= length:
                break
            twins = [next((e for e in items[m] if e["first"] == entry["first"]), None) for m in members[1:]]
            if entry["last"] >= length or any(t is None or not _same_item(entry, t) for t in twins):
                length = entry["first"]  # V stops before a media item it would cut or that is not the same
                break
        out.append(max(length, 0))
    return out


def family_vision(model, prompts: Mapping, layout: GroupLayout) -> dict:
    """The packed row's vision inputs: for each family V's items once (the first member's), then each member's
    items after V, per modality in row order (the order the model places features on placeholders)."""
    keys = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
    if not any(prompts.get(k) is not None for k in keys):
        return {}
    items = media_items(model, prompts)
    chosen, g = [], 0
    for size, shared in zip(layout.families, layout.shared_lens):
        chosen += [e for e in items[g] if e["first"] < shared]
        for m in range(g, g + size):
            chosen += [e for e in items[m] if e["first"] >= shared]
        g += size
    return vision_of_items(chosen)


def family_layout(model, prompts: Mapping, completion_mask, group_sizes, families: Sequence[int] | None):
    """The packed row's ``GroupLayout`` and, when its families share media, the row's vision inputs (V's items once,
    ``family_vision``; None: the prompts' own). No family of more than one prompt: the plain grouped layout."""
    if families is None or not any(size > 1 for size in families):
        return GroupLayout.from_masks(prompts["attention_mask"], completion_mask, group_sizes), None
    shared = shared_prefix_lengths(model, prompts, families)
    layout = GroupLayout.from_masks(prompts["attention_mask"], completion_mask, group_sizes, families, shared)
    return layout, (family_vision(model, prompts, layout) if layout.shares else None)


def vision_of_items(items: list[dict]) -> dict:
    """The processor's vision tensors of some ``media_items`` entries, per modality in the order given."""
    out: dict = {}
    for kind, _, pixel_key, grid_key in _MEDIA:
        mine = [e for e in items if e["kind"] == kind]
        if mine:  # one item: its rows of the batch's pixels as they are (a view: a long video is not copied)
            out[pixel_key] = mine[0]["pixels"] if len(mine) == 1 else torch.cat([e["pixels"] for e in mine])
            out[grid_key] = torch.stack([e["grid"] for e in mine])
            if mine[0].get("held") is not None:  # a rank's share of the pixels: the split tower takes them as held
                from app.grouping.media import SHARE

                out[SHARE[pixel_key]] = torch.tensor(mine[0]["held"])
            if kind == "video" and "seconds" in mine[0]:
                out["second_per_grid_ts"] = torch.stack([e["seconds"] for e in mine])
    return out


def check_shared_positions(layout: GroupLayout, prompt_pos: torch.Tensor) -> None:
    """Every member of a family must place V at the same ids (the model's own positions; they always agree when
    V's tokens and media are the same, so a difference is a fault worth stopping on)."""
    width, g = layout.prompt_width, 0
    for f, (size, shared) in enumerate(zip(layout.families, layout.shared_lens)):
        if shared:
            first = prompt_pos[:, g, width - layout.prefix_lens[g] : width - layout.prefix_lens[g] + shared]
            for m in range(g + 1, g + size):
                start = width - layout.prefix_lens[m]
                if not torch.equal(prompt_pos[:, m, start : start + shared], first):
                    raise LayoutError(f"family {f}: prompt {m} places the shared tokens at other positions than "
                                      f"prompt {g}")
        g += size


# ---- attention ---------------------------------------------------------------------------------------------------
def dense_family_mask(layout: GroupLayout, device) -> torch.Tensor:
    """[T, T] boolean: causal, same family, and a V key, or a key of the query's group that is its prompt or the
    query's own response (the reference semantics; the plain layout's ``dense_group_mask`` when nothing is shared)."""
    seg, grp = layout.segment_ids.to(device), layout.group_ids.to(device)
    fam, shared = layout.family_ids.to(device), layout.shared_ids.to(device)
    idx = torch.arange(layout.total_len, device=device)
    own = (grp[:, None] == grp[None, :]) & ((seg[None, :] == 0) | (seg[None, :] == seg[:, None]))
    return (idx[None, :] <= idx[:, None]) & (fam[:, None] == fam[None, :]) & ((shared[None, :] > 0) | own)


def family_mask_mod(segment_ids, group_ids, family_ids, shared_ids):
    """FlexAttention's form of ``dense_family_mask`` (per-token vectors only)."""

    def mask_mod(b, h, qi, ki):
        own = (group_ids[qi] == group_ids[ki]) & ((segment_ids[ki] == 0) | (segment_ids[ki] == segment_ids[qi]))
        return (ki <= qi) & (family_ids[qi] == family_ids[ki]) & ((shared_ids[ki] > 0) | own)

    return mask_mod


def family_parts(shared: int, members: list[tuple[int, list[int]]]) -> list[tuple[int, int, int, int, bool]]:
    """The fused-kernel calls of one sharing family, as (query start, query end, key start, key end, causal) in
    the family's span: V causally; every token after V against V (one call); each question with its responses
    against the question (causal from the top left: the question causally, its responses all of it); each
    response against itself, causally. Their log-sum-exp merge is the family's attention exactly."""
    end = shared + sum(q + sum(lens) for q, lens in members)
    parts = [(0, shared, 0, shared, True), (shared, end, 0, shared, False)]
    cursor = shared
    for question, lens in members:
        parts.append((cursor, cursor + question + sum(lens), cursor, cursor + question, True))
        cursor += question
        for length in lens:
            parts.append((cursor, cursor + length, cursor, cursor + length, True))
            cursor += length
    return parts


class _MergedParts(torch.autograd.Function):
    """Softmax over the union of several key spans per query, each span one fused CPU call, merged exactly by
    log-sum-exp; the backward hands each call the merged output and log-sum-exp (as ``_PrefixPlusOwnAttention``
    does for two parts), so every call's gradient is that of the joint softmax."""

    @staticmethod
    def forward(ctx, q, k, v, geometry):
        parts, scale = geometry  # (q0, q1, k0, k1, causal) in the span; the softmax scale
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        ctx.dtype = q.dtype
        if q.dtype in (torch.bfloat16, torch.float16):  # merge in float32, round once at the end
            q, k, v = q.float(), k.float(), v.float()
        lse = q.new_full((1, q.shape[1], q.shape[2]), float("-inf"))  # q's dtype: float32 or float64 from here on
        results = []
        for q0, q1, k0, k1, causal in parts:
            o, part_lse = flash(q[:, :, q0:q1].contiguous(), k[:, :, k0:k1].contiguous(),
                                v[:, :, k0:k1].contiguous(), 0.0, causal, scale=scale)[:2]
            results.append((o, part_lse.to(q.dtype)))
            lse[:, :, q0:q1] = torch.logaddexp(lse[:, :, q0:q1], part_lse.to(q.dtype))
        out = torch.zeros_like(q)
        for (q0, q1, _, _, _), (o, part_lse) in zip(parts, results):
            out[:, :, q0:q1] += torch.exp(part_lse - lse[:, :, q0:q1])[..., None] * o.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.parts, ctx.scale = parts, scale
        return out.to(ctx.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad_out = grad_out.to(q.dtype)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for q0, q1, k0, k1, causal in ctx.parts:
            gq, gk, gv = backward(grad_out[:, :, q0:q1].contiguous(), q[:, :, q0:q1].contiguous(),
                                  k[:, :, k0:k1].contiguous(), v[:, :, k0:k1].contiguous(),
                                  out[:, :, q0:q1].contiguous(), lse[:, :, q0:q1].contiguous(), 0.0,
                                  causal, scale=ctx.scale)
            dq[:, :, q0:q1] += gq
            dk[:, :, k0:k1] += gk
            dv[:, :, k0:k1] += gv
        dtype = ctx.dtype
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None


def family_split(plan, q, k, v, scale, dropout):
    """The ``split`` backend over a layout whose families share V: q [H, T, D], k/v [Hkv, T, D] -> [H, T, D].
    A family of one without sharing runs the plain backend's two calls (the same numbers as without families)."""
    from app.grouping.kernels import _expand_kv, _PrefixPlusOwnAttention, _sdpa

    if dropout:
        raise NotImplementedError("the split backend has no attention dropout")
    if q.device.type != "cpu":
        raise NotImplementedError("the split backend uses torch's fused CPU attention kernel; on GPU use flash/flex")
    heads = q.shape[0]
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for start, shared, members in plan.layout.family_spans:
        if not shared:  # prompts that share nothing: the plain split backend's two calls for each
            for prefix, lens in members:
                mid, end = start + prefix, start + prefix + sum(lens)
                out[:, start:mid] = _sdpa(q[:, start:mid], k[:, start:mid], v[:, start:mid], is_causal=True,
                                          scale=scale)
                out[:, mid:end] = _PrefixPlusOwnAttention.apply(
                    q[None, :, mid:end].contiguous(), _expand_kv(k[:, start:end], heads)[None].contiguous(),
                    _expand_kv(v[:, start:end], heads)[None].contiguous(), (prefix, list(lens), scale))[0]
                start = end
            continue
        end = start + shared + sum(n + sum(lens) for n, lens in members)
        keys, values = _expand_kv(k[:, start:end], heads)[None], _expand_kv(v[:, start:end], heads)[None]
        out[:, start:end] = _MergedParts.apply(q[None, :, start:end], keys, values,
                                               (family_parts(shared, members), scale))[0]
    return out


def family_masked(plan, q, k, v, scale, dropout):
    from app.grouping.kernels import _sdpa

    mask = plan.cached("dense-family", q.device, lambda: dense_family_mask(plan.layout, q.device))
    return _sdpa(q, k, v, mask=mask, scale=scale, dropout=dropout)


def family_flex(plan, q, k, v, scale, dropout):
    from app.grouping.flex import FLEX_ALTERNATIVE, block_mask_from, run_flex

    if dropout:
        raise NotImplementedError("the flex backend has no attention dropout")
    layout = plan.layout

    def build():
        vectors = [layout.segment_ids, layout.group_ids, layout.family_ids, layout.shared_ids]
        return block_mask_from(family_mask_mod, vectors, layout.total_len, q.device)

    block_mask = plan.cached("flex-family", q.device, build)
    return run_flex(q[None], k[None], v[None], block_mask, scale, alternative=FLEX_ALTERNATIVE)[0]


def flash_sequences(layout: GroupLayout) -> tuple[list[range], list[tuple[range, list[range]]]]:
    """The flash backend's two varlen calls: the causal self-attention spans (each family's V, or a plain group's
    P), and the (query span, key spans) pairs aligned bottom-right: a question against [V; Q], a response against
    [V; Q; R] (plain: [P; R])."""
    first, second = [], []
    for start, shared, members in layout.family_spans:
        cursor = start + shared
        if shared:
            first.append(range(start, start + shared))
        for question, lens in members:
            q_span = range(cursor, cursor + question)
            if shared:
                second.append((q_span, [range(start, start + shared), q_span]))
            else:
                first.append(q_span)
            cursor += question
            seen = [range(start, start + shared), q_span] if shared else [q_span]
            for length in lens:
                own = range(cursor, cursor + length)
                second.append((own, [*seen, own]))
                cursor += length
    return first, second


def family_flash(plan, q, k, v, scale, dropout):
    from app.grouping.kernels import flash_varlen_fn, varlen_calls

    fn = plan.varlen_fn if plan.varlen_fn is not None else flash_varlen_fn(q)

    def build():
        dev = q.device
        first, second = flash_sequences(plan.layout)
        cu_p = torch.tensor([0, *torch.tensor([len(r) for r in first]).cumsum(0).tolist()], dtype=torch.int32)
        q_lens = [len(qs) for qs, _ in second]
        k_lens = [sum(len(r) for r in ks) for _, ks in second]
        index = lambda spans: torch.cat([torch.arange(r.start, r.stop) for r in spans]).to(dev)  # noqa: E731
        return dict(prefix_idx=index(first), cu_p=cu_p.to(dev), max_p=max(len(r) for r in first),
                    suffix_q_idx=index([qs for qs, _ in second]), suffix_k_idx=index([r for _, ks in second for r in ks]),
                    cu_sq=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32).to(dev),
                    cu_sk=torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32).to(dev),
                    max_sq=max(q_lens), max_sk=max(k_lens))

    return varlen_calls(fn, plan.cached("flash-family", q.device, build), q, k, v, scale=scale, dropout=dropout)


FAMILY_BACKEND_FNS = {"split": family_split, "masked": family_masked, "flex": family_flex, "flash": family_flash}


def family_attention(plan, q, k, v, scale, dropout):
    """q [H, T, D], k/v [Hkv, T, D] of a row whose families share V -> [H, T, D]."""
    fn = FAMILY_BACKEND_FNS.get(plan.backend)
    if fn is None:
        raise LayoutError(f"attention backend {plan.backend!r} does not share a video across questions; use one of "
                          f"{', '.join(SHARING_BACKENDS)} (forward.attention_backend), or data.questions_per_video=1")
    return fn(plan, q, k, v, scale, dropout)
