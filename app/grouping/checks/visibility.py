"""The exact half of the self-check, part two: who sees whom. Which tokens reach a completion token through an
attention layer (visibility) or through a Gated DeltaNet layer (its recurrent state and its causal conv's window)
are sets of tokens, so they are compared exactly, at every dtype, against the repeated row [P;Ri]: completion n's
token j must be reached by P's real tokens and its own first j + 1 tokens, in that order, and by nothing else.

The grouped side is probed, not recomputed: the first attention layer's and the first GDN layer's plan (what the
grouped forward handed them) run on inputs whose outputs name their sources.

- attention: q = k = 0 (every visible key weighs the same), v one-hot over a block of keys: output slot i is
  nonzero exactly where key i is visible;
- GDN: no decay (g = 0), beta = 1, each key of a block one-hot in its own slot (orthogonal writes: the delta rule
  only adds), q = 1: output slot i is nonzero exactly where token i wrote the state the token reads; once with the
  conv reading the current token only (the state handed from segment to segment) and once reading ``W - 1``
  tokens back (the conv inputs handed on: completion token j is then reached by the first j + 1 - (W - 1) tokens
  of its path).

The expected side comes from the batch alone (each prompt's real token ids, each completion's) and the repeated
forward's own position ids (``positions.recorded_positions``): the grouped row's token ids and positions at the
probed sources, in row order, must equal the repeated row's. Within a group of long rows the completion tokens
checked are limited (``MAX_CELLS``): first, second, middle and last of every completion.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from app.grouping.modules import unwrap

MAX_CELLS = 1 << 26  # completion tokens checked x row length above which each completion is sampled


@dataclass
class Recorded:
    """What the grouped forward handed the token mixers: (layer index, module, plan) per kind, and the token ids
    of every forward of the block, in order."""

    mixers: dict = field(default_factory=dict)
    ids: list = field(default_factory=list)


@contextlib.contextmanager
def recorded_mixers(model):
    from app.grouping.attention import PLAN_KWARG
    from app.grouping.precision import decoder_layers

    seen = Recorded()
    handles = []
    inner = unwrap(model)
    for index, kind, module in decoder_layers(inner):
        if kind not in ("full_attention", "linear_attention"):
            continue

        def hook(mod, args, kwargs, kind=kind, index=index):
            plan = kwargs.get(PLAN_KWARG)
            if plan is not None and kind not in seen.mixers:
                seen.mixers[kind] = (index, mod, plan)

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def ids(mod, args, kwargs):
        given = kwargs.get("input_ids", args[0] if args else None)
        if given is not None:
            seen.ids.append(given.detach())

    handles.append(inner.register_forward_pre_hook(ids, with_kwargs=True))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _queries(layout) -> tuple[list[int], list[int], list[int]]:
    """(row index, completion, token) of every completion token checked."""
    rows, completions, tokens = [], [], []
    sample = len(layout.completion_lens) and sum(layout.completion_lens) * layout.total_len > MAX_CELLS
    for n, (start, length) in enumerate(zip(layout.response_starts, layout.completion_lens)):
        picks = sorted({0, min(1, length - 1), length // 2, length - 1}) if sample else range(length)
        for j in picks:
            rows.append(start + j)
            completions.append(n)
            tokens.append(j)
    return rows, completions, tokens


def _attention_sources(module, plan, total: int, rows: torch.Tensor, *, dtype, device) -> torch.Tensor:
    """[len(rows), total] bool: the keys each probed query sees through ``plan``."""
    heads = getattr(module, "config", None)
    kv_heads = getattr(heads, "num_key_value_heads", None) or 1
    dim = int(getattr(module, "head_dim", 0) or 64)
    block = kv_heads * dim
    seen = torch.zeros(len(rows), total, dtype=torch.bool, device=device)
    q = torch.zeros(1, kv_heads, total, dim, dtype=dtype, device=device)
    for begin in range(0, total, block):
        width = min(block, total - begin)
        v = torch.zeros(1, kv_heads, total, dim, dtype=dtype, device=device)
        slots = torch.arange(width, device=device)
        v[0, slots // dim, begin + slots, slots % dim] = 1
        out = plan.attend(module, q, q, v)  # [1, total, heads, dim]
        got = out[0].index_select(0, rows).reshape(len(rows), -1)[:, :width]
        seen[:, begin:begin + width] = got > 0
    return seen


def _linear_sources(module, plan, total: int, rows: torch.Tensor, lag: int, *, dtype, device) -> torch.Tensor:
    """[len(rows), total] bool: the tokens whose writes the state each probed token reads holds, with the conv
    reading ``lag`` tokens back along the path."""
    from app.grouping.recurrent.layer import run_segments
    from app.grouping.recurrent.segments import segments_of

    key_heads, value_heads = module.num_k_heads, module.num_v_heads
    dk, dv = module.head_k_dim, module.head_v_dim
    width_k, repeat = min(dk, dv), value_heads // key_heads
    key_dim = key_heads * dk
    segments = segments_of(plan)
    taps = module.conv_kernel_size
    weight = torch.zeros(2 * key_dim + value_heads * dv, taps, dtype=dtype, device=device)
    weight[:, taps - 1 - lag] = 1
    beta = torch.ones(total, value_heads, dtype=dtype, device=device)
    g = torch.zeros(total, value_heads, dtype=torch.float32, device=device)
    block = key_heads * width_k
    seen = torch.zeros(len(rows), total, dtype=torch.bool, device=device)
    for begin in range(0, total, block):
        width = min(block, total - begin)
        mixed = torch.zeros(total, 2 * key_dim + value_heads * dv, dtype=dtype, device=device)
        mixed[:, :key_dim] = 1  # q
        slots = torch.arange(width, device=device)
        head, slot = slots // width_k, slots % width_k
        mixed[begin + slots, key_dim + head * dk + slot] = 1  # k: its own slot of its block's key head
        for r in range(repeat):  # v: the same slot in every value head reading that key head
            mixed[begin + slots, 2 * key_dim + (head * repeat + r) * dv + slot] = 1
        out = run_segments(module, segments, mixed, beta=beta, g=g, weight=weight, heads=(key_heads, value_heads))
        got = out.index_select(0, rows)[:, ::repeat, :width_k].reshape(len(rows), -1)[:, :width]  # [rows, block]
        seen[:, begin:begin + width] = got.float() > 0.5 * got.float().amax().clamp_min(1e-30)
    return seen


def _compare(seen, rows, completions, tokens, *, lag, grouped_ids, grouped_pos, expected_ids, expected_pos,
             layout) -> str | None:
    """The first probed completion token whose sources differ from [P;Ri]'s, as a sentence, or None."""
    counts = seen.sum(1)
    for r, (n, j) in enumerate(zip(completions, tokens)):
        want = max(expected_ids[n].shape[0] - (layout.completion_lens[n] - j - 1) - lag, 0)
        where = seen[r].nonzero().flatten()
        ids, pos = grouped_ids[where], grouped_pos[:, where]
        good = int(counts[r]) == want and torch.equal(ids, expected_ids[n][:want]) and \
            torch.equal(pos, expected_pos[n][:, :want])
        if good:
            continue
        return (f"completion {n}, token {j} is reached by {int(counts[r])} tokens where its repeated row [P;R{n}] "
                f"gives {want}" + _difference(where, ids, pos, expected_ids[n][:want], expected_pos[n][:, :want],
                                              n=n, layout=layout))
    return None


def _difference(where, ids, pos, want_ids, want_pos, *, n: int, layout) -> str:
    """Where the grouped sources first part from the repeated row's."""
    siblings = sorted({_completion_at(int(i), layout) for i in where} - {None, n})
    if siblings:
        return f"; it is reached by completion(s) {siblings}"
    same = min(len(ids), len(want_ids))
    differ = ((ids[:same] != want_ids[:same]) | (pos[:, :same] != want_pos[:, :same]).any(0)).nonzero()
    if len(differ):
        i = int(differ[0, 0])
        return (f"; its source {i} is the packed row's token {int(where[i])} (id {int(ids[i])}, positions "
                f"{pos[:, i].tolist()}) where [P;R{n}] has id {int(want_ids[i])}, positions {want_pos[:, i].tolist()}")
    if len(ids) < len(want_ids):
        return f"; it misses [P;R{n}]'s tokens from its {len(ids)}th on"
    return f"; {len(ids) - len(want_ids)} tokens beyond [P;R{n}]'s reach it"


def _completion_at(index: int, layout):
    for n, (start, length) in enumerate(zip(layout.response_starts, layout.completion_lens)):
        if start <= index < start + length:
            return n
    return None


def sources_mismatch(recorded: Recorded, positions, prompts, completion_ids, completion_mask, group_sizes, *,
                     layout) -> tuple[str, str] | None:
    """(sentence, layer kind) for the first layer kind and completion token whose sources differ from the repeated
    row's, or None.
    ``positions``: ``recorded_positions`` of the same block (grouped first, repeated second)."""
    from app.grouping.recurrent.layer import MARK

    if not recorded.ids or len(positions) < 2 or not recorded.mixers:
        return None
    grouped_ids = recorded.ids[0][0]
    axes = min(positions[0].shape[0], positions[1].shape[0])
    grouped_pos, repeated_pos = positions[0][-axes:, 0], positions[1][-axes:]
    device = grouped_ids.device
    sizes = list(layout.group_sizes)  # normalised (an int given for every prompt)
    group = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).tolist()
    width = prompts["input_ids"].shape[1]
    expected_ids, expected_pos = [], []
    for n, g in enumerate(group):
        real = prompts["attention_mask"][g].bool()
        own = completion_mask[n].bool()
        expected_ids.append(torch.cat([prompts["input_ids"][g][real], completion_ids[n][own]]).to(device))
        keep = torch.cat([real, own]).to(repeated_pos.device)
        expected_pos.append(repeated_pos[:, n, :width + own.shape[0]][:, keep].to(device))
    rows, completions, tokens = _queries(layout)
    index = torch.tensor(rows, dtype=torch.long, device=device)
    common = dict(grouped_ids=grouped_ids, grouped_pos=grouped_pos.to(device), expected_ids=expected_ids,
                  expected_pos=expected_pos, layout=layout)
    for kind, (layer, module, plan) in recorded.mixers.items():
        dtype = next(module.parameters()).dtype
        if kind == "full_attention":
            probes = [(0, _attention_sources(module, plan, layout.total_len, index, dtype=dtype, device=device))]
            name = f"attention layer {layer}"
        else:
            if not getattr(module, MARK, False):
                return (f"Gated DeltaNet layer {layer} runs transformers' own recurrence across the packed row, not "
                        "segment by segment (app.grouping.recurrent.layer.install)", kind)
            taps = module.conv_kernel_size
            probes = [(lag, _linear_sources(module, plan, layout.total_len, index, lag, dtype=dtype, device=device))
                      for lag in (0, taps - 1)]
            name = f"Gated DeltaNet layer {layer}"
        for lag, seen in probes:
            found = _compare(seen, rows, completions, tokens, lag=lag, **common)
            if found is not None:
                what = (f"{name}'s recurrent state" if kind != "full_attention" and lag == 0 else
                        f"{name}'s conv inputs ({lag} tokens back)" if lag else name)
                return f"{what} (a {kind} layer): {found}", kind
    return None
