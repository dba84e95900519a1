"""Sequence parallelism around the grouped forward (Ulysses): S ranks hold one batch's packed row [P;R1..RG], each
a contiguous 1/S shard of it, and together give the log-probs the one-rank grouped forward gives.

- **Attention.** Each decoder layer's q/k/v of the local shard go through one all-to-all: sequence shards become
  head shards, so every rank holds the WHOLE row for H/S query heads (and their KV heads), runs the ordinary grouped
  attention (any backend: the layout is the whole row's) and sends the result back by the inverse all-to-all.
  With fewer KV heads than S (Qwen2.5-VL-7B: 4 KV heads, 28 query heads) each KV head is repeated S/Hkv times
  first, so rank r's query heads keep their own KV head. gloo's all-to-all needs equal pieces: shards are padded
  to the longest for the exchange and the padding is dropped on arrival (never attended to).
- **Positions.** The packed row's ids (M-RoPE included) are computed once for the whole row, as on one rank, and
  each rank takes its slice: they are exact by construction.
- **Vision tower.** Each video's temporal patches are split across the S ranks (contiguous ranges; whole images go
  round-robin), each rank runs the tower on its share, and the embeddings are summed into the full table on every
  rank (the pieces are disjoint). Exact because Qwen's vision attention never crosses a temporal patch: Qwen2-VL and
  Qwen3-VL blocks attend within one temporal patch (``cu_seqlens`` = h*w per t), Qwen2.5-VL's windowed blocks within
  a window of one temporal patch and its full-attention blocks (``fullatt_block_indexes``) within one temporal
  patch too; their 2-D rotary / learned position embeddings repeat per temporal patch. Tested: a split tower equals
  the whole one. A frozen tower (no parameter needing a gradient) runs under ``no_grad``.
- **Scores.** Each rank computes the output head only for the positions in its shard; the per-token log-probs
  are then summed across the group (each token is scored by exactly one rank), so every rank holds all of them and
  computes the same loss. Backward sends each rank's share of the gradient to the tokens it scored, so a rank's
  parameter gradients are its shard's part of the whole: the sum over the SP group is the one-rank gradient.
  Whoever averages gradients over the world needs them scaled by S (``SequenceParallel.for_averaging``).

Knows nothing of GRPO; ``SequenceParallel(group, rank, size)`` says who the shard's peers are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from app.grouping import attention
from app.grouping.layout import GroupLayout, LayoutError
from app.grouping.modules import patched, set_text_attention, text_config, unwrap
from app.grouping.positions import check_max_positions, packed_positions, prompt_positions


@dataclass(frozen=True)
class SequenceParallel:
    """The sequence-parallel group this rank belongs to (``group`` None = the default group).

    ``grad_scale`` multiplies the gradient that flows back into each rank's share: 1 leaves the SP group's parts
    summing to the one-rank gradient; ``size`` (``for_averaging``) makes them AVERAGE to it, for a data-parallel
    engine (DeepSpeed, DDP) that averages gradients over every rank of the world."""

    rank: int
    size: int
    group: object = None
    grad_scale: float = 1.0

    def for_averaging(self) -> SequenceParallel:
        """The same group, its gradients scaled so that averaging over the world's ranks gives the data-parallel
        mean of whole-row gradients: (S/W) * sum of all parts = (1/(W/S)) * sum over the W/S data-parallel ranks."""
        return SequenceParallel(self.rank, self.size, self.group, float(self.size))


def check_heads(config, size: int) -> None:
    """Refuse, before any work, a model whose attention heads cannot be shared out over ``size`` ranks: query heads
    must divide by S, and KV heads too or S by them (each KV head then repeated)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % size or (kv_heads % size and size % kv_heads):
        raise ValueError(f"sequence parallelism over {size} ranks needs the {heads} query heads divisible by {size} "
                         f"and the {kv_heads} KV heads divisible by it or dividing it; this model has "
                         f"{heads} query heads and {kv_heads} KV heads (train.sequence_parallel_size={size})")


def shard_bounds(total: int, size: int) -> list[tuple[int, int]]:
    """Contiguous near-equal shards of ``total`` tokens over ``size`` ranks (the first ones one longer)."""
    if total < size:
        raise LayoutError(f"a packed row of {total} tokens cannot be split over {size} sequence-parallel ranks")
    base, extra = divmod(total, size)
    bounds, start = [], 0
    for r in range(size):
        end = start + base + (r < extra)
        bounds.append((start, end))
        start = end
    return bounds


# ---- collectives with the gradients each one needs -----------------------------------------------------------


def _exchange(pieces: list[torch.Tensor], receive_lens: list[int], dim: int, sp: SequenceParallel) -> list[torch.Tensor]:
    """all-to-all of ``pieces`` (piece j to rank j) that may differ in length along ``dim``: padded to the
    longest for the exchange (gloo needs equal sizes), cut back to ``receive_lens[j]`` on arrival. Differentiable."""
    from torch.distributed.nn.functional import all_to_all

    longest = max(max(p.shape[dim] for p in pieces), max(receive_lens))

    def pad(x):
        if x.shape[dim] == longest:
            return x.contiguous()
        shape = list(x.shape)
        shape[dim] = longest - x.shape[dim]
        return torch.cat([x, x.new_zeros(shape)], dim=dim).contiguous()

    padded = [pad(p) for p in pieces]
    outputs = [torch.empty_like(padded[0]) for _ in range(sp.size)]
    got = all_to_all(outputs, padded, group=sp.group)
    return [g.narrow(dim, 0, n) for g, n in zip(got, receive_lens)]


class _SumScored(torch.autograd.Function):
    """Forward: the SP group's sum of tensors that are each zero except where their own rank scored (so every
    rank holds all values). Backward: the incoming gradient as it is (times ``scale``), since every rank computes
    the same loss from the sum and each rank's part only reaches the entries it scored."""

    @staticmethod
    def forward(ctx, x, group, scale=1.0):
        ctx.scale = scale
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (grad * ctx.scale if ctx.scale != 1.0 else grad), None, None


class _SumPieces(torch.autograd.Function):
    """Forward: the SP group's sum of disjoint pieces (each rank's tower output placed in the full table).
    Backward: the SUM of every rank's gradient of the table, since each rank used a different part of it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


# ---- attention -------------------------------------------------------------------------------------------------


@dataclass
class SequenceParallelPlan:
    """The attention plan of one rank's shard: the whole row's grouped plan plus who holds which shard."""

    inner: attention.GroupedAttentionPlan
    sp: SequenceParallel
    bounds: list[tuple[int, int]]

    def attend(self, module, query, key, value, *, scale=None, dropout=0.0) -> torch.Tensor:
        """The attention-plan protocol (``attention.GroupedAttentionPlan.attend``): -> [1, t, H, D]."""
        return self.shard_attention(query, key, value, scale, dropout).transpose(1, 2).contiguous()

    def shard_attention(self, query, key, value, scale=None, dropout=0.0) -> torch.Tensor:
        """q [1, H, t, D], k/v [1, Hkv, t, D] of this rank's shard -> [1, H, t, D] (Ulysses)."""
        size = self.sp.size
        heads, kv_heads = query.shape[1], key.shape[1]
        if heads % size:
            raise LayoutError(f"{heads} attention heads cannot be split over {size} sequence-parallel ranks")
        if kv_heads % size:
            if size % kv_heads:
                raise LayoutError(f"{kv_heads} KV heads cannot be shared out over {size} sequence-parallel ranks")
            key = key.repeat_interleave(size // kv_heads, dim=1)  # rank r's query heads keep their KV head
            value = value.repeat_interleave(size // kv_heads, dim=1)
        lengths = [end - start for start, end in self.bounds]
        mine = lengths[self.sp.rank]

        def to_heads(x):  # [1, h, t_mine, D] -> [1, h/S, T, D]
            return torch.cat(_exchange(list(x.chunk(size, dim=1)), lengths, 2, self.sp), dim=2)

        out = attention.grouped_attention(self.inner, to_heads(query), to_heads(key), to_heads(value), scale,
                                          dropout)
        back = _exchange(list(out.split(lengths, dim=2)), [mine] * size, 2, self.sp)
        return torch.cat(back, dim=1)


# ---- vision tower sharded by frames ----------------------------------------------------------------------------


def _tower_output(result):
    """(merged embeddings, deepstack list or None) from a vision tower's output (transformers 5.x or a tuple)."""
    if hasattr(result, "pooler_output"):
        return result.pooler_output, getattr(result, "deepstack_features", None)
    if isinstance(result, tuple):
        return result[0], (list(result[1]) if len(result) > 1 else None)
    return result, None


def _modality_embeddings(model, pixels, grid, sp: SequenceParallel, split_time: bool):
    """The tower's embeddings of every item of one modality (and Qwen3-VL's deepstack features), computed with
    each rank running its share: temporal patches split across ranks for videos, whole items for images."""
    visual = unwrap(model).model.visual
    merge = visual.spatial_merge_size
    grid_rows = grid.tolist()
    patch_start, token_start = [], []
    p = k = 0
    for t, h, w in grid_rows:
        patch_start.append(p)
        token_start.append(k)
        p += t * h * w
        k += t * h * w // (merge * merge)
    total_tokens = k
    pieces = []  # (patch rows, sub-grid, token rows) of this rank
    for i, (t, h, w) in enumerate(grid_rows):
        if split_time:
            start, end = shard_bounds(t, sp.size)[sp.rank] if t >= sp.size else \
                ((0, t) if sp.rank == i % sp.size else (0, 0))
        else:
            start, end = (0, t) if sp.rank == i % sp.size else (0, 0)
        if end > start:
            per_t = h * w
            rows = slice(patch_start[i] + start * per_t, patch_start[i] + end * per_t)
            tokens = slice(token_start[i] + start * per_t // (merge * merge), token_start[i] + end * per_t // (merge * merge))
            pieces.append((rows, [end - start, h, w], tokens))
    trains = any(p.requires_grad for p in visual.parameters())
    hidden = text_config(model).hidden_size
    dtype = next(visual.parameters()).dtype
    table = pixels.new_zeros(total_tokens, hidden, dtype=dtype)
    deep_tables = None
    with torch.set_grad_enabled(trains and torch.is_grad_enabled()):
        if pieces:
            local_pixels = torch.cat([pixels[r] for r, _, _ in pieces]).to(dtype)
            local_grid = torch.tensor([g for _, g, _ in pieces], dtype=grid.dtype, device=grid.device)
            embeds, deep = _tower_output(visual(local_pixels, grid_thw=local_grid))
        else:  # no share here (fewer temporal patches or images than ranks): the tower still runs once, on a
            # minimal dummy input whose output enters as exactly 0, so every rank makes the same module calls
            # (ZeRO-3 gathers parameters per call) and the backward reaches the tower on every rank
            from app.grouping.vision.calls import _zero_of
            from app.grouping.vision.passes import dummy_vision_input

            dummy_pixels, dummy_grid = dummy_vision_input(visual)
            zero = _zero_of(visual(dummy_pixels.to(pixels.device, dtype), grid_thw=dummy_grid.to(grid.device)))
            if zero is not None:
                table = table + zero.to(table.dtype)
    if pieces:
        table = table.to(embeds.dtype)
        index = torch.cat([torch.arange(t.start, t.stop, device=embeds.device) for _, _, t in pieces])
        table = table.index_copy(0, index, embeds)
        if deep is not None:
            deep_tables = [table.new_zeros(total_tokens, d.shape[-1]).index_copy(0, index, d) for d in deep]
    deep_count = _deepstack_count(visual)
    if deep_tables is None and deep_count:
        deep_tables = [table.new_zeros(total_tokens, hidden) for _ in range(deep_count)]
    if trains and torch.is_grad_enabled():  # a rank without frames still joins the backward's all-reduce
        table = table if table.requires_grad else table.requires_grad_()
        deep_tables = deep_tables and [d if d.requires_grad else d.requires_grad_() for d in deep_tables]
    table = _SumPieces.apply(table, sp.group)
    if deep_tables is not None:
        deep_tables = [_SumPieces.apply(d, sp.group) for d in deep_tables]
    return table, deep_tables


def _deepstack_count(visual) -> int:
    return len(getattr(visual, "deepstack_visual_indexes", None) or getattr(visual.config, "deepstack_visual_indexes", None) or [])


# ---- the forward ---------------------------------------------------------------------------------------------


def sequence_parallel_logprobs(model, prompts: Mapping, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                               group_sizes: Sequence[int] | int, sp: SequenceParallel, *, backend: str | None = None,
                               temperature: float = 1.0):
    """Per-token log-probs [N, Lc] of the completions (0 at padding), equal on every rank of ``sp``, from this
    rank's shard of the packed row. Every rank of the group must pass the same inputs."""
    return sequence_parallel_scores(model, prompts, completion_ids, completion_mask, group_sizes, sp,
                                    backend=backend, temperature=temperature).logprobs


def sequence_parallel_scores(model, prompts: Mapping, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                             group_sizes: Sequence[int] | int, sp: SequenceParallel, *, backend: str | None = None,
                             temperature: float = 1.0, return_entropy: bool = False,
                             vision_calls: Sequence[str] | None = None, chunk_size: int = 1024):
    """``completion_logprobs``'s ``CompletionScores`` (log-probs, mask, layout, entropy on request), computed
    sequence-parallel: equal on every rank of ``sp``. ``vision_calls``: as ``completion_logprobs`` (the tower
    calls agreed over the world under ZeRO-3; each rank of ``sp`` makes one call per modality either way).
    ``chunk_size``: as ``completion_logprobs`` (> 0: the output head never holds [tokens, vocab] logits)."""
    from app.grouping.logprobs import CompletionScores
    from app.grouping.vision.calls import aligned_vision_calls

    def work():
        return _sequence_parallel_forward(model, prompts, completion_ids, completion_mask, group_sizes, sp=sp,
                                          backend=backend, temperature=temperature, return_entropy=return_entropy,
                                          chunk_size=chunk_size)

    with aligned_vision_calls(model, prompts, vision_calls):
        logprobs, entropy, layout = _through_wrapper(model, work)
    return CompletionScores(logprobs=logprobs, mask=completion_mask.bool(), layout=layout, entropy=entropy)


def _through_wrapper(model, work):
    """``work()`` run as the forward of the module ``model`` wraps (DeepSpeed's engine, DDP, PEFT), so the wrapper
    sees an ordinary call: DeepSpeed registers its backward hooks on the output (gradient-accumulation scaling, the
    backward prologue ZeRO-3 needs) and ZeRO-3's root-module hooks run. ``work`` returns (log-probs, ...); the
    log-probs are the wrapper's output. Without a wrapper, ``work()`` as it is."""
    inner = unwrap(model)
    if inner is model or not isinstance(model, torch.nn.Module):
        return work()
    kept = {}

    def forward(*args, **kwargs):
        kept["result"] = work()
        return kept["result"][0]

    with patched(inner, "forward", forward):  # the class's forward shadowed for this call only
        logprobs = model()
    return (logprobs, *kept["result"][1:])


def _sequence_parallel_forward(model, prompts, completion_ids, completion_mask, group_sizes, *, sp, backend,
                               temperature, return_entropy, chunk_size):
    from app.grouping.layout import normalize_group_sizes

    inner = unwrap(model)
    sizes = normalize_group_sizes(group_sizes, prompts["input_ids"].shape[0], completion_ids.shape[0])
    layout = GroupLayout.from_masks(prompts["attention_mask"], completion_mask, sizes)
    device = completion_ids.device
    set_text_attention(model, attention.ATTENTION_NAME)
    total = layout.total_len
    bounds = shard_bounds(total, sp.size)
    start, end = bounds[sp.rank]
    plan = SequenceParallelPlan(attention.GroupedAttentionPlan(layout, backend or attention.default_backend(device)),
                                sp, bounds)
    input_ids = layout.pack(prompts["input_ids"], completion_ids)
    positions = packed_positions(layout, prompt_positions(inner, prompts["input_ids"], prompts["attention_mask"],
                                                          prompts))
    check_max_positions(positions, getattr(text_config(model), "max_position_embeddings", None), layout)
    local_ids = input_ids[start:end]
    embeds = inner.get_input_embeddings()(local_ids[None])
    extra = {}
    config = inner.config
    if getattr(config, "vision_config", None) is not None:
        embeds, extra = _insert_vision(model, prompts, input_ids, (start, end), embeds, sp)
    local_positions = positions[..., start:end]
    if local_positions.shape[0] == 1:
        local_positions = local_positions[0]
    body = inner.model.language_model if hasattr(inner.model, "language_model") else inner.model
    hidden = body(inputs_embeds=embeds, position_ids=local_positions, attention_mask=None, use_cache=False,
                  **{attention.PLAN_KWARG: plan}, **extra).last_hidden_state[0]  # [t, hidden]
    predict = layout.predict_index.to(device)
    targets = completion_ids.flatten().index_select(0, layout.target_index.to(device))
    here = (predict >= start) & (predict < end)
    rows = hidden.index_select(0, predict[here] - start)
    if chunk_size:  # the head computes the targets' log-probs chunk by chunk: never [tokens, vocab] logits
        from app.grouping.logprobs import head_returns_logprobs

        with head_returns_logprobs(inner, targets[here], None, temperature, chunk_size, return_entropy):
            both = inner.lm_head(rows)
        chosen, mine = both[:, 0], both[:, 1].detach()
    else:
        logits = inner.lm_head(rows).float()
        if temperature != 1.0:
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.gather(-1, targets[here][:, None])[:, 0]
        mine = -(logp.exp() * logp).sum(-1).detach()
    scored = chosen.new_zeros(predict.shape[0]).masked_scatter(here, chosen)
    logprobs = layout.unpack_completion_tokens(_SumScored.apply(scored, sp.group, sp.grad_scale))
    entropy = None
    if return_entropy:
        with torch.no_grad():
            entropy = mine.new_zeros(predict.shape[0]).masked_scatter(here, mine)
            dist.all_reduce(entropy, group=sp.group)
            entropy = layout.unpack_completion_tokens(entropy)
    return logprobs, entropy, layout


def _insert_vision(model, prompts, input_ids, shard: tuple[int, int], embeds, sp):
    """The shard's placeholder tokens (positions ``shard`` = (start, end) of the row) replaced by their tower
    embeddings (computed frame-sharded); for Qwen3-VL also the shard's deepstack inputs."""
    start, end = shard
    inner = unwrap(model)
    config = inner.config
    local = input_ids[start:end]
    masks, deep_parts = {}, {}
    embeds = embeds[0]
    for kind, token_key, pixel_key, grid_key in (("image", "image_token_id", "pixel_values", "image_grid_thw"),
                                                 ("video", "video_token_id", "pixel_values_videos", "video_grid_thw")):
        if prompts.get(grid_key) is None:
            continue
        table, deep = _modality_embeddings(model, prompts[pixel_key], prompts[grid_key], sp, split_time=kind == "video")
        token = getattr(config, token_key)
        before = int((input_ids[:start] == token).sum())
        mask = local == token
        count = int(mask.sum())
        if int((input_ids == token).sum()) != table.shape[0]:
            raise LayoutError(f"the packed row has {int((input_ids == token).sum())} {kind} tokens but the tower "
                              f"gave {table.shape[0]} embeddings")
        rows = table[before : before + count].to(embeds.dtype)
        embeds = embeds.masked_scatter(mask[:, None], rows)
        masks[kind] = mask
        if deep is not None:
            deep_parts[kind] = [d[before : before + count] for d in deep]
    extra = {}
    if deep_parts:
        visual = torch.zeros_like(local, dtype=torch.bool)
        for mask in masks.values():
            visual = visual | mask
        layers = len(next(iter(deep_parts.values())))
        joint = []
        for layer in range(layers):
            rows = embeds.new_zeros(int(visual.sum()), embeds.shape[-1])
            for kind, parts in deep_parts.items():
                rows[masks[kind][visual]] = parts[layer].to(rows.dtype)
            joint.append(rows)
        extra = {"visual_pos_masks": visual[None], "deepstack_visual_embeds": joint}
    return embeds[None], extra
