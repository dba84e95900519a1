"""Qwen3.8-Flash-Next's per-layer n-gram embedding (PLE) in a packed row: each token's n-gram context and dilated
conv window come from its own path.

transformers' ``Qwen4ExpTextPLELayer`` hashes each token with the ``ngram_size - 1`` tokens before it in the row (an
EOS before them resets the context to EOS) and mixes the gated values with a depthwise conv of kernel K and
dilation ``ngram_size`` over the row's earlier positions. In a packed [P; R1; R2], R2's first tokens would hash R1's
last tokens and convolve R1's tail. Here both read the token's path (``Segments.predecessors``: the tokens b steps
back along [ancestors; its segment], what [P;Ri] holds before it; none before a root, where transformers has its EOS
context and zero conv inputs): the n-gram of P's last tokens and Ri's first is that of [P;Ri], for every Ri.

Under sequence parallelism (a plan with ``sp`` and ``bounds``) each rank runs its shard's tokens: the n-gram ids from
the whole row's ids (the body hands every rank all of them), the conv's inputs at path positions another rank holds
fetched from it (``collectives.fetch_rows``: a few rows per segment start and shard edge; their gradients go back).

The layer runs grouped when its decoder layer carries a training plan (``attention.PLAN_KWARG``, which survives
activation checkpointing's recompute): ``install`` patches each decoder layer holding a PLE to hand the plan to it
for the call, chained with the other instance patches of the layer. Without a plan the class's forward runs.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F

from app.grouping.collectives import fetch_rows
from app.grouping.recurrent.segments import current_forward, segments_of, sequence_shard

MARK = "_prefix_grouping_ple"
_ACTIVE = "_prefix_grouping_ple_plan"
RECORDERS: list = []  # lists the self-check appends each grouped call's conv windows to (``checks.sparse``)


def is_ple(module) -> bool:
    """transformers' ``Qwen4ExpTextPLELayer`` and its kin: an n-gram embedding beside a dilated depthwise conv."""
    return hasattr(module, "ple_embedding") and hasattr(module, "conv1d") and hasattr(module, "short_conv_state_len")


def install(model, plan_kwarg: str) -> int:
    """Patch every decoder layer holding a PLE (its ``ple``) so that a plan in its keyword arguments reaches the PLE for
    the call, and the PLE itself (idempotent). Returns how many PLE layers the model has."""
    count = 0
    for layer in model.modules():
        ple = getattr(layer, "ple", None)
        if ple is None or not is_ple(ple):
            continue
        count += 1
        if getattr(layer, MARK, False):
            continue
        layer_forward = current_forward(layer)

        def forward(self, *args, _original=layer_forward, **kwargs):
            plan = kwargs.get(plan_kwarg)
            if plan is None:
                return _original(self, *args, **kwargs)
            object.__setattr__(self.ple, _ACTIVE, plan)
            try:
                return _original(self, *args, **kwargs)
            finally:
                self.ple.__dict__.pop(_ACTIVE, None)

        ple_forward = current_forward(ple)

        def ple_call(self, hidden_states, input_ids, past_key_values=None, conv_mask=None, _original=ple_forward):
            plan = self.__dict__.get(_ACTIVE)
            if plan is None:
                return _original(self, hidden_states, input_ids, past_key_values, conv_mask)
            return grouped_ple(self, hidden_states, input_ids, plan)

        object.__setattr__(layer, "forward", types.MethodType(forward, layer))
        object.__setattr__(ple, "forward", types.MethodType(ple_call, ple))
        object.__setattr__(layer, MARK, True)
    return count


def path_ngram_ids(embedding, input_ids: torch.Tensor, before: torch.Tensor, own: slice = slice(None)) -> torch.Tensor:
    """[t, heads] the n-gram table rows of a packed row's tokens ``own`` (all of them by default; ``input_ids`` [T],
    the whole row), each hashed with the tokens before it along its path (``before`` [t, n - 1]: row indices b = 1 ..
    n - 1 steps back, -1 none), as ``Qwen4ExpTextNGramEmbedding`` hashes [P;Ri]: a missing token and any token at or
    before the last EOS among them read as EOS."""
    eos = embedding.eos_token_id
    ids = input_ids.long()
    previous = torch.where(before >= 0, ids[before.clamp_min(0)], eos)  # [t, n - 1]
    reset = (previous == eos).long().cummax(dim=1).values.bool()  # an EOS b steps back resets b, b + 1, ...
    shifted = [ids[own], *torch.where(reset, eos, previous).unbind(1)]
    multipliers = embedding.layer_multipliers
    blocks = []
    for ngram in range(2, embedding.ngram_size + 1):
        start = (ngram - 2) * embedding.heads_per_ngram
        end = start + embedding.heads_per_ngram
        mixed = shifted[0] * multipliers[0]
        for position in range(1, ngram):
            mixed = torch.bitwise_xor(mixed, shifted[position] * multipliers[position])
        sizes, offsets = embedding.ngram_heads_vocab_sizes[start:end], embedding.ngram_heads_offsets[start:end]
        blocks.append(torch.remainder(mixed[:, None], sizes[None]) + offsets[None])
    return torch.cat(blocks, dim=-1)


def tap_offsets(module) -> list[int]:
    """How far back each of the conv's earlier taps reads (tap j: (K - 1 - j) x dilation); the last tap is the token."""
    kernel, dilation = module.conv1d.kernel_size[0], module.conv1d.dilation[0]
    return [(kernel - 1 - j) * dilation for j in range(kernel - 1)]


def row_windows(module, input_ids: torch.Tensor, conv_mask: torch.Tensor | None) -> torch.Tensor:
    """[B, L, K - 1] the token each earlier conv tap reads in an ordinary batch's rows, as transformers' conv over
    the row reads it (``tap_offsets`` back; -1 before the row or on padding, whose inputs it zeroes)."""
    ids = input_ids.long()
    real = torch.ones_like(ids, dtype=torch.bool) if conv_mask is None else conv_mask.bool()
    places = torch.arange(ids.shape[1], device=ids.device)
    out = []
    for offset in tap_offsets(module):
        source = (places - offset).clamp_min(0)[None].expand_as(ids)
        out.append(torch.where((places >= offset)[None] & real.gather(1, source), ids.gather(1, source), -1))
    return torch.stack(out, dim=-1)


def grouped_ple(module, hidden_states: torch.Tensor, input_ids: torch.Tensor, plan) -> torch.Tensor:
    """The PLE layer over one packed row (``hidden_states`` [1, t, S x H]: the whole row, or this rank's shard of it
    under sequence parallelism; ``input_ids`` [1, T], the whole row's), every token's n-gram context and conv window
    taken along its path (``segments_of(plan)``) -> [1, t, S x H]."""
    if hidden_states.shape[0] != 1:
        raise ValueError(f"a grouped PLE layer takes one packed row (batch 1), got batch {hidden_states.shape[0]}")
    segments = segments_of(plan)
    sp, bounds = sequence_shard(plan)
    start, end = bounds[sp.rank] if sp is not None else (0, segments.total)
    if hidden_states.shape[1] != end - start or input_ids.shape[-1] != segments.total:
        raise ValueError(f"the PLE layer got {hidden_states.shape[1]} positions and {input_ids.shape[-1]} ids; the "
                         f"plan's row has {segments.total} tokens, {end - start} of them here")
    embedding = module.ple_embedding
    kernel, dilation = module.conv1d.kernel_size[0], module.conv1d.dilation[0]
    reach = max(embedding.ngram_size - 1, (kernel - 1) * dilation)
    back = segments.predecessors(reach)[start:end].to(hidden_states.device)  # [t, reach]: positions of the row
    rows = path_ngram_ids(embedding, input_ids[0].to(hidden_states.device), back[:, : embedding.ngram_size - 1],
                          slice(start, end))
    table = embedding.ngram_embedding
    embeddings = table(rows.to(table.weight.device)).to(hidden_states.device).flatten(-2)[None]
    key_normed = module.norm_key(module.key_proj(embeddings)).unflatten(-1, (module.hc_count, module.hidden_size))
    value = module.value_proj(embeddings)
    query_normed = module.norm_query(hidden_states).unflatten(-1, (module.hc_count, module.hidden_size))
    gate = (key_normed * query_normed).sum(dim=-1, keepdim=True) / math.sqrt(module.hidden_size)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated_value = torch.sigmoid(gate) * value.unsqueeze(-2)
    normed = module.norm_conv(gated_value.flatten(-2))[0]  # [t, C]
    weight = module.conv1d.weight[:, 0].float()  # [C, K]; the taps summed in float32, as a conv accumulates
    taps = back[:, [offset - 1 for offset in tap_offsets(module)]]  # tap j's position, -1 none
    place = taps - start  # its row in ``padded``: this shard's rows, then those fetched, then the zero row
    elsewhere = (taps >= 0) & ((taps < start) | (taps >= end))
    fetched = normed[:0]
    if sp is not None:
        wanted = torch.unique(taps[elsewhere])  # ascending
        fetched = fetch_rows(normed, wanted, bounds, sp)
        place = torch.where(elsewhere, len(normed) + torch.searchsorted(wanted, taps), place)
    for record in RECORDERS:  # the self-check's: the tokens each tap reads and their places along the path
        ids, ranks = input_ids[0].to(taps.device), segments.path_positions.to(taps.device)
        record.append((torch.where(taps >= 0, ids[taps.clamp_min(0)], -1).cpu(),
                       torch.where(taps >= 0, ranks[taps.clamp_min(0)], -1).cpu(), ranks[start:end].cpu(),
                       tap_offsets(module)))
    padded = torch.cat([normed, fetched, normed.new_zeros(1, normed.shape[1])]).float()
    place = torch.where(taps >= 0, place, len(padded) - 1)  # a zero input before a root
    conv = padded[: len(normed)] * weight[:, kernel - 1]
    for j in range(kernel - 1):  # tap j reads (K - 1 - j) x dilation positions back along the path
        conv = conv + padded[place[:, j]] * weight[:, j]
    return gated_value.flatten(-2) + F.silu(conv.to(normed.dtype))[None]
