"""The parallel context: where this rank sits, and the lock-step helpers every recipe needs.

W ranks = (W / S) data-parallel replicas x sequence-parallel groups of S consecutive ranks that share every packed
row (``train.sequence_parallel_size``; S = 1: each rank its own group). ``ParallelContext.start`` builds it once per
process, and it is passed explicitly to what needs it (the recipe, its scorer, its rollout engine): there is no
module state. The same methods serve S = 1 and S > 1; with one rank in a group its collectives are identities.

The plain world collectives (``all_reduce_sum``, ``all_reduce_max``, ``all_gather_floats``) are here too: float
lists in float64, on the device the backend reduces on, one collective each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from app.grouping.collectives import gather
from app.grouping.sequence_parallel import SequenceParallel
from app.runtime.distributed import local_device, rank, world_size


def _comm_tensor(values: list[float]) -> torch.Tensor:
    """float64 on the device the backend reduces on (nccl: the GPU; gloo: the CPU)."""
    device = local_device() if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    return torch.tensor(values, dtype=torch.float64, device=device)


def _several() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(values: list[float]) -> list[float]:
    tensor = _comm_tensor(values)
    if _several():
        dist.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_max(values: list[float]) -> list[float]:
    tensor = _comm_tensor(values)
    if _several():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def all_gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's ``values`` (the same length on each), in rank order: one collective."""
    tensor = _comm_tensor(values)
    if not _several():
        return [tensor.tolist()]
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return [p.tolist() for p in parts]


@dataclass(frozen=True)
class ParallelContext:
    """This rank (``rank`` of ``world``) and its sequence-parallel group ``sp`` (a ``SequenceParallel`` of size S,
    its gradients scaled for DeepSpeed's average over the world; size 1 when there is no sequence parallelism)."""

    rank: int = 0
    world: int = 1
    sp: SequenceParallel = field(default_factory=lambda: SequenceParallel(rank=0, size=1))

    @classmethod
    def start(cls, sequence_parallel_size: int = 1) -> ParallelContext:
        """This process's context, after ``distributed.init_distributed``: with S > 1 every rank creates every
        sequence-parallel group (collectively, in the same order) and keeps its own."""
        world, me, size = world_size(), rank(), max(1, sequence_parallel_size)
        if world % size:
            raise ValueError(f"train.sequence_parallel_size={size} must divide the number of ranks ({world})")
        mine = None
        if size > 1:
            for first in range(0, world, size):
                group = dist.new_group(list(range(first, first + size)))
                if first <= me < first + size:
                    mine = group
        return cls(rank=me, world=world, sp=SequenceParallel(rank=me % size, size=size, group=mine).for_averaging())

    @property
    def dp_rank(self) -> int:
        """Which data-parallel replica this rank belongs to (its SP group's index): what picks prompts and seeds."""
        return self.rank // self.sp.size

    @property
    def dp_size(self) -> int:
        return self.world // self.sp.size

    @property
    def pixel_share(self) -> tuple[int, int] | None:
        """(rank, S) whose share of a batch's video pixels this rank keeps (its part of the frame-split tower), or
        None without sequence parallelism."""
        return (self.sp.rank, self.sp.size) if self.sp.size > 1 else None

    @property
    def counts_once(self) -> bool:
        """Whether this rank's values enter data-parallel sums: one rank per SP group (the others hold copies)."""
        return self.sp.rank == 0

    def dp_sum(self, values: list[float]) -> list[float]:
        """``all_reduce_sum`` over the data-parallel replicas: each SP group's values counted once."""
        return all_reduce_sum(values if self.counts_once else [0.0] * len(values))

    @staticmethod
    def agree_max(values: list[float]) -> list[float]:
        """The element-wise maximum over every rank of the world (lock-step decisions: does any rank still
        decode, how many tower calls of each kind)."""
        return all_reduce_max(values)

    def all_done(self, done_here: bool) -> bool:
        """True on every rank once every rank is done (one collective)."""
        return self.agree_max([0.0 if done_here else 1.0])[0] == 0.0

    def all_in_group(self, true_here: bool) -> bool:
        """True on every rank of the SP group when it is true on every one of them (one collective; S = 1: as
        it is): a prompt whose share one rank could not decode is skipped by the whole group."""
        if self.sp.size == 1:
            return true_here
        tensor = _comm_tensor([1.0 if true_here else 0.0])
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.sp.group)
        return tensor.item() == 1.0

    def gather_in_group(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Every rank's ``tensors`` (the same count on each, shapes and sizes free), per rank of the SP group in
        group order, on every rank of it (``app.grouping.collectives.gather``: collectives on the backend's device,
        the GPU under nccl; results on the input's device and dtype)."""
        if self.sp.size == 1:
            return [tensors]
        device = local_device() if dist.get_backend() == "nccl" else torch.device("cpu")
        return gather(tensors, self.sp.group, device)
