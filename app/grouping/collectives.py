"""Collectives of a sequence-parallel group with the gradients each one needs: an all-to-all of pieces that may
differ in length (``exchange``, Ulysses' turn of sequence shards into head shards and back, for attention and for
Gated DeltaNet layers alike), the whole row of a sharded tensor (``whole_row``: QSA's keys and values), the rows of
other shards that a shard's windows read (``fetch_rows``: PLE's conv along each token's path) and the sum of
per-rank scores (``SumScored``). ``sp`` is a ``sequence_parallel.SequenceParallel`` (its ``group``); this module
imports nothing of the grouping core.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def exchange(pieces: list[torch.Tensor], receive_lens: list[int], dim: int, sp) -> list[torch.Tensor]:
    """all-to-all of ``pieces`` (piece j to rank j) that may differ in length along ``dim``: padded to the
    longest for the exchange (gloo needs equal sizes), cut back to ``receive_lens[j]`` on arrival. Differentiable."""
    longest = max(max(p.shape[dim] for p in pieces), max(receive_lens))

    def pad(x):
        if x.shape[dim] == longest:
            return x.contiguous()
        shape = list(x.shape)
        shape[dim] = longest - x.shape[dim]
        return torch.cat([x, x.new_zeros(shape)], dim=dim).contiguous()

    got = AllToAll.apply(sp.group, *[pad(p) for p in pieces])
    return [g.narrow(dim, 0, n) for g, n in zip(got, receive_lens)]


class AllToAll(torch.autograd.Function):
    """Piece j to rank j of ``group``, on any backend (``dist.all_to_all``: gloo runs it too). torch's own
    ``torch.distributed.nn.functional.all_to_all`` plays it with ``scatter`` under gloo and passes group ranks
    where global ones are due, so it fails in any group but the one holding rank 0 (two replicas of S = 2)."""

    @staticmethod
    def forward(ctx, group, *pieces):
        ctx.group = group
        out = [torch.empty_like(p) for p in pieces]
        dist.all_to_all(out, list(pieces), group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        back = [torch.empty_like(g) for g in grads]
        dist.all_to_all(back, [g.contiguous() for g in grads], group=ctx.group)
        return (None, *back)


class SumScored(torch.autograd.Function):
    """Forward: the SP group's sum of tensors that are each zero except where their own rank scored (so every
    rank holds all values). Backward: the incoming gradient as it is (times ``scale``), since every rank computes
    the same loss from the sum and each rank's part only reaches the entries it scored."""

    @staticmethod
    def forward(ctx, x, group, scale=1.0):
        ctx.scale = scale
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (grad * ctx.scale if ctx.scale != 1.0 else grad), None, None


def gather(tensors: list[torch.Tensor], group, device=None) -> list[list[torch.Tensor]]:
    """Every rank's ``tensors`` (the same count on each; dimensions, sizes and dtypes per position alike, sizes free),
    per rank of ``group`` in group order, on every rank: shapes first, then each tensor padded to the largest, gathered
    and cut back. The one gather of variable-size tensors (a rollout's rows, a spread prefill's routing record, a
    sequence-parallel shard's record). Collectives on ``device`` (the GPU under nccl); results on each input's device
    and dtype; gloo and nccl do not gather int16/bool alike, so those travel as int32."""
    size = dist.get_world_size(group)
    if size == 1:
        return [tensors]
    device = device or (tensors[0].device if tensors else torch.device("cpu"))
    most = max([1] + [t.dim() for t in tensors])
    shapes = torch.tensor([[t.dim(), *t.shape, *[0] * (most - t.dim())] for t in tensors], dtype=torch.long,
                          device=device).reshape(len(tensors), most + 1)
    every = [torch.empty_like(shapes) for _ in range(size)]
    dist.all_gather(every, shapes, group=group)
    rows = [s.tolist() for s in every]
    out: list[list[torch.Tensor]] = [[] for _ in range(size)]
    for i, t in enumerate(tensors):
        dims = rows[0][i][0]
        largest = [max(r[i][1 + d] for r in rows) for d in range(dims)]
        wire = torch.int32 if t.dtype in (torch.int16, torch.int8, torch.uint8, torch.bool) else t.dtype
        padded = torch.zeros(largest, dtype=wire, device=device)
        padded[tuple(slice(0, n) for n in t.shape)] = t.to(device, wire)
        parts = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(parts, padded, group=group)
        for r, part in enumerate(parts):
            out[r].append(part[tuple(slice(0, n) for n in rows[r][i][1: 1 + dims])].to(t.device, t.dtype))
    return out


def whole_row(x: torch.Tensor, lengths: list[int], dim: int, sp) -> torch.Tensor:
    """Every rank's shard of a row (``lengths[r]`` positions along ``dim`` on rank r) joined in rank order, on every
    rank: the whole row. Differentiable: each shard's gradient is the sum of what every rank's use of it sends back."""
    return torch.cat(exchange([x] * sp.size, lengths, dim, sp), dim=dim)


def fetch_rows(local: torch.Tensor, wanted: torch.Tensor, bounds: list[tuple[int, int]], sp) -> torch.Tensor:
    """Rows ``wanted`` (positions of the whole row, ascending, none of them this rank's) of a tensor whose rows are
    sharded by ``bounds`` (rank r holds ``local`` = rows bounds[r][0] .. bounds[r][1] - 1), from the ranks that hold
    them -> [len(wanted), ...]. Every rank of the group calls it (with its own ``wanted``, empty or not).
    Differentiable: the rows' gradients go back to their holders."""
    start, end = bounds[sp.rank]
    marked = torch.cat([wanted.new_full((1,), -1), wanted.long()])  # never empty on the wire
    lists = [part[0][1:] for part in gather([marked], sp.group)]
    if not any(len(theirs) for theirs in lists):
        return local[:0]
    pieces = [local.index_select(0, (theirs[(theirs >= start) & (theirs < end)] - start).to(local.device))
              for theirs in lists]
    receive = [int(((wanted >= s) & (wanted < e)).sum()) for s, e in bounds]
    return torch.cat(exchange(pieces, receive, 0, sp))  # holders in rank order: ``wanted``'s own order
