"""Where every token of a batch of groups sits in the packed row [P1;R11..R1G | P2;R21.. | ...].

A batch holds B prompts (left-padded, as processors return them) and N = sum(group_sizes) completions
(right-padded, cut at EOS). The packed row concatenates, group after group, the prompt's real tokens and then each
of its completions' real tokens: no padding anywhere. The layout only knows lengths; it turns them into index
tensors that pack inputs, locate the outputs that predict each completion token, and unpack results.

Families (questions that share a video): consecutive groups whose prompts begin with the same V tokens (the system
prompt and the video) can form a family. Its part of the row is [V; Q1; R11..R1G; Q2; R21..R2G; ...], where Qi is
prompt i after V: V once for all of them. A group of one prompt is the family of one with nothing shared (V = 0),
so the plain layout is the case ``families`` all 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch


class LayoutError(ValueError):
    """Masks, shapes or group sizes that cannot describe a batch of prompt groups."""


def normalize_group_sizes(group_sizes: int | Sequence[int], num_prompts: int, num_completions: int) -> tuple[int, ...]:
    if isinstance(group_sizes, int):
        sizes = (group_sizes,) * num_prompts
    else:
        sizes = tuple(int(g) for g in group_sizes)
    if len(sizes) != num_prompts:
        raise LayoutError(f"group_sizes has {len(sizes)} entries but there are {num_prompts} prompts")
    if any(g < 1 for g in sizes):
        raise LayoutError(f"every group needs at least one completion, got group_sizes={list(sizes)}")
    if sum(sizes) != num_completions:
        raise LayoutError(
            f"group_sizes {list(sizes)} add up to {sum(sizes)} but there are {num_completions} completions"
        )
    return sizes


def _left_padded_lengths(mask: torch.Tensor) -> list[int]:
    if mask.ndim != 2:
        raise LayoutError(f"prompt mask must be 2-D [prompts, length], got shape {tuple(mask.shape)}")
    mask = mask.bool()
    lengths = mask.sum(dim=1)
    width = mask.shape[1]
    expected = torch.arange(width, device=mask.device)[None, :] >= (width - lengths)[:, None]
    bad = (mask != expected).any(dim=1).nonzero().flatten().tolist()
    if bad:
        raise LayoutError(f"prompt mask of prompt {bad[0]} is not left-padded (ones must be one block at the right end)")
    lengths = lengths.tolist()
    empty = [i for i, n in enumerate(lengths) if n == 0]
    if empty:
        raise LayoutError(f"prompt {empty[0]} has no tokens (its mask is all zeros)")
    return lengths


def _right_padded_lengths(mask: torch.Tensor) -> list[int]:
    if mask.ndim != 2:
        raise LayoutError(f"completion mask must be 2-D [completions, length], got shape {tuple(mask.shape)}")
    mask = mask.bool()
    lengths = mask.sum(dim=1)
    expected = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    bad = (mask != expected).any(dim=1).nonzero().flatten().tolist()
    if bad:
        raise LayoutError(
            f"completion mask of completion {bad[0]} is not a block of ones from the start (cut at EOS, pads trailing)"
        )
    lengths = lengths.tolist()
    empty = [i for i, n in enumerate(lengths) if n == 0]
    if empty:
        raise LayoutError(f"completion {empty[0]} has length 0; drop it or give it at least one token (e.g. EOS)")
    return lengths


@dataclass(frozen=True)
class GroupLayout:
    """Lengths of a batch of groups and the packed-row geometry derived from them."""

    group_sizes: tuple[int, ...]
    prefix_lens: tuple[int, ...]  # one per group (prompt)
    completion_lens: tuple[int, ...]  # one per completion, groups in order
    prompt_width: int  # padded width of the prompt tensors the layout was built from
    completion_width: int  # padded width of the completion tensors
    # consecutive groups per family, and per family the prompt tokens its groups share (V); () = a family per group
    families: tuple[int, ...] = ()
    shared_lens: tuple[int, ...] = ()
    group_starts: tuple[int, ...] = field(init=False)  # where group g's own prompt tokens (Qg) start in the row
    response_starts: tuple[int, ...] = field(init=False)
    family_starts: tuple[int, ...] = field(init=False)
    total_len: int = field(init=False)

    def __post_init__(self) -> None:
        if not self.families:
            object.__setattr__(self, "families", (1,) * len(self.group_sizes))
            object.__setattr__(self, "shared_lens", (0,) * len(self.group_sizes))
        if sum(self.families) != len(self.group_sizes) or len(self.shared_lens) != len(self.families):
            raise LayoutError(f"families {list(self.families)} (shared {list(self.shared_lens)}) do not cover the "
                              f"{len(self.group_sizes)} groups")
        group_starts, response_starts, family_starts = [], [], []
        cursor, n, g = 0, 0, 0
        for size, shared in zip(self.families, self.shared_lens):
            members = range(g, g + size)
            if shared < 0 or (shared and any(self.prefix_lens[m] <= shared for m in members)):
                raise LayoutError(f"family of groups {list(members)} shares {shared} prompt tokens; each prompt "
                                  f"needs at least one of its own (prompt lengths {[self.prefix_lens[m] for m in members]})")
            family_starts.append(cursor)
            cursor += shared
            for m in members:
                group_starts.append(cursor)
                cursor += self.prefix_lens[m] - shared
                for _ in range(self.group_sizes[m]):
                    response_starts.append(cursor)
                    cursor += self.completion_lens[n]
                    n += 1
            g += size
        object.__setattr__(self, "group_starts", tuple(group_starts))
        object.__setattr__(self, "response_starts", tuple(response_starts))
        object.__setattr__(self, "family_starts", tuple(family_starts))
        object.__setattr__(self, "total_len", cursor)

    @classmethod
    def from_masks(
        cls, prompt_mask: torch.Tensor, completion_mask: torch.Tensor, group_sizes: int | Sequence[int],
        families: Sequence[int] = (), shared_lens: Sequence[int] = (),
    ) -> GroupLayout:
        prefix_lens = _left_padded_lengths(prompt_mask)
        completion_lens = _right_padded_lengths(completion_mask)
        sizes = normalize_group_sizes(group_sizes, len(prefix_lens), len(completion_lens))
        return cls(sizes, tuple(prefix_lens), tuple(completion_lens), prompt_mask.shape[1], completion_mask.shape[1],
                   tuple(families), tuple(shared_lens))

    @property
    def shares(self) -> bool:
        """Whether any family shares prompt tokens (the plain layout, one prompt per family, does not)."""
        return any(self.shared_lens)

    @cached_property
    def shared_of_group(self) -> tuple[int, ...]:
        """Per group: the prompt tokens it shares with its family (V), 0 outside a sharing family."""
        return tuple(shared for size, shared in zip(self.families, self.shared_lens) for _ in range(size))

    @cached_property
    def question_lens(self) -> tuple[int, ...]:
        """Per group: its own prompt tokens in the row (Qg: the prompt after V; the whole prompt when V = 0)."""
        return tuple(p - s for p, s in zip(self.prefix_lens, self.shared_of_group))

    @cached_property
    def family_spans(self) -> tuple[tuple[int, int, list[tuple[int, list[int]]]], ...]:
        """Per family: (start in the packed row, V's length, [(Qg's length, Rg's completion lengths) per group])."""
        spans, g, n = [], 0, 0
        for f, (size, shared) in enumerate(zip(self.families, self.shared_lens)):
            members = []
            for m in range(g, g + size):
                members.append((self.question_lens[m], list(self.completion_lens[n : n + self.group_sizes[m]])))
                n += self.group_sizes[m]
            spans.append((self.family_starts[f], shared, members))
            g += size
        return tuple(spans)

    @cached_property
    def shared_tokens(self) -> int:
        """Prompt tokens the families did not repeat: V once per family instead of once per question."""
        return sum(shared * (size - 1) for size, shared in zip(self.families, self.shared_lens))

    @property
    def num_groups(self) -> int:
        return len(self.group_sizes)

    @property
    def num_completions(self) -> int:
        return len(self.completion_lens)

    @cached_property
    def group_of_completion(self) -> tuple[int, ...]:
        return tuple(g for g, size in enumerate(self.group_sizes) for _ in range(size))

    @cached_property
    def group_spans(self) -> tuple[tuple[int, int, list[int]], ...]:
        """Per group: (start in the packed row, prefix length, completion lengths). A layout whose families share
        prompt tokens has no such spans (a group's prompt is not contiguous): use ``family_spans``."""
        if self.shares:
            raise LayoutError("this layout's families share prompt tokens; its groups' prompts are not contiguous "
                              "spans of the row (family_spans describes it)")
        spans, n = [], 0
        for g, size in enumerate(self.group_sizes):
            spans.append((self.group_starts[g], self.prefix_lens[g], list(self.completion_lens[n : n + size])))
            n += size
        return tuple(spans)

    # ---- index tensors (built on CPU once, moved by callers) -------------------------------------------------
    @cached_property
    def pack_index(self) -> torch.Tensor:
        """Index into cat(prompts.flatten(0,1), completions.flatten(0,1)) giving the packed row."""
        prompt_count = self.num_groups * self.prompt_width
        parts, n, g = [], 0, 0
        for family, shared in zip(self.families, self.shared_lens):
            if shared:  # V: the family's first prompt's first tokens
                first = g * self.prompt_width + self.prompt_width - self.prefix_lens[g]
                parts.append(torch.arange(first, first + shared))
            for m in range(g, g + family):
                row = m * self.prompt_width
                parts.append(torch.arange(row + self.prompt_width - self.prefix_lens[m] + shared,
                                          row + self.prompt_width))
                for _ in range(self.group_sizes[m]):
                    base = prompt_count + n * self.completion_width
                    parts.append(torch.arange(base, base + self.completion_lens[n]))
                    n += 1
            g += family
        return torch.cat(parts)

    @cached_property
    def predict_index(self) -> torch.Tensor:
        """Packed position whose output predicts each real completion token (completion order, token order).

        The first token of a completion is predicted by the last prefix token, the others by the previous token of
        the same completion, exactly as in [P;Ri].
        """
        parts = []
        for n, start in enumerate(self.response_starts):
            g = self.group_of_completion[n]
            last_prefix = self.group_starts[g] + self.question_lens[g] - 1
            parts.append(torch.tensor([last_prefix]))
            parts.append(torch.arange(start, start + self.completion_lens[n] - 1))
        return torch.cat(parts)

    @cached_property
    def target_index(self) -> torch.Tensor:
        """Flat index (n * completion_width + j) of each real completion token, same order as predict_index."""
        return torch.cat(
            [torch.arange(n * self.completion_width, n * self.completion_width + length)
             for n, length in enumerate(self.completion_lens)]
        )

    @cached_property
    def segment_ids(self) -> torch.Tensor:
        """Per packed token: 0 for prefix tokens, 1 + global completion index for response tokens."""
        seg = torch.zeros(self.total_len, dtype=torch.long)
        for n, start in enumerate(self.response_starts):
            seg[start : start + self.completion_lens[n]] = n + 1
        return seg

    @cached_property
    def group_ids(self) -> torch.Tensor:
        """Per packed token: its group; a family's V tokens (seen by all its groups) carry the first group's."""
        ids = torch.empty(self.total_len, dtype=torch.long)
        g = 0
        for f, family in enumerate(self.families):
            ids[self.family_starts[f] : self.group_starts[g]] = g
            for m in range(g, g + family):
                end = self.group_starts[m + 1] if m + 1 < self.num_groups else self.total_len
                end = min(end, self.family_starts[f + 1]) if f + 1 < len(self.families) else end
                ids[self.group_starts[m] : end] = m
            g += family
        return ids

    @cached_property
    def shared_ids(self) -> torch.Tensor:
        """Per packed token: 1 + its family's index for a V token (seen by every group of the family), 0 else."""
        ids = torch.zeros(self.total_len, dtype=torch.long)
        for f, (start, shared) in enumerate(zip(self.family_starts, self.shared_lens)):
            ids[start : start + shared] = f + 1
        return ids

    @cached_property
    def family_ids(self) -> torch.Tensor:
        """Per packed token: its family."""
        ids = torch.empty(self.total_len, dtype=torch.long)
        for f, start in enumerate(self.family_starts):
            end = self.family_starts[f + 1] if f + 1 < len(self.families) else self.total_len
            ids[start:end] = f
        return ids

    # ---- packing -------------------------------------------------------------------------------------------
    def pack(self, prompt_values: torch.Tensor, completion_values: torch.Tensor) -> torch.Tensor:
        """[B, Lp, ...] and [N, Lc, ...] -> [T, ...] (differentiable)."""
        self._check_shapes(prompt_values, completion_values)
        flat = torch.cat([prompt_values.flatten(0, 1), completion_values.flatten(0, 1).to(prompt_values.dtype)])
        return flat.index_select(0, self.pack_index.to(flat.device))

    def unpack_completion_tokens(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[K, ...] values in predict_index order -> [N, Lc, ...] aligned with completion tokens, ``fill`` at pads."""
        shape = (self.num_completions * self.completion_width, *values.shape[1:])
        out = values.new_full(shape, fill)
        out = out.index_copy(0, self.target_index.to(values.device), values)
        return out.view(self.num_completions, self.completion_width, *values.shape[1:])

    def _check_shapes(self, prompt_values: torch.Tensor, completion_values: torch.Tensor) -> None:
        if tuple(prompt_values.shape[:2]) != (self.num_groups, self.prompt_width):
            raise LayoutError(
                f"prompt tensor has shape {tuple(prompt_values.shape)}, layout expects "
                f"[{self.num_groups}, {self.prompt_width}, ...]"
            )
        if tuple(completion_values.shape[:2]) != (self.num_completions, self.completion_width):
            raise LayoutError(
                f"completion tensor has shape {tuple(completion_values.shape)}, layout expects "
                f"[{self.num_completions}, {self.completion_width}, ...]"
            )

    # ---- accounting ----------------------------------------------------------------------------------------
    @property
    def packed_tokens(self) -> int:
        return self.total_len

    @property
    def repeated_tokens(self) -> int:
        """Real tokens the [P;Ri]-per-row baseline processes for the same batch."""
        n, total = 0, 0
        for g, size in enumerate(self.group_sizes):
            for _ in range(size):
                total += self.prefix_lens[g] + self.completion_lens[n]
                n += 1
        return total
