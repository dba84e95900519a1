"""The routing record: which experts each token went to, in the prompts' and completions' own coordinates.

``Routing``: ``prompt`` [B, Lp, S, k] aligned with the (left-padded) prompt ids and ``completion`` [N, Lc, S, k]
aligned with the (right-padded) completion ids, int16 (an expert id, or -1 where there is no token or nothing was
recorded): layout-independent, so a grouped row and the repeated rows read the same record (``for_packed`` /
``for_repeated``) and ``from_packed`` / ``from_repeated`` turn a forward's own order back into it. It travels with the
rollout as its other per-row tensors do (``app.rollout.rows``). ``check_routing``: a record that cannot be replayed
on a batch's tokens, refused naming the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from app.grouping.experts.blocks import ExpertShape
from app.grouping.experts.routers import RoutingError

MISSING = -1
RECORD_DTYPE = torch.int16  # one expert id per token, sparse layer and routed slot


@dataclass
class Routing:
    """Routed expert ids per token and sparse layer, in the prompts' and completions' own coordinates."""

    prompt: torch.Tensor  # [B, Lp, S, k] int16
    completion: torch.Tensor  # [N, Lc, S, k] int16
    layers: tuple[int, ...]  # decoder layer index of each of the S sparse layers

    @property
    def top_k(self) -> int:
        return int(self.prompt.shape[-1])

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.prompt, self.completion))

    # ---- a layout's token order ----------------------------------------------------------------------------
    def for_packed(self, layout) -> torch.Tensor:
        """[T, S, k] in the packed row's order (``GroupLayout.pack``)."""
        return layout.pack(self.prompt, self.completion)

    def for_repeated(self, group_sizes: Sequence[int]) -> torch.Tensor:
        """[N * (Lp + Lc), S, k]: the repeated rows [P_g(n); R_n], flattened as the model flattens its tokens."""
        group = torch.repeat_interleave(torch.arange(len(group_sizes)), torch.tensor(list(group_sizes)))
        return torch.cat([self.prompt[group.to(self.prompt.device)], self.completion], dim=1).flatten(0, 1)

    @staticmethod
    def from_packed(layout, packed: torch.Tensor, layers: Sequence[int]) -> Routing:
        """The record of a packed forward's [T, S, k] ids. A family's later questions hold its shared tokens V as
        the first question does (the row holds V once)."""
        b, lp, n, lc = layout.num_groups, layout.prompt_width, layout.num_completions, layout.completion_width
        flat = packed.new_full((b * lp + n * lc, *packed.shape[1:]), MISSING)
        flat[layout.pack_index.to(packed.device)] = packed
        prompt, completion = flat[: b * lp].view(b, lp, *packed.shape[1:]), flat[b * lp:].view(n, lc, *packed.shape[1:])
        g = 0
        for size, shared in zip(layout.families, layout.shared_lens):
            first = lp - layout.prefix_lens[g]
            for m in range(g + 1, g + size):
                start = lp - layout.prefix_lens[m]
                prompt[m, start:start + shared] = prompt[g, first:first + shared]
            g += size
        return Routing(prompt, completion, tuple(layers))

    @staticmethod
    def from_repeated(rows: torch.Tensor, prompt_width: int, group_sizes: Sequence[int], layers: Sequence[int],
                      prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> Routing:
        """The record of a repeated forward's [N * (Lp + Lc), S, k] ids: each prompt as its group's first row routed
        it (``disagreements`` tells whether the other rows did the same). Padding is -1."""
        n = completion_mask.shape[0]
        rows = rows.view(n, -1, *rows.shape[1:])
        firsts = torch.tensor([0, *torch.tensor(list(group_sizes)).cumsum(0)[:-1].tolist()])
        prompt = rows[firsts.to(rows.device), :prompt_width].clone()
        prompt[~prompt_mask.bool().to(rows.device)] = MISSING
        completion = rows[:, prompt_width:].clone()
        completion[~completion_mask.bool().to(rows.device)] = MISSING
        return Routing(prompt, completion, tuple(layers))


def check_routing(routing: Routing, shape: ExpertShape, prompt_mask: torch.Tensor, completion_mask: torch.Tensor,
                  name: Callable[[int], str] = lambda g: f"prompt {g}", group_sizes: Sequence[int] | None = None) -> None:
    """Refuse a record that cannot be replayed on these tokens, naming the prompt: another shape, another model's
    layers or top-k, an expert id out of range, or a real token without a record (each completion's LAST token may
    lack one: the rollout never fed it back, and no log-prob depends on its routing)."""
    (b, lp), (n, lc), s, k = prompt_mask.shape, completion_mask.shape, len(shape.layers), shape.top_k
    if tuple(routing.layers) != tuple(shape.layers) or routing.top_k != k:
        raise RoutingError(f"the routing record is of sparse layers {list(routing.layers)} with top-{routing.top_k}; "
                           f"this model routes layers {list(shape.layers)} with top-{k}")
    if tuple(routing.prompt.shape) != (b, lp, s, k) or tuple(routing.completion.shape) != (n, lc, s, k):
        raise RoutingError(f"the routing record's shapes {tuple(routing.prompt.shape)} / "
                           f"{tuple(routing.completion.shape)} do not match the batch's prompts [{b}, {lp}] and "
                           f"completions [{n}, {lc}] x {s} sparse layers x top-{k}")
    sizes = list(group_sizes) if group_sizes is not None else [n // b] * b
    group_of = torch.repeat_interleave(torch.arange(b), torch.tensor(sizes))
    last = torch.zeros_like(completion_mask, dtype=torch.bool)
    lengths = completion_mask.long().sum(1)
    last[torch.arange(n), (lengths - 1).clamp_min(0)] = lengths > 0
    for part, record, mask, owner in (("prompt", routing.prompt, prompt_mask.bool(), torch.arange(b)),
                                      ("completion", routing.completion, completion_mask.bool() & ~last, group_of)):
        record = record.to(mask.device)
        bad = ((record < 0) | (record >= shape.experts)).any(-1).any(-1) & mask
        if bool(bad.any()):
            row, position = (int(v) for v in bad.nonzero()[0])
            value = record[row, position]
            what = "has no record" if bool((value < 0).any()) else f"names expert ids {value.unique().tolist()} " \
                f"of {shape.experts}"
            raise RoutingError(f"{name(int(owner[row]))}: the routing record of its {part} token {position}"
                               f"{'' if part == 'prompt' else f' (completion {row})'} {what}; nothing is replayed "
                               "from another prompt")
