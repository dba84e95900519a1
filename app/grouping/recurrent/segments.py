"""Whose recurrent state each run of a packed row starts from: the row as a tree of segments.

A packed row is a sequence of segments, each a contiguous run of tokens that continues one earlier segment (its
parent) or starts from nothing. The attention plans say who SEES whom; a linear-attention layer (Gated DeltaNet)
needs to know whose STATE a segment continues: its parent's final recurrent state and the last inputs of its
parent's path for the causal conv. One layout, two readers:

- a group ``[P; R1; ...; RG]``: P starts from nothing, every Ri continues P;
- a family sharing a video ``[V; Q1; R1*; Q2; R2*; ...]``: V from nothing, each Qi continues V, its Rij continue Qi;
- a prefix tree ``[P; node 0; node 1; ...]``: P from nothing, each node continues its parent node (P for a first
  turn).

Segments are processed by depth (``levels``): every segment of one depth at once, each from its parent's final
state, which a shallower level has computed. The gradient of a shared state is the sum over its continuations
(autograd sums the copies handed out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class Segments:
    """Runs of a packed row of ``total`` tokens: segment s covers ``starts[s]`` .. + ``lengths[s]`` and continues
    segment ``parents[s]`` (-1: it starts from a zero state and zero conv inputs). A parent precedes its children."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    parents: tuple[int, ...]
    total: int

    def __post_init__(self) -> None:
        if not (len(self.starts) == len(self.lengths) == len(self.parents)):
            raise ValueError("segments need one start, length and parent each")
        covered = sorted(zip(self.starts, self.lengths))
        cursor = 0
        for start, length in covered:
            if start != cursor or length < 1:
                raise ValueError(f"segments must tile the row without gaps or overlaps (at {cursor}: "
                                 f"segment at {start} of length {length})")
            cursor += length
        if cursor != self.total:
            raise ValueError(f"segments cover {cursor} tokens of a row of {self.total}")
        for s, parent in enumerate(self.parents):
            if not -1 <= parent < len(self.parents) or (parent >= 0 and self.starts[parent] >= self.starts[s]):
                raise ValueError(f"segment {s}: parent {parent} must be -1 or a segment earlier in the row")

    @cached_property
    def depths(self) -> tuple[int, ...]:
        out = [0] * len(self.parents)
        for s in sorted(range(len(self.parents)), key=lambda s: self.starts[s]):  # a parent precedes in the row
            out[s] = 0 if self.parents[s] < 0 else out[self.parents[s]] + 1
        return tuple(out)

    @cached_property
    def levels(self) -> tuple[tuple[int, ...], ...]:
        """Segments by depth (roots first), each level in row order."""
        deepest = max(self.depths) if self.depths else -1
        return tuple(tuple(sorted((s for s, d in enumerate(self.depths) if d == depth), key=lambda s: self.starts[s]))
                     for depth in range(deepest + 1))

    @cached_property
    def has_children(self) -> tuple[bool, ...]:
        parents = set(self.parents)
        return tuple(s in parents for s in range(len(self.parents)))

    def path_before(self, segment: int, count: int) -> list[int]:
        """The ``count`` positions before ``segment``'s first token along its path (its parent's last tokens, and
        their parent's when the parent is shorter), oldest first; -1 where the path has none (a zero input)."""
        out: list[int] = []
        parent = self.parents[segment]
        while len(out) < count and parent >= 0:
            start, length = self.starts[parent], self.lengths[parent]
            take = min(count - len(out), length)
            out = list(range(start + length - take, start + length)) + out
            parent = self.parents[parent]
        return [-1] * (count - len(out)) + out

    # ---- token geometry along the paths (QSA's blocks, PLE's n-grams and dilated conv) --------------------------
    @cached_property
    def segment_of(self) -> torch.Tensor:
        """[total] long: the segment each token of the row belongs to."""
        out = torch.empty(self.total, dtype=torch.long)
        for s, (start, length) in enumerate(zip(self.starts, self.lengths)):
            out[start:start + length] = s
        return out

    @cached_property
    def path_positions(self) -> torch.Tensor:
        """[total] long: each token's place along its root-to-token path (the tokens its path holds before it): what
        its index would be in the row [ancestors; its segment] alone, e.g. in [P;Ri]."""
        before, out = [0] * len(self.starts), torch.empty(self.total, dtype=torch.long)
        for s in sorted(range(len(self.starts)), key=lambda s: self.starts[s]):
            parent = self.parents[s]
            before[s] = 0 if parent < 0 else before[parent] + self.lengths[parent]
            out[self.starts[s]:self.starts[s] + self.lengths[s]] = before[s] + torch.arange(self.lengths[s])
        return out

    def predecessors(self, count: int) -> torch.Tensor:
        """[total, count] long: the row index of the token b = 1 .. count steps back along each token's path (column
        b - 1), -1 where the path has none (before its root)."""
        out = torch.full((self.total, count), -1, dtype=torch.long)
        for s, (start, length) in enumerate(zip(self.starts, self.lengths)):
            path = torch.tensor(self.path_before(s, count) + list(range(start, start + length)), dtype=torch.long)
            offsets = torch.arange(length)[:, None] + count - torch.arange(1, count + 1)[None, :]  # [length, count]
            out[start:start + length] = path[offsets]
        return out

    @cached_property
    def ancestry(self) -> torch.Tensor:
        """[segments, segments] bool: ``ancestry[a, b]``: segment b is a or one of a's ancestors."""
        n = len(self.parents)
        out = torch.eye(n, dtype=torch.bool)
        for s in sorted(range(n), key=lambda s: self.starts[s]):
            if self.parents[s] >= 0:
                out[s] |= out[self.parents[s]]
        return out

    def visible(self, queries: torch.Tensor) -> torch.Tensor:
        """[len(queries), total] bool: the keys each query token (row index) sees: its path's tokens up to itself,
        as it would see them in [ancestors; its segment] under a causal mask."""
        seg = self.segment_of
        keys = torch.arange(self.total)
        qs = seg[queries]
        return self.ancestry[qs][:, seg] & ((seg[None, :] != qs[:, None]) | (keys[None, :] <= queries[:, None]))

    def level_index(self, level: Sequence[int], kernel: int) -> LevelIndex:
        """Where a level's tokens and the conv inputs in front of them sit in the row (``LevelIndex``)."""
        return LevelIndex(self, tuple(level), kernel)


@dataclass(frozen=True)
class LevelIndex:
    """One level's segments in two layouts the kernels take: padded rows [N, Lmax] (pads point at position
    ``total``, a zero row the caller appends) and one varlen run [sum of lengths] with ``cu_seqlens``; and for the
    causal conv each segment's ``kernel - 1`` inputs in front (``before``: [N, kernel - 1], ``total`` for zero)."""

    segments: Segments
    level: tuple[int, ...]
    kernel: int

    @cached_property
    def lengths(self) -> list[int]:
        return [self.segments.lengths[s] for s in self.level]

    @cached_property
    def padded(self) -> torch.Tensor:
        width = max(self.lengths)
        rows = []
        for s, length in zip(self.level, self.lengths):
            start = self.segments.starts[s]
            rows.append(list(range(start, start + length)) + [self.segments.total] * (width - length))
        return torch.tensor(rows, dtype=torch.long)

    @cached_property
    def valid(self) -> torch.Tensor:
        """[N, Lmax] bool: the padded layout's real tokens."""
        return self.padded < self.segments.total

    @cached_property
    def flat(self) -> torch.Tensor:
        """[sum of lengths]: the level's tokens in row order, segment after segment (the varlen layout)."""
        return torch.cat([torch.arange(self.segments.starts[s], self.segments.starts[s] + n)
                          for s, n in zip(self.level, self.lengths)])

    @cached_property
    def cu_seqlens(self) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(self.lengths).cumsum(0).tolist()], dtype=torch.long)

    @cached_property
    def before(self) -> torch.Tensor:
        total = self.segments.total
        return torch.tensor([[total if p < 0 else p for p in self.segments.path_before(s, self.kernel - 1)]
                             for s in self.level], dtype=torch.long).reshape(len(self.level), self.kernel - 1)

    @cached_property
    def parent_rows(self) -> list[int]:
        """Per segment of the level: its parent (-1: none)."""
        return [self.segments.parents[s] for s in self.level]


class ExplicitLevel:
    """A level given by its rows directly (``LevelIndex``'s face): per sequence its token rows and the ``W - 1`` rows
    of the conv inputs in front of it, in a table whose row ``pad`` is zero."""

    def __init__(self, tokens: list[list[int]], before: list[list[int]], pad: int):
        self.lengths = [len(t) for t in tokens]
        width = max(self.lengths)
        self.padded = torch.tensor([t + [pad] * (width - len(t)) for t in tokens], dtype=torch.long)
        self.valid = self.padded != pad
        self.flat = torch.tensor([r for t in tokens for r in t], dtype=torch.long)
        self.cu_seqlens = torch.tensor([0, *torch.tensor(self.lengths).cumsum(0).tolist()], dtype=torch.long)
        self.before = torch.tensor(before, dtype=torch.long).reshape(len(tokens), -1)


def layout_segments(layout) -> Segments:
    """A ``GroupLayout``'s row: per family V (when shared) from nothing, each question (or plain prompt) from V (or
    from nothing), each response from its question."""
    starts, lengths, parents = [], [], []

    def add(start: int, length: int, parent: int) -> int:
        starts.append(start)
        lengths.append(length)
        parents.append(parent)
        return len(starts) - 1

    for start, shared, members in layout.family_spans:
        cursor = start
        root = -1
        if shared:
            root = add(start, shared, -1)
            cursor += shared
        for question, completion_lens in members:
            prompt = add(cursor, question, root)
            cursor += question
            for length in completion_lens:
                add(cursor, length, prompt)
                cursor += length
    return Segments(tuple(starts), tuple(lengths), tuple(parents), layout.total_len)


def tree_segments(trees) -> Segments:
    """Prefix trees packed one after another: each tree's prompt from nothing, each node from its parent node (the
    prompt for a first turn)."""
    starts, lengths, parents = [], [], []
    offset = 0
    for tree in trees:
        root = len(starts)
        starts.append(offset)
        lengths.append(tree.prompt_len)
        parents.append(-1)
        for n, node in enumerate(tree.nodes):
            starts.append(offset + tree.starts[n])
            lengths.append(tree.lengths[n])
            parents.append(root if node.parent < 0 else root + 1 + node.parent)
        offset += tree.total_len
    return Segments(tuple(starts), tuple(lengths), tuple(parents), offset)


def segments_of(plan) -> Segments:
    """The segments of the row a training plan describes: a grouped plan's layout (families included), a tree
    plan's trees, or a sequence-parallel plan's whole row (its inner plan's); ``Segments`` themselves (a plan for
    the GDN layers alone). Cached on the plan."""
    if isinstance(plan, Segments):
        return plan
    cache = plan.__dict__.setdefault("_segments", {})
    if "row" not in cache:
        inner = getattr(plan, "inner", None)
        if inner is not None:
            cache["row"] = segments_of(inner)
        elif getattr(plan, "trees", None) is not None:
            cache["row"] = tree_segments(plan.trees)
        elif getattr(plan, "layout", None) is not None:
            cache["row"] = layout_segments(plan.layout)
        else:
            raise TypeError(f"{type(plan).__name__} says nothing of the row's segments: the linear-attention layers "
                            "cannot tell whose state each token continues")
    return cache["row"]


def sequence_shard(plan):
    """(the sequence-parallel group, every rank's (start, end) of the row) of a plan that splits its row over S > 1
    ranks (``sequence_parallel.SequenceParallelPlan``); (None, None) for a row held whole."""
    sp = getattr(plan, "sp", None)
    return (sp, plan.bounds) if sp is not None and sp.size > 1 else (None, None)


def current_forward(module):
    """(The instance patches of a packed row's layer kinds, GDN, PLE, QSA and routers, chain through this.) The
    unbound forward ``module`` runs now: an instance patch's function (it takes the module first), else its
    class's. A further instance patch wraps this one, so patches of one module chain instead of replacing each
    other (and a deep copy, whose bound methods follow it, runs its own)."""
    import types

    patch = module.__dict__.get("forward")
    return patch.__func__ if isinstance(patch, types.MethodType) else type(module).forward
