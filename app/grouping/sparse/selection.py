"""Which keys each query of a QSA layer attends to: the top blocks of its visible keys, plus the incomplete tail.

transformers (``Qwen4ExpTextQSAIndexer``) loops over every query in Python, cutting its visible keys into blocks of C
and pooling each block again. Here a row's keys are cut once: a key's place among the keys that see it (its rank:
its index along its path in a packed row, among the real tokens of its row in a left-padded batch) is the same for
every query that sees it, so the complete blocks are fixed (each named by its last key, its members that key and
its C - 1 predecessors along the path) and pooled once (``key_blocks``: the keys' mean in float32, normed, rotated at
the block's first key, as transformers pools them). A query's blocks are those whose last key it sees; its scores are
relu(q_h . K_b) summed over the index heads / sqrt(d), its choice the top k of them (``choose``: ties to the earlier
block, a stable sort, where ``torch.topk`` breaks them as it happens to), chunk by chunk of queries (never a [T, T]
score matrix), and its keys those blocks' members and the visible keys past its last complete block (``key_mask``).
No gradient flows through the choice (a hard top-k, as in transformers).

``Geometry`` of a packed row is ``recurrent.segments.Segments`` (``ranks`` = ``path_positions``); of an ordinary
left-padded batch, ``BatchGeometry`` (from transformers' 4-D mask). ``reference``: the same choice written plainly,
query by query, for the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class BatchGeometry:
    """The keys of a batch of rows as one flat index (row b's key t is b * T + t), from transformers' 4-D mask
    [B, 1, L, T] (True or 0.0 where a query sees a key) of the batch's last L queries (query i of row b is flat query
    b * L + i). A key's rank is its place among the keys its row's last query sees (causal masks with padding)."""

    def __init__(self, mask: torch.Tensor):
        visible = mask if mask.dtype == torch.bool else mask == 0
        self.mask = visible[:, 0]  # [B, L, T]
        b, self.queries_per_row, t = self.mask.shape
        self.keys_per_row, self.total = t, b * t
        real = self.mask[:, -1]  # [B, T]: what the row's last query sees
        self.ranks = torch.where(real, real.long().cumsum(-1) - 1, -1).flatten()
        self.real = real

    @property
    def device(self):
        return self.mask.device

    def predecessors(self, count: int) -> torch.Tensor:
        b, t = self.real.shape
        ranks = self.ranks.view(b, t)
        table = torch.full((b, t), -1, dtype=torch.long, device=self.device)  # row b's rank r -> its flat key
        rows, keys = self.real.nonzero(as_tuple=True)
        table[rows, ranks[rows, keys]] = rows * t + keys
        back = ranks[..., None] - torch.arange(1, count + 1, device=self.device)  # [B, T, count]
        out = table.gather(1, back.clamp_min(0).view(b, -1)).view(b, t, count)
        return torch.where((back >= 0) & self.real[..., None], out, -1).view(-1, count)

    def visible(self, queries: torch.Tensor) -> torch.Tensor:
        rows = queries // self.queries_per_row
        out = torch.zeros(len(queries), self.total, dtype=torch.bool, device=self.device)
        seen = self.mask[rows, queries % self.queries_per_row]  # [Q, T]
        columns = rows[:, None] * self.keys_per_row + torch.arange(self.keys_per_row, device=self.device)[None]
        return out.scatter_(1, columns, seen)

    def query_ranks(self, queries: torch.Tensor) -> torch.Tensor:
        """Each query's own rank: how many keys it sees, minus one."""
        return self.mask[queries // self.queries_per_row, queries % self.queries_per_row].sum(-1) - 1


def packed_query_ranks(segments, queries: torch.Tensor) -> torch.Tensor:
    return segments.path_positions.to(queries.device)[queries]


RECORDERS: list = []  # lists the self-check appends to while it records (``checks.sparse.recorded_choices``)


@dataclass
class KeyBlocks:
    """A row's complete key blocks: ``last`` [NB] each block's last key, ``members`` [NB, C] its keys oldest first,
    ``keys`` [NB, d] its pooled, normed and rotated index key."""

    last: torch.Tensor
    members: torch.Tensor
    keys: torch.Tensor


def key_blocks(ranks: torch.Tensor, predecessors: torch.Tensor, raw_keys: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, *, compress: int, k_norm, rotate) -> KeyBlocks:
    """The complete blocks of keys with ``ranks`` [N] (-1: nobody's key) and ``predecessors`` [N, >= C - 1] (along the
    path; -1 none), ``raw_keys`` [N, d] the indexer's unrotated keys, ``cos`` / ``sin`` [N, r] each key's rotary
    angles; ``k_norm``: the indexer's key norm; ``rotate(x [NB, 1, d], cos [NB, r], sin [NB, r])``: its rotary (``rotate(x, cos=, sin=)``)."""
    last = ((ranks >= 0) & (ranks % compress == compress - 1)).nonzero().flatten()
    if compress > 1:
        before = predecessors[last, : compress - 1].flip(-1)  # oldest first
        members = torch.cat([before, last[:, None]], dim=1)
    else:
        members = last[:, None]
    if len(last) and bool((members < 0).any()):
        raise ValueError("a complete key block reaches past its path's first key: the ranks and predecessors disagree")
    pooled = raw_keys[members].float().mean(dim=1).to(raw_keys.dtype)
    pooled = k_norm(pooled)
    first = members[:, 0]
    keys = rotate(pooled[:, None], cos=cos[first], sin=sin[first])[:, 0]
    return KeyBlocks(last, members, keys)


@torch.no_grad()
def choose(blocks: KeyBlocks, seen: torch.Tensor, queries: torch.Tensor, top: int) -> torch.Tensor:
    """[Q, top] the blocks (indices into ``blocks``) each query chooses, -1 where it sees fewer: ``seen`` [Q, N] the
    keys each query sees, ``queries`` [Q, H, d] the index queries (normed, rotated). Ties go to the earlier block."""
    if not len(blocks.last):
        return torch.full((len(queries), top), -1, dtype=torch.long, device=queries.device)
    scores = torch.matmul(queries.float(), blocks.keys.float().T)  # [Q, H, NB]
    scores = torch.relu(scores).sum(dim=1) / math.sqrt(queries.shape[-1])
    eligible = seen[:, blocks.last]  # a block a query sees: its last key (so all its keys) visible to it
    scores = scores.masked_fill(~eligible, float("-inf"))
    ranked = torch.sort(scores, dim=-1, descending=True, stable=True)
    order = ranked.indices[:, :top]
    picked = eligible.gather(1, order)
    for record in RECORDERS:  # the self-check's: how far each query's last chosen block stands above the next one
        values, inf = ranked.values, torch.full_like(ranked.values[:, 0], float("inf"))
        margin = inf if values.shape[1] <= top else torch.where(torch.isfinite(values[:, top]),
                                                                values[:, top - 1] - values[:, top], inf)
        record.append(("margin", margin.cpu(), values[:, 0].abs().cpu()))
    return torch.where(picked, order, -1)


@torch.no_grad()
def key_mask(blocks: KeyBlocks, seen: torch.Tensor, own_ranks: torch.Tensor, ranks: torch.Tensor,
             chosen: torch.Tensor, compress: int) -> torch.Tensor:
    """[Q, N] bool: the keys each query attends to: the members of its chosen blocks and the visible keys past its
    last complete block (the tail: rank >= floor((own rank + 1) / C) * C)."""
    out = torch.zeros_like(seen)
    if chosen.numel() and len(blocks.last):
        members = blocks.members[chosen.clamp_min(0)]  # [Q, top, C]
        members = torch.where(chosen[..., None] >= 0, members, seen.shape[1])  # -1: a scratch column, dropped
        out = torch.cat([out, out.new_zeros(len(out), 1)], dim=1)
        out.scatter_(1, members.flatten(1), True)
        out = out[:, :-1]
    tail_start = (own_ranks + 1) // compress * compress
    out |= seen & (ranks[None, :] >= tail_start[:, None])
    out &= seen
    for record in RECORDERS:
        record.append(("keys", out.cpu(), ranks.cpu()))
    return out


@torch.no_grad()
def reference(raw_keys, cos, sin, seen_rows, index_queries, *, compress, top, k_norm, rotate) -> list[torch.Tensor]:
    """The choice written plainly, one query at a time (transformers' loop, ties to the earlier block): for query i,
    its visible keys (``seen_rows[i]``, in order) cut in blocks of ``compress``, each pooled, normed and rotated at its
    first key, scored, the top ``top`` taken with the tail. Returns each query's selected keys (sorted)."""
    out = []
    for i, row in enumerate(seen_rows):
        keys = row.nonzero().flatten()
        complete = len(keys) // compress
        chosen = keys.new_zeros(0)
        if complete:
            groups = keys[: complete * compress].view(complete, compress)
            pooled = k_norm(raw_keys[groups].float().mean(1).to(raw_keys.dtype))
            rotated = rotate(pooled[:, None], cos=cos[groups[:, 0]], sin=sin[groups[:, 0]])[:, 0]
            scores = torch.relu(index_queries[i].float() @ rotated.float().T).sum(0) / math.sqrt(rotated.shape[-1])
            order = torch.sort(scores, descending=True, stable=True).indices[: min(top, complete)]
            chosen = groups[order].flatten()
        out.append(torch.cat([chosen, keys[complete * compress:]]).sort().values)
    return out
