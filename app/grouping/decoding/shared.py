"""Rollouts of questions that share a video: the video prefilled once, each question on top of it, and decode
steps that read the video's K/V once for all the questions' samples.

A family (``app.grouping.families``) of k prompts [V; Q1] .. [V; Qk] becomes one root V and k questions:

- root prefill: the roots of the batch (left-padded) in one ordinary forward, their media through the tower once
  (chunked like any prefill with ``rollout.prefill_chunk_size``); only their K/V is kept (``SharedRoots``);
- question prefill: each group's Qi (left-padded) in one forward whose attention (``QuestionPrefill``) sees the
  group's root K/V (one call per root, its questions side by side) and Qi's own causally, at Qi's own positions in
  [V; Qi]; its last position gives the group's first logits;
- decode: a sample's query attends to its root (``SharedRoots.attend``: the root's k x G samples side by side, one
  call per root, V read once), its question's K/V and its own tokens, merged exactly by log-sum-exp.

Which prompts share: a family whose members' own parts (Qi) are at most ``QUESTION_LIMIT`` tokens (the question
prefill attends each Qi causally under a [Qi, Qi] mask; with Video-R1's template Qi is the question text, and a
template that writes the video after the question leaves it in Qi). Any other prompt is a root of its own: all
but its last token, that token its question, so the rollout's work is the plain one. Greedy tokens are those of the plain rollout up to float summation order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from app.grouping.decoding.prefill import attention_with_lse, merge_parts, own_causal_attention
from app.grouping.kernels import varlen_against_keys, varlen_kernel

QUESTION_LIMIT = 2048  # a family shares its V in the rollout when each member's own part is at most this long


def rollout_roots(model, prompts: dict, families: Sequence[int], *,
                  questions_without_media: bool = False) -> list[tuple[list[int], int]]:
    """(member groups, V's length) per root: sharing families as one root, every other prompt its own (V = its
    length - 1, cut before a media item it would split). ``questions_without_media``: a family whose questions
    would hold media (a template that writes the video after the question) is not shared either (a spread
    rollout prefills only roots through the tower)."""
    from app.grouping.families import media_items, shared_prefix_lengths

    lengths = prompts["attention_mask"].sum(1).tolist()
    shared = shared_prefix_lengths(model, prompts, families)
    items = media_items(model, prompts)
    roots, g = [], 0
    for size, v in zip(families, shared):
        members = list(range(g, g + size))
        g += size
        media_after = questions_without_media and any(e["last"] >= v for m in members for e in items[m])
        if size > 1 and v and all(lengths[m] - v <= QUESTION_LIMIT for m in members) and not media_after:
            roots.append((members, v))
            continue
        for m in members:
            own = lengths[m] - 1
            for entry in items[m]:
                if entry["first"] < own <= entry["last"]:
                    own = entry["first"]
            roots.append(([m], own))
    return roots


def _left_padded(rows: list[torch.Tensor], fill: int = 0, width: int = 0) -> torch.Tensor:
    """Rows [..., n_i] -> [..., R, max(n, ``width``)] left-padded with ``fill`` (the batch dimension second to last)."""
    width = max([width] + [r.shape[-1] for r in rows])
    return torch.stack([torch.nn.functional.pad(r, (width - r.shape[-1], 0), value=fill) for r in rows], dim=-2)


def _bias(mask: torch.Tensor) -> torch.Tensor | None:
    """[R, L] 0/1 -> additive [R, 1, 1, L] (None when nothing is padded)."""
    if bool(mask.bool().all()):
        return None
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(
        ~mask.bool(), float("-inf"))[:, None, None, :]


@dataclass
class SharedRoots:
    """The roots' K/V per layer [R, Hkv, Vmax, D] (left-padded: ``bias``), which root each group continues, and
    the decode step's slots: per root, the samples that read it side by side."""

    keys: list[torch.Tensor | None]  # per layer; None for a hybrid model's GDN layers (``states``)
    values: list[torch.Tensor | None]
    mask: torch.Tensor  # [R, Vmax]
    group_root: torch.Tensor  # [B]
    states: object = None  # the roots' GDN states (``recurrent.state.RecurrentStates``), a hybrid model's
    bias: torch.Tensor | None = field(init=False)

    def __post_init__(self) -> None:
        self.bias = _bias(self.mask)
        self.start = (~self.mask.bool()).sum(1)  # [R] where each root's keys begin (left padding)
        keys = next(k for k in self.keys if k is not None)
        self.varlen = varlen_kernel(keys.device, keys.dtype, keys.shape[-1], lse=True,
                                    use="the shared video's attention")

    def arrange(self, group_of_sample: torch.Tensor) -> None:
        """The decode step's slots (``slots``): per root, the samples that read it."""
        self.slot_sample, self.slot_index = slots(self.group_root[group_of_sample], self.mask.shape[0])

    def keep(self, groups: torch.Tensor, group_of_sample: torch.Tensor) -> None:
        """Continue with these groups only (ascending); roots left without a group drop out."""
        group_root = self.group_root[groups]
        roots, group_root = torch.unique(group_root, return_inverse=True)
        if len(roots) < self.mask.shape[0]:
            self.keys = [None if k is None else k[roots] for k in self.keys]
            self.values = [None if v is None else v[roots] for v in self.values]
            self.mask = self.mask[roots]
            self.bias = _bias(self.mask)
            self.start = self.start[roots]
        self.group_root = group_root
        self.arrange(group_of_sample)

    def attend(self, layer: int, q: torch.Tensor, scale: float, members: tuple | None = None, *, rep: int = 0):
        """q [n, Hkv, rows, D] -> (out [n, Hkv, rows, D], lse [n, Hkv, rows]) against each member's root: one call
        per root with its members' queries side by side (V's K/V read once for them). Members: the decode step's
        samples (``arrange``), or ``members`` = ``slots(...)`` of other owners (the questions of the prefill).
        ``rep``: query heads per KV head (rows = rep x tokens per member; 0: rows, one token each)."""
        slot_member, slot_index = members if members is not None else (self.slot_sample, self.slot_index)
        keys, values = self.keys[layer], self.values[layer]
        roots, kv_heads, rows, dim = keys.shape[0], q.shape[1], q.shape[2], q.shape[3]
        most = slot_member.shape[1]
        if self.varlen is not None:
            out, lse = self._varlen_attend(q[slot_member], keys, values, scale, rep or rows)
            return out.index_select(0, slot_index), lse.index_select(0, slot_index)
        grouped = q[slot_member].permute(0, 2, 1, 3, 4).reshape(roots, kv_heads, most * rows, dim)
        out, lse = attention_with_lse(grouped, keys, values, self.bias, scale)
        out = out.reshape(roots, kv_heads, most, rows, dim).permute(0, 2, 1, 3, 4).reshape(roots * most, kv_heads,
                                                                                          rows, dim)
        lse = lse.reshape(roots, kv_heads, most, rows).permute(0, 2, 1, 3).reshape(roots * most, kv_heads, rows)
        return out.index_select(0, slot_index), lse.index_select(0, slot_index)


    def _varlen_attend(self, members_q: torch.Tensor, keys, values, scale: float, rep: int):
        """``attend`` through torch's varlen kernel: members_q [R, M, Hkv, rep * t, D] (t tokens per member, each
        with Hkv x rep query heads) -> (out [R * M, Hkv, rep * t, D], lse [R * M, Hkv, rep * t]), the root's K/V in
        key chunks merged by lse (``kernels.varlen_against_keys``)."""
        roots, most, kv_heads, rows, dim = members_q.shape
        tokens = rows // rep
        q = members_q.reshape(roots, most, kv_heads, rep, tokens, dim).permute(0, 1, 4, 2, 3, 5)
        out, lse = varlen_against_keys(self.varlen, q.reshape(roots, most * tokens, kv_heads * rep, dim), keys,
                                       values, self.start, scale=scale)
        out = out.reshape(roots, most, tokens, kv_heads, rep, dim).permute(0, 1, 3, 4, 2, 5)
        lse = lse.reshape(roots, most, tokens, kv_heads, rep).permute(0, 1, 3, 4, 2)
        return out.reshape(roots * most, kv_heads, rows, dim), lse.reshape(roots * most, kv_heads, rows)


def slots(root_of: torch.Tensor, roots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Members (samples or questions) each reading root ``root_of[i]``, laid out side by side per root: the member
    in each slot [R, Mmax] (pads point at a real one, their results dropped) and each member's place in the
    flattened slots (an index made once, so a step selects without a host sync)."""
    counts = torch.bincount(root_of, minlength=roots)
    order = torch.argsort(root_of, stable=True)
    most = int(counts.max()) if counts.numel() else 0
    starts = torch.cumsum(counts, 0) - counts
    taken = starts[:, None] + torch.arange(most, device=counts.device)[None, :]
    valid = torch.arange(most, device=counts.device)[None, :] < counts[:, None]
    member = order[torch.where(valid, taken, torch.zeros_like(taken)).clamp_max(len(order) - 1)]
    flat = torch.where(valid, taken, torch.full_like(taken, -1)).flatten()
    place = torch.empty(len(order), dtype=torch.long, device=counts.device)
    where = (flat >= 0).nonzero().flatten()
    place[order[flat[where]]] = where
    return member, place


@dataclass(frozen=True)
class QuestionPrefill:
    """The attention plan of the question prefill: each question's queries against its root's K/V (one call per
    root, its questions side by side: V read once and never copied), and against the question's own K/V causally;
    merged by log-sum-exp."""

    roots: SharedRoots
    own_mask: torch.Tensor  # [B, Lq] 0/1, left-padded questions
    members: tuple = field(init=False)  # ``slots`` of the questions over their roots, made once for every layer
    own_bias: torch.Tensor | None = field(init=False)
    states: dict = field(default_factory=dict)  # GDN layer -> the questions' (conv tail, state) after them

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", slots(self.roots.group_root, self.roots.mask.shape[0]))
        object.__setattr__(self, "own_bias", _bias(self.own_mask))

    def linear_attention(self, module, hidden_states, *, cache_params=None, original=None):
        """A Gated DeltaNet layer on the questions: each continues its root's conv tail and recurrent state
        (``recurrent.state.continue_from``); their states after them are kept for the samples."""
        from app.grouping.recurrent.state import continue_from

        out, self.states[module.layer_idx] = continue_from(module, hidden_states, self.own_mask, self.roots.states,
                                                           self.roots.group_root)
        return out

    def attend(self, module, query, key, value, *, scale=None, dropout=0.0) -> torch.Tensor:
        batch, heads, count, dim = query.shape
        kv_heads = key.shape[1]
        scale = dim**-0.5 if scale is None else scale
        out_a, lse_a = self.roots.attend(module.layer_idx, query.reshape(batch, kv_heads, heads // kv_heads * count,
                                                                         dim), scale, self.members,
                                         rep=heads // kv_heads)
        out_a, lse_a = out_a.reshape(batch, heads, count, dim), lse_a.reshape(batch, heads, count)
        out_b, lse_b = own_causal_attention(query, key, value, self.own_bias, scale)
        return merge_parts(out_a, lse_a, out_b, lse_b, query.dtype).transpose(1, 2).contiguous()


def shared_prefill(model, prompts: dict, families: Sequence[int], positions: torch.Tensor, *, head,
                   chunk_size: int = 0, synced: bool = False, routing=None):
    """Prefill the roots once and the questions on top: (the questions' cache, their 0/1 mask [B, Lq], the
    ``SharedRoots``, logits of each group's last prompt position [B, V], roots' prompt tokens processed).
    ``head``: the decoder's ``DecodingHead`` (installed around both forwards). ``routing``: a
    ``routing.DecodeRouting`` that records both forwards' experts (a family's V once) as each prompt's record."""
    from app.grouping import attention
    from app.grouping.decoding.prefill import chunked_prefill
    from app.grouping.families import media_items, vision_of_items
    from app.grouping.modules import set_text_attention

    ids, mask = prompts["input_ids"], prompts["attention_mask"].bool()
    width, device = ids.shape[1], ids.device
    lengths = mask.sum(1).tolist()
    roots = rollout_roots(model, prompts, families)
    items = media_items(model, prompts)
    root_ids, root_pos, root_items, group_root, q_ids, q_pos, q_types, q_items = [], [], [], {}, {}, {}, {}, {}
    types = prompts.get("mm_token_type_ids")
    for r, (members, v) in enumerate(roots):
        first = width - lengths[members[0]]
        root_ids.append(ids[members[0], first : first + v])
        root_pos.append(positions[:, members[0], first : first + v])
        root_items += [e for e in items[members[0]] if e["first"] < v]
        for m in members:
            start = width - lengths[m] + v
            group_root[m] = r
            q_ids[m], q_pos[m] = ids[m, start:], positions[:, m, start:]
            q_types[m] = types[m, start:] if types is not None else None
            q_items[m] = [e for e in items[m] if e["first"] >= v]
    order = range(ids.shape[0])
    root_mask = _left_padded([torch.ones_like(r) for r in root_ids])
    root_batch = dict(input_ids=_left_padded(root_ids), attention_mask=root_mask,
                      position_ids=_left_padded([p for p in root_pos]))
    if types is not None:
        root_types = [types[members[0], width - lengths[members[0]]:][:v] for members, v in roots]
        root_batch["mm_token_type_ids"] = _left_padded(root_types)
    set_text_attention(model, "sdpa")
    routed = routing.kwargs() if routing is not None else {}
    with head.installed(), chunked_prefill(model, chunk_size, synced):
        pos = root_batch.pop("position_ids")
        out = model(**root_batch, position_ids=pos if pos.shape[0] > 1 else pos[0], use_cache=True,
                    logits_to_keep=1, **vision_of_items(root_items), **routed)
    root_record = routing.taken(root_mask) if routing is not None else None
    from app.grouping.decoding.cache import is_recurrent_layer, prompt_states_of

    layers = out.past_key_values.layers
    shared = SharedRoots([None if is_recurrent_layer(layer) else layer.keys.contiguous() for layer in layers],
                         [None if is_recurrent_layer(layer) else layer.values.contiguous() for layer in layers],
                         root_mask, torch.tensor([group_root[m] for m in order], device=device),
                         states=prompt_states_of(out.past_key_values, layers))
    del out
    q_mask = _left_padded([torch.ones_like(q_ids[m]) for m in order])
    pos = _left_padded([q_pos[m] for m in order])
    kwargs = vision_of_items([e for m in order for e in q_items[m]])
    if types is not None:
        kwargs["mm_token_type_ids"] = _left_padded([q_types[m] for m in order])
    set_text_attention(model, attention.ATTENTION_NAME)
    plan = QuestionPrefill(shared, q_mask)
    routed = routing.kwargs() if routing is not None else {}
    with head.installed():
        out = model(input_ids=_left_padded([q_ids[m] for m in order]), attention_mask=None,
                    position_ids=pos if pos.shape[0] > 1 else pos[0], use_cache=True, logits_to_keep=1,
                    **{attention.PLAN_KWARG: plan}, **kwargs, **routed)
    if routing is not None:  # V's record (the roots' last v columns: left-padded) in each member's prompt
        routing.composed(roots, [root_record[r, root_record.shape[1] - v:] for r, (_, v) in enumerate(roots)],
                         routing.taken(q_mask), lengths, width)
    past = out.past_key_values
    if plan.states:  # the questions' GDN states: what each sample continues
        from app.grouping.recurrent.state import RecurrentStates

        past.recurrent = RecurrentStates(dict(plan.states))
    return past, q_mask, shared, out.logits[:, -1], int(root_mask.sum())
