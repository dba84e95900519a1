"""A rollout spread over the S ranks of a sequence-parallel group: every rank samples the same prompts and draws
the same tokens, and each does 1/S of the work that grows with the video.

The attention heads are shared out as the training forward's Ulysses shares them (``sequence_parallel``): rank r
owns query heads [r H/S, (r + 1) H/S) and their KV heads (``head_share``; with fewer KV heads than ranks each KV
head is held by S / Hkv ranks). Then, per family (``spread_prefill``):

- **tower**: the video's temporal patches split over the ranks (``vision.frames``, chunked by
  ``forward.vision_chunk_frames`` through the vision cache when one is attached), the embeddings summed into the
  whole table on every rank;
- **root prefill** (the video, V): in chunks of ``rollout.prefill_chunk_size`` positions, each chunk cut into S
  contiguous pieces, one per rank; each layer's q/k/v go through one all-to-all (pieces become heads: every rank
  holds the whole chunk for its heads), its heads attend the chunk causally and the K/V kept so far, and the
  output goes back by the inverse all-to-all (Ulysses per chunk). A rank keeps the K/V of its own heads only;
- **question prefill**: the questions on top of V the same way (their tokens cut into S pieces, their attention to
  V and to themselves per head); the last position's hidden state is broadcast from the rank that holds it;
- **decode** (``SpreadKVCache``): every rank runs a step's linear layers for every sample; each attends the V,
  question and own K/V of its own heads (what ``cache.decode_attention`` does for all heads), and the heads'
  outputs are gathered in one all-gather per layer: exact, no merge across ranks.

Every rank thus holds 1/S of the video's, the questions' and the samples' K/V (when S divides the KV heads), runs
1/S of the tower and 1/S of every prefill's positions through the layers, and the same sampled tokens come out on
every rank (the same logits, the same seeded draws). Why Ulysses and not ring attention: the exchange is the one the
training forward already uses (``collectives.exchange``), its work is balanced by construction (each rank
1/S of every chunk's positions and of every head's attention), and the K/V it leaves by heads is what a decode step
reads without moving keys; its cost is that S may not exceed the query heads (the training forward's own limit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist

from app.grouping import attention
from app.grouping.collectives import gather
from app.grouping.decoding.cache import GroupedKVCache, decode_attention
from app.grouping.decoding.prefill import PrefillChunk, _language_model, prefill_chunk_attention
from app.grouping.decoding.shared import QuestionPrefill, SharedRoots, _left_padded, rollout_roots
from app.grouping.modules import set_text_attention, text_config, unwrap
from app.grouping.recurrent.spread import RootStates, question_core
from app.grouping.recurrent.state import RecurrentStates
from app.grouping.sequence_parallel import SequenceParallel, shard_bounds, ulysses
from app.grouping.vision.frames import insert_vision


def head_share(sp: SequenceParallel, heads: int, kv_heads: int) -> tuple[slice, slice]:
    """(this rank's query heads, its KV heads) as slices of the model's heads (see the module doc)."""
    size, rank = sp.size, sp.rank
    per = heads // size
    if kv_heads % size == 0:
        kv_per = kv_heads // size
        return slice(rank * per, (rank + 1) * per), slice(rank * kv_per, (rank + 1) * kv_per)
    owner = rank // (size // kv_heads)
    return slice(rank * per, (rank + 1) * per), slice(owner, owner + 1)


def gather_heads(local: torch.Tensor, sp: SequenceParallel, dim: int) -> torch.Tensor:
    """Every rank's ``local`` heads (along ``dim``), concatenated in rank order: the whole heads on every rank."""
    parts = [torch.empty_like(local) for _ in range(sp.size)]
    dist.all_gather(parts, local.contiguous(), group=sp.group)
    return torch.cat(parts, dim=dim)


@dataclass
class UlyssesPlan:
    """The attention plan of a piece of a spread prefill: q/k/v of this rank's positions to its heads and back,
    ``attend_heads(layer, q, k, v)`` ([B, h, T, D] of its heads, the whole piece) in between, which also keeps K/V."""

    sp: SequenceParallel
    lengths: list[int]  # positions per rank of this piece
    attend_heads: object
    linear_heads: object = None  # a hybrid's GDN layers: ``core(module, mixed, beta, g, heads)`` of this piece

    def linear_attention(self, module, hidden_states, *, cache_params=None, original=None):
        """A Gated DeltaNet layer on this piece: its heads shared out as the attention's (``recurrent.spread``)."""
        from app.grouping.recurrent.spread import ulysses_linear

        return ulysses_linear(module, hidden_states, self.sp, self.lengths, self.linear_heads)

    def attend(self, module, query, key, value, *, scale=None, dropout=0.0) -> torch.Tensor:
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        return ulysses(query, key, value, self.sp, self.lengths,
                       lambda q, k, v: self.attend_heads(module.layer_idx, q, k, v, scale))


class RootStore:
    """A root's K/V of this rank's heads, layer by layer, written chunk by chunk ([1, h_kv, V, D] each)."""

    def __init__(self, width: int):
        self.width, self.keys, self.values, self.end = width, {}, {}, 0

    def attend(self, layer: int, q, k, v, scale: float) -> torch.Tensor:
        """The chunk's queries [1, h, c, D] against the root's keys so far and its own causally: torch's varlen
        kernel in one call where it runs, ``prefill_chunk_attention`` on CPU, SDPA under a bottom-right causal mask
        elsewhere (none of them makes [c, keys] float32 scores on a GPU)."""
        from app.grouping.kernels import varlen_kernel

        if layer not in self.keys:
            shape = (1, k.shape[1], self.width, k.shape[3])
            self.keys[layer], self.values[layer] = k.new_empty(shape), v.new_empty(shape)
        start, end = self.end, self.end + k.shape[2]
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        keys, values = self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
        count = q.shape[2]
        kernel = varlen_kernel(q.device, q.dtype, q.shape[-1], use="the spread prefill")
        if kernel is not None:
            cu_q = torch.tensor([0, count], dtype=torch.int32, device=q.device)
            cu_k = torch.tensor([0, end], dtype=torch.int32, device=q.device)
            out = kernel(q[0].transpose(0, 1), keys[0].transpose(0, 1), values[0].transpose(0, 1),
                         (cu_q, cu_k, count, end), causal=True, scale=scale)
            return out.transpose(0, 1)[None]
        if q.device.type == "cpu":
            return prefill_chunk_attention(PrefillChunk(None), q, keys, values, scale)
        seen = torch.arange(end, device=q.device)[None, :] <= torch.arange(start, end, device=q.device)[:, None]
        rep = q.shape[1] // keys.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(q, keys.repeat_interleave(rep, dim=1),
                                                                values.repeat_interleave(rep, dim=1), attn_mask=seen,
                                                                scale=scale)


def _pieces(width: int, chunk: int, size: int) -> list[tuple[int, int]]:
    """Chunks of about ``chunk`` positions (the whole width with 0), each at least ``size`` long."""
    if width < size:
        raise ValueError(f"a prompt part of {width} tokens cannot be spread over {size} sequence-parallel ranks")
    count = max(1, -(-width // chunk)) if chunk else 1
    return shard_bounds(width, min(count, width // size))


def _local_extra(extra: dict, start: int, end: int) -> dict:
    """Qwen3-VL's deepstack inputs for positions [start, end) of a row whose inputs are ``extra``."""
    if not extra:
        return {}
    mask = extra["visual_pos_masks"]
    before = int(mask[:, :start].sum())
    count = int(mask[:, start:end].sum())
    return {"visual_pos_masks": mask[:, start:end],
            "deepstack_visual_embeds": [d[before : before + count] for d in extra["deepstack_visual_embeds"]]}


def _run_language(model, embeds, positions, plan, extra: dict, *, routing=None):
    """The decoder stack on some positions under ``plan`` (no cache, no mask: the plan is the attention): (the last
    hidden states, and with ``routing`` (``routing.DecodeRouting``) the experts of the plan's rank pieces gathered
    over the group ([rows, sum(plan.lengths), S, k] on every rank, in rank order; else None))."""
    language = _language_model(model)
    pos = positions if positions.shape[0] > 1 else positions[0]
    routed = routing.kwargs() if routing is not None else {}
    hidden = language(inputs_embeds=embeds, position_ids=pos, attention_mask=None, use_cache=False,
                      **{attention.PLAN_KWARG: plan}, **extra, **routed).last_hidden_state
    if routing is None:
        return hidden, None
    local = routing.taken(embeds.new_ones(embeds.shape[:2]))  # this rank's piece of the positions
    return hidden, local if plan.sp.size == 1 else torch.cat([p[0] for p in gather([local], plan.sp.group)], dim=1)


def root_prefill(model, ids: torch.Tensor, positions: torch.Tensor, vision: dict, *, sp: SequenceParallel,
                 chunk_size: int, routing=None) -> tuple[RootStore, int]:
    """One root (ids [V], positions [axes, V]) prefilled spread over ``sp``: its K/V of this rank's heads, and the
    positions this rank ran through the layers. ``routing``: its experts recorded, the whole root's
    [V, S, k] on every rank (``store.routing``)."""
    inner = unwrap(model)
    embeds = inner.get_input_embeddings()(ids[None])
    extra = {}
    if vision:
        embeds, extra = insert_vision(model, vision, ids, (0, ids.shape[0]), embeds, sp)
    store, ran, records = RootStore(ids.shape[0]), 0, []
    store.states = RootStates()  # a hybrid's GDN states of this rank's heads, chunk to chunk
    for start, end in _pieces(ids.shape[0], chunk_size, sp.size):
        bounds = shard_bounds(end - start, sp.size)
        lo, hi = bounds[sp.rank]
        plan = UlyssesPlan(sp, [b - a for a, b in bounds], store.attend, store.states.core)
        _, record = _run_language(model, embeds[:, start + lo : start + hi], positions[:, None, start + lo : start + hi],
                                  plan, _local_extra(extra, start + lo, start + hi), routing=routing)
        records.append(record)
        store.end = end
        ran += hi - lo
    store.routing = torch.cat(records, dim=1)[0] if routing is not None else None
    return store, ran


@dataclass
class QuestionStore:
    """The question prefill's attention per head (``QuestionPrefill`` over this rank's heads of the roots), keeping
    the questions' K/V of this rank's heads."""

    prefill: QuestionPrefill

    def __post_init__(self):
        self.keys, self.values = {}, {}

    def attend(self, layer: int, q, k, v, scale: float) -> torch.Tensor:
        self.keys[layer], self.values[layer] = k, v
        return self.prefill.attend(SimpleNamespace(layer_idx=layer), q, k, v, scale=scale).transpose(1, 2)


def spread_prefill(model, prompts: dict, families: Sequence[int], positions: torch.Tensor, *, head, chunk_size: int,
                   sp: SequenceParallel, routing=None):
    """``shared.shared_prefill`` spread over ``sp``: (the questions' K/V of this rank's heads as a cache, their 0/1
    mask [B, Lq], the roots (this rank's heads), each prompt's last logits [B, V] (the same on every rank), the
    prompt positions this rank ran through the layers). Every prompt is a root (a family's video, or a prompt's all
    but its last token) with questions on top that hold no media. ``routing``: the experts of every prompt token
    recorded (each rank routes its pieces; the record is gathered, whole on every rank)."""
    from app.grouping.decoding.static import padded_left
    from app.grouping.families import media_items, vision_of_items

    ids, mask = prompts["input_ids"], prompts["attention_mask"].bool()
    width, device = ids.shape[1], ids.device
    lengths = mask.sum(1).tolist()
    roots = rollout_roots(model, prompts, families, questions_without_media=True)
    items = media_items(model, prompts)
    set_text_attention(model, attention.ATTENTION_NAME)
    layer_count = text_config(model).num_hidden_layers
    keys, values, root_masks, group_root, ran, root_states, root_records = [], [], [], {}, 0, [], []
    q_ids, q_pos = {}, {}
    for r, (members, v) in enumerate(roots):
        first = width - lengths[members[0]]
        root_items = [e for e in items[members[0]] if e["first"] < v]
        store, done = root_prefill(model, ids[members[0], first : first + v], positions[:, members[0], first : first + v],
                                   vision_of_items(root_items), sp=sp, chunk_size=chunk_size, routing=routing)
        ran += done
        root_records.append(store.routing)
        # per layer: the attention layers' K/V of this rank's heads, None for a hybrid's GDN layers (their states)
        keys.append([store.keys[layer][0] if layer in store.keys else None for layer in range(layer_count)])
        values.append([store.values[layer][0] if layer in store.keys else None for layer in range(layer_count)])
        root_states.append(store.states.layers)
        root_masks.append(torch.ones(v, dtype=torch.long, device=device))
        for m in members:
            group_root[m] = r
            start = width - lengths[m] + v
            q_ids[m], q_pos[m] = ids[m, start:], positions[:, m, start:]
    order = range(ids.shape[0])
    widest = max(mask_.shape[0] for mask_ in root_masks)
    del store  # the last root's K/V live on in ``keys`` / ``values`` alone, each freed once stacked

    def stacked(per_root: list) -> list[torch.Tensor]:  # roots' [h_kv, V_r, D] per layer -> [R, h_kv, Vmax, D]
        layers = []
        for layer in range(len(per_root[0])):
            if per_root[0][layer] is None:  # a GDN layer: no K/V
                layers.append(None)
                continue
            layers.append(torch.stack([padded_left(x[layer], widest, 1) for x in per_root]).contiguous())
            for x in per_root:  # the roots' own copy of this layer goes as its stacked one comes: K/V held once
                x[layer] = None
        return layers

    gdn = {layer: (torch.cat([r[layer][0] for r in root_states]), torch.cat([r[layer][1] for r in root_states]))
           for layer in root_states[0]}  # the roots' GDN states of this rank's heads, [R, ...] per layer
    shared = SharedRoots(stacked(keys), stacked(values), _left_padded(root_masks),
                         torch.tensor([group_root[m] for m in order], device=device), states=RecurrentStates(gdn))
    # the questions, left-padded to a common width of at least S (each rank a piece of every row)
    q_width = max(max(q_ids[m].shape[0] for m in order), sp.size)
    q_mask = _left_padded([torch.ones_like(q_ids[m]) for m in order], width=q_width)
    q_rows = _left_padded([q_ids[m] for m in order], width=q_width)
    pos = _left_padded([q_pos[m] for m in order], width=q_width)
    bounds = shard_bounds(q_width, sp.size)
    lo, hi = bounds[sp.rank]
    questions = QuestionStore(QuestionPrefill(shared, q_mask))
    kept_states: dict = {}
    plan = UlyssesPlan(sp, [b - a for a, b in bounds], questions.attend,
                       question_core(gdn, shared.group_root, q_mask, kept_states))
    embeds = unwrap(model).get_input_embeddings()(q_rows[:, lo:hi])
    hidden, record = _run_language(model, embeds, pos[..., lo:hi], plan, {}, routing=routing)
    ran += int(q_mask[:, lo:hi].sum())  # the questions' real tokens in this rank's piece
    if routing is not None:
        routing.composed(roots, root_records, record.masked_fill(~q_mask.bool()[..., None, None], -1), lengths, width)
    last = hidden[:, -1].contiguous()
    if sp.size > 1:
        holder = dist.get_global_rank(sp.group, sp.size - 1) if sp.group is not None else sp.size - 1
        dist.broadcast(last, src=holder, group=sp.group)
    with head.installed():
        logits = unwrap(model).lm_head(last)
    layers = [SimpleNamespace(keys=questions.keys.get(layer), values=questions.values.get(layer))
              for layer in range(layer_count)]
    past = SimpleNamespace(layers=layers, recurrent=RecurrentStates(kept_states))  # the questions' GDN states
    return past, q_mask, shared, logits, ran


class SpreadKVCache(GroupedKVCache):
    """``GroupedKVCache`` over this rank's heads (the questions', the roots', the samples' own K/V), for a decode
    step whose linear layers every rank of ``sp`` runs whole: each step's new K/V keep this rank's KV heads, its
    attention runs on this rank's query heads, and the heads are gathered (one all-gather per layer)."""

    def __init__(self, *args, sp: SequenceParallel, heads: int, kv_heads: int, **kwargs):
        self.sp = sp
        self.q_share, self.kv_share = head_share(sp, heads, kv_heads)
        super().__init__(*args, **kwargs)

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        return super().update(key_states[:, self.kv_share], value_states[:, self.kv_share], layer_idx, cache_kwargs)

    def attend(self, module, query, key, value, *, scale=None, dropout=0.0) -> torch.Tensor:
        local = decode_attention(self, module.layer_idx, query[:, self.q_share], key, value, scale)
        return gather_heads(local, self.sp, dim=2)

    def linear_attention(self, module, hidden_states, *, cache_params=None, original=None):
        """A Gated DeltaNet layer's step: this rank's heads' states advanced, the heads' outputs gathered."""
        from app.grouping.recurrent.spread import spread_step

        return spread_step(self.recurrent, module, hidden_states, self.sp)
