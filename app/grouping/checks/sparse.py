"""The exact half of the self-check, part three: what a Qwen3.8-Flash-Next row's sparse layers read. Which keys a
QSA layer's query attends to (its chosen blocks and its tail) and which n-gram rows a PLE layer looks up (the token
hashed with the two before it) are sets of integers, so they are compared exactly against the repeated row [P;Ri],
completion token by completion token, as places along the path (a key's rank: its index in [P;Ri]). So are the
tokens a PLE layer's dilated conv reads (each earlier tap's token and its place along the path, against the tokens
transformers' conv reads at those offsets in [P;Ri]); the values they carry are the numeric comparison's.

In float32 the two layouts choose alike. In lower precision a query whose last chosen block and first left-out one
score within rounding (``TIE_MARGIN`` of its best score, in either layout) may choose differently: such a flip is a
tie, counted and allowed (as the routers' near-ties are); any other difference stops the run naming the layer kind,
the completion and the token.
"""

from __future__ import annotations

import contextlib

import torch

TIE_MARGIN = 0.02  # of a query's best block score: a tie below float32 (a guess; the tiny bf16 check passes with it)


@contextlib.contextmanager
def recorded_choices(model):
    """Every QSA key mask (with its keys' ranks and each query's margin), every PLE table lookup and every PLE conv
    window of the forwards in the block, in order: ``records["qsa"]``, ``records["ngram"]``, ``records["conv"]`` (a
    packed row's: (tokens [t, K - 1], their places [t, K - 1], the token's own place [t], offsets); an ordinary
    batch's: the tokens [B, L, K - 1] its conv reads)."""
    from app.grouping.modules import unwrap
    from app.grouping.recurrent import ngrams
    from app.grouping.sparse import selection

    records = {"qsa": [], "ngram": [], "conv": []}
    raw: list = []
    selection.RECORDERS.append(raw)
    ngrams.RECORDERS.append(records["conv"])

    def ordinary(module, args, kwargs):  # an ordinary batch's call (a packed row's records itself)
        if module.__dict__.get(ngrams._ACTIVE) is None:
            ids = kwargs.get("input_ids", args[1] if len(args) > 1 else None)
            records["conv"].append(ngrams.row_windows(module, ids, kwargs.get("conv_mask")).cpu())

    modules = list(unwrap(model).modules())
    handles = [m.ngram_embedding.register_forward_hook(lambda mod, args, out: records["ngram"].append(args[0].cpu()))
               for m in modules if hasattr(m, "ngram_embedding")]
    handles += [m.register_forward_pre_hook(ordinary, with_kwargs=True) for m in modules if ngrams.is_ple(m)]
    try:
        yield records
    finally:
        selection.RECORDERS.remove(raw)
        ngrams.RECORDERS.remove(records["conv"])
        for handle in handles:
            handle.remove()
        margin = None
        for entry in raw:  # a chunk's margins come before its keys
            if entry[0] == "margin":
                margin = entry[1] / entry[2].clamp_min(1e-30)
            else:
                records["qsa"].append((entry[1], entry[2], margin))


def by_layer(chunks: list, total: int) -> list:
    """A forward's QSA chunks joined per layer (a layer's queries: ``total`` of them): (mask, ranks, margin)."""
    out, rows = [], 0
    for mask, ranks, margin in chunks:
        if rows:
            last = out[-1]
            out[-1] = (torch.cat([last[0], mask]), ranks, torch.cat([last[2], margin]))
        else:
            out.append((mask, ranks, margin))
        rows = (rows + mask.shape[0]) % total
    return out


def rank_sets(mask: torch.Tensor, ranks: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.zeros(mask.shape[0], width + 1, dtype=torch.bool)
    rows, keys = mask.nonzero(as_tuple=True)
    out[rows, ranks[keys].clamp(0, width)] = True
    return out[:, :width]


def choices_mismatch(grouped: dict, repeated: dict, layout, prompt_width: int, completion_mask, *,
                     exact: bool) -> tuple[str | None, int]:
    """(what first differs, or None; how many completion tokens chose otherwise within a tie) between the records
    of the grouped forward and the repeated one (``recorded_choices``); ``exact``: float32, no tie allowed."""
    width = completion_mask.shape[1]
    holds = layout.pack_index - layout.num_groups * prompt_width  # >= 0: completion token n * width + j
    tokens = [(p, *divmod(int(holds[p]), width)) for p in (holds >= 0).nonzero().flatten().tolist()]
    g_ids, r_ids = grouped["ngram"], repeated["ngram"]
    for layer, (packed, rows) in enumerate(zip(g_ids, r_ids)):
        for position, n, j in tokens:
            want = rows[n, prompt_width + j] if rows.dim() == 3 else rows[n * (prompt_width + width) + prompt_width + j]
            if not torch.equal(packed[position], want):
                return (f"PLE layer {layer} (an n-gram embedding): completion {n}, token {j} hashes to n-gram rows "
                        f"{packed[position].tolist()} where [P;R{n}] gives {want.tolist()} (its two tokens before are "
                        "not its path's)"), 0
    for layer, ((ids, places, own, offsets), rows) in enumerate(zip(grouped["conv"], repeated["conv"])):
        back = torch.tensor(offsets)
        for position, n, j in tokens:
            want = rows[n, prompt_width + j] if rows.dim() == 3 else rows[n * (prompt_width + width) + prompt_width + j]
            along = torch.where(ids[position] >= 0, own[position] - back, -1)
            if not (torch.equal(ids[position], want) and torch.equal(places[position], along)):
                return (f"PLE layer {layer} (its dilated conv): completion {n}, token {j} reads tokens "
                        f"{ids[position].tolist()} at places {places[position].tolist()} of its path, {offsets} back, "
                        f"where [P;R{n}] reads {want.tolist()} (its window is not its path's)"), 0
    ours, theirs = by_layer(grouped["qsa"], layout.total_len), by_layer(repeated["qsa"],
                                                                         len(completion_mask) * (prompt_width + width))
    ties = 0
    for layer, ((g_mask, g_ranks, g_margin), (r_mask, r_ranks, r_margin)) in enumerate(zip(ours, theirs)):
        limit = prompt_width + width
        a, b = rank_sets(g_mask, g_ranks, limit), rank_sets(r_mask, r_ranks, limit)
        for position, n, j in tokens:
            row = n * (prompt_width + width) + prompt_width + j
            if torch.equal(a[position], b[row]):
                continue
            near = min(float(g_margin[position]), float(r_margin[row])) <= TIE_MARGIN
            if exact or not near:
                only = (a[position] & ~b[row]).nonzero().flatten().tolist()[:4]
                rest = (b[row] & ~a[position]).nonzero().flatten().tolist()[:4]
                return (f"QSA layer {layer} (an indexed-attention layer): completion {n}, token {j} attends to keys "
                        f"at places {only} of its row that [P;R{n}] does not, and not to {rest}"), ties
            ties += 1
    return None, ties
