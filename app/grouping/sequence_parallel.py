"""Sequence parallelism around the grouped forward (Ulysses): S ranks hold one batch's packed row [P;R1..RG], each
a contiguous 1/S shard of it, and together give the log-probs the one-rank grouped forward gives.

- **Attention.** Each decoder layer's q/k/v of the local shard go through one all-to-all: sequence shards become
  head shards, so every rank holds the WHOLE row for H/S query heads (and their KV heads), runs the ordinary grouped
  attention (any backend: the layout is the whole row's) and sends the result back by the inverse all-to-all.
  With fewer KV heads than S (Qwen2.5-VL-7B: 4 KV heads, 28 query heads) each KV head is repeated S/Hkv times
  first, so rank r's query heads keep their own KV head. gloo's all-to-all needs equal pieces: shards are padded
  to the longest for the exchange and the padding is dropped on arrival (never attended to).
- **Other layer kinds.** Gated DeltaNet layers go through the same all-to-all over their heads
  (``recurrent.layer``); Qwen3.8-Flash-Next's QSA layers keep the shard's queries and join the whole row's keys and
  values instead (``sparse.layer``); its PLE layer hashes along the whole row's ids and fetches the few conv inputs
  its windows read from other shards (``recurrent.ngrams``); experts and hyper-connections act per token.
- **Positions.** The packed row's ids (M-RoPE included) are computed once for the whole row, as on one rank, and
  each rank takes its slice: they are exact by construction.
- **Vision tower.** Split by frames across the S ranks and summed into the full table on every rank
  (``vision.frames``): exact because Qwen's vision attention never crosses a temporal patch.
- **Families** (questions sharing a video, ``families``): the row is the family's [V; Q1; R1*; ...] as on one rank,
  its layout, positions and vision inputs (V's media once) the whole row's; the shards cut it like any other row.
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
from app.grouping.collectives import SumScored, exchange, gather
from app.grouping.families import check_shared_positions, family_layout
from app.grouping.layout import GroupLayout, LayoutError
from app.grouping.modules import patched, set_text_attention, text_config, unwrap
from app.grouping.positions import check_max_positions, packed_positions, prompt_positions
from app.grouping.vision.frames import insert_vision, shard_bounds

__all__ = ["SequenceParallel", "SequenceParallelPlan", "check_heads", "sequence_parallel_scores", "shard_bounds"]


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
    """Refuse, before any work, a model whose heads cannot be shared out over ``size`` ranks: query heads must
    divide by S, and KV heads too or S by them (each KV head then repeated); a hybrid model's linear-attention
    (Gated DeltaNet) key heads and value heads must each divide by S (``recurrent.layer``: Ulysses over them).
    QSA layers (``indexer_budget``: Qwen3.8-Flash-Next) keep the sequence split (``sparse.layer``): no head rule."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    qsa = getattr(text, "indexer_budget", None)
    if not qsa and (heads % size or (kv_heads % size and size % kv_heads)):
        raise ValueError(f"sequence parallelism over {size} ranks needs the {heads} query heads divisible by {size} "
                         f"and the {kv_heads} KV heads divisible by it or dividing it; this model has "
                         f"{heads} query heads and {kv_heads} KV heads (train.sequence_parallel_size={size})")
    if "linear_attention" in (getattr(text, "layer_types", None) or ()):
        key, value = text.linear_num_key_heads, text.linear_num_value_heads
        if key % size or value % size:
            raise ValueError(f"sequence parallelism over {size} ranks shares out the Gated DeltaNet layers' heads: "
                             f"their {key} key heads and {value} value heads must each divide by {size} "
                             f"(train.sequence_parallel_size={size})")


# ---- attention -------------------------------------------------------------------------------------------------


@dataclass
class SequenceParallelPlan:
    """The attention plan of one rank's shard: the whole row's grouped plan plus who holds which shard."""

    inner: attention.GroupedAttentionPlan
    sp: SequenceParallel
    bounds: list[tuple[int, int]]

    def attend(self, module, query, key, value, *, scale=None, dropout=0.0) -> torch.Tensor:
        """The attention-plan protocol (``attention.GroupedAttentionPlan.attend``): q [1, H, t, D], k/v [1, Hkv, t, D]
        of this rank's shard -> [1, t, H, D] (``ulysses``)."""
        size, heads, kv_heads = self.sp.size, query.shape[1], key.shape[1]
        if heads % size:
            raise LayoutError(f"{heads} attention heads cannot be split over {size} sequence-parallel ranks")
        if kv_heads % size and size % kv_heads:
            raise LayoutError(f"{kv_heads} KV heads cannot be shared out over {size} sequence-parallel ranks")
        return ulysses(query, key, value, self.sp, [end - start for start, end in self.bounds],
                       lambda q, k, v: attention.grouped_attention(self.inner, q, k, v, scale, dropout))


def ulysses(query, key, value, sp: SequenceParallel, lengths: list[int], attend) -> torch.Tensor:
    """q [B, H, t_mine, D], k/v [B, Hkv, t_mine, D] of this rank's positions -> [B, t_mine, H, D]: one all-to-all
    turns positions into heads (this rank's H/S heads, every rank's ``lengths``), ``attend(q, k, v)`` runs on them,
    the inverse turns its output back. With fewer KV heads than ranks each is repeated first, so rank r's query
    heads keep theirs."""
    if key.shape[1] % sp.size:
        key, value = (x.repeat_interleave(sp.size // x.shape[1], dim=1) for x in (key, value))
    q, k, v = (torch.cat(exchange(list(x.chunk(sp.size, dim=1)), lengths, 2, sp), dim=2) for x in (query, key, value))
    out = exchange(list(attend(q, k, v).split(lengths, dim=2)), [lengths[sp.rank]] * sp.size, 2, sp)
    return torch.cat(out, dim=1).transpose(1, 2).contiguous()


# ---- the forward ---------------------------------------------------------------------------------------------


def sequence_parallel_scores(model, prompts: Mapping, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                             group_sizes: Sequence[int] | int, sp: SequenceParallel, *, backend: str | None = None,
                             temperature: float = 1.0, return_entropy: bool = False,
                             vision_calls: Sequence[str] | None = None, chunk_size: int = 1024,
                             families: Sequence[int] | None = None, routed=None):
    """``completion_logprobs``'s ``CompletionScores`` (log-probs, mask, layout, entropy on request), computed
    sequence-parallel from this rank's shard of the packed row: equal on every rank of ``sp`` (every rank of the group
    must pass the same inputs). ``vision_calls``: as ``completion_logprobs`` (the tower calls agreed over the world
    under ZeRO-3; each rank of ``sp`` makes one call per modality either way).
    ``chunk_size``: as ``completion_logprobs`` (> 0: the output head never holds [tokens, vocab] logits).
    ``families``: as ``completion_logprobs`` (questions sharing a video: the family's row, V and its media once).
    ``routed``: a MoE forward's replay, record and router statistics (``experts.plan.Routed``): each rank routes
    its shard; the statistics are summed over the group (the probabilities' gradient back to each shard, as the
    scores'), the record gathered (every rank holds the whole row's)."""
    from app.grouping.layout import normalize_group_sizes
    from app.grouping.logprobs import CompletionScores
    from app.grouping.vision.calls import aligned_vision_calls

    sizes = normalize_group_sizes(group_sizes, prompts["input_ids"].shape[0], completion_ids.shape[0])
    layout, vision = family_layout(unwrap(model), prompts, completion_mask, sizes, families)

    def work():
        return _sequence_parallel_forward(model, prompts, completion_ids, layout, sp=sp, backend=backend,
                                          temperature=temperature, return_entropy=return_entropy,
                                          chunk_size=chunk_size, vision=vision, routed=routed)

    with aligned_vision_calls(model, prompts if vision is None else vision, vision_calls):
        logprobs, entropy, layout = _through_wrapper(model, work)
    router, recorded = (None, None) if routed is None else _shard_routing(routed, layout, sp)
    differs, gap = (None, None) if routed is None else _shard_replay(routed, sp)
    return CompletionScores(logprobs=logprobs, mask=completion_mask.bool(), layout=layout, entropy=entropy,
                            router=router, routing=recorded, tie_gap=gap, replay_differs=differs)


def _shard_replay(routed, sp: SequenceParallel):
    """A replayed forward's (tokens routed otherwise, tokens replayed) summed over the group's shards, and the
    largest tie gap of any shard (``Routed.replay_differs``, ``experts.plan.tie_gap``); (None, None) without."""
    differs = routed.replay_differs()
    if differs is None:
        return None, None
    gap = routed.plan.overruled if routed.plan.overruled is not None else differs.new_zeros(())
    gap = gap.detach().float().reshape(1).clone()
    dist.all_reduce(differs, group=sp.group)
    dist.all_reduce(gap, op=dist.ReduceOp.MAX, group=sp.group)
    return differs, float(gap[0])


def _shard_routing(routed, layout: GroupLayout, sp: SequenceParallel):
    """The whole row's router statistics and routing record from each rank's shard."""
    from app.grouping.experts.record import Routing
    from app.grouping.experts.statistics import RouterStatistics

    if routed.plan is None:
        return None, None
    local = routed.plan.statistics(routed.shape.top_k) if routed.statistics != "off" else None
    router = None
    if local is not None:
        summed = [local.load.clone(), local.entropy.clone(), local.tokens.clone()]
        for tensor in summed:
            dist.all_reduce(tensor, group=sp.group)
        router = RouterStatistics(local.layers, summed[0], SumScored.apply(local.probability, sp.group, sp.grad_scale),
                                  summed[1], summed[2], local.top_k)
    if not routed.record:
        return router, None
    row = torch.cat([part[0] for part in gather([routed.plan.recorded()], sp.group)])  # the shards in rank order
    return router, Routing.from_packed(layout, row, routed.shape.layers)


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


def _sequence_parallel_forward(model, prompts, completion_ids, layout: GroupLayout, *, sp, backend, temperature,
                               return_entropy, chunk_size, vision, routed=None):
    inner = unwrap(model)
    device = completion_ids.device
    set_text_attention(model, attention.ATTENTION_NAME)
    total = layout.total_len
    bounds = shard_bounds(total, sp.size)
    start, end = bounds[sp.rank]
    plan = SequenceParallelPlan(attention.GroupedAttentionPlan(layout, backend or attention.default_backend(device)),
                                sp, bounds)
    input_ids = layout.pack(prompts["input_ids"], completion_ids)
    prompt_pos = prompt_positions(inner, prompts["input_ids"], prompts["attention_mask"], prompts)
    if layout.shares:
        check_shared_positions(layout, prompt_pos)
    positions = packed_positions(layout, prompt_pos)
    check_max_positions(positions, getattr(text_config(model), "max_position_embeddings", None), layout)
    local_ids = input_ids[start:end]
    embeds = inner.get_input_embeddings()(local_ids[None])
    extra = {}
    config = inner.config
    if getattr(config, "vision_config", None) is not None:
        embeds, extra = insert_vision(model, prompts if vision is None else vision, input_ids, (start, end), embeds,
                                      sp)
    local_positions = positions[..., start:end]
    if local_positions.shape[0] == 1:
        local_positions = local_positions[0]
    if getattr(text_config(model), "ple_layer_ids", None):  # PLE hashes along the whole row (``recurrent.ngrams``)
        extra["ple_input_ids"] = input_ids[None]
    body = inner.model.language_model if hasattr(inner.model, "language_model") else inner.model
    if routed is not None and routed.shape is not None:
        from app.grouping.experts.statistics import token_repeats

        replay = routed.replay.for_packed(layout)[start:end] if routed.replay is not None else None  # this shard's
        extra.update(routed.plan_for(replay, token_repeats(layout)[start:end].to(device)))
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
    logprobs = layout.unpack_completion_tokens(SumScored.apply(scored, sp.group, sp.grad_scale))
    entropy = None
    if return_entropy:
        with torch.no_grad():
            entropy = mine.new_zeros(predict.shape[0]).masked_scatter(here, mine)
            dist.all_reduce(entropy, group=sp.group)
            entropy = layout.unpack_completion_tokens(entropy)
    return logprobs, entropy, layout
