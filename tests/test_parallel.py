"""The parallel context: one object a recipe builds and passes on (no module state); S = 1 through the same methods.

Sequence parallelism over several ranks is tested end to end in tests/test_sequence_parallel.py and
tests/test_trainer.py (2 processes train like one, resume bit for bit)."""

from __future__ import annotations

import pytest
import torch

from app.grouping.sequence_parallel import SequenceParallel
from app.runtime.parallel import ParallelContext


def test_a_world_of_one_is_one_replica_with_a_group_of_one():
    ctx = ParallelContext.start(1)
    assert (ctx.rank, ctx.world, ctx.sp.size, ctx.dp_rank, ctx.dp_size, ctx.counts_once) == (0, 1, 1, 0, 1, True)
    assert ctx.dp_sum([1.5, 2.0]) == [1.5, 2.0]
    assert ctx.agree_max([4.0, -1.0]) == [4.0, -1.0]
    assert ctx.all_done(True) and not ctx.all_done(False)
    tensors = [torch.arange(3), torch.ones(2, 2)]
    assert all(a is b for a, b in zip(ctx.gather_in_group(tensors)[0], tensors))


def test_replica_arithmetic_follows_the_group():
    """Rank 5 of 8 with groups of 2: replica 2 of 4; a group's second rank adds nothing to replica sums."""
    ctx = ParallelContext(rank=5, world=8, sp=SequenceParallel(rank=1, size=2))
    assert (ctx.dp_rank, ctx.dp_size, ctx.counts_once) == (2, 4, False)
    assert ctx.dp_sum([7.0]) == [0.0]  # a world of one here: the sum is what this rank adds
    assert ParallelContext(rank=4, world=8, sp=SequenceParallel(rank=0, size=2)).dp_sum([7.0]) == [7.0]


def test_a_group_size_that_does_not_divide_the_world_is_named():
    with pytest.raises(ValueError, match="train.sequence_parallel_size=3 must divide the number of ranks"):
        ParallelContext.start(3)
