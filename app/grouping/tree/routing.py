"""Routing replay on prefix trees (rollout.routing_replay=r3 with rollout.tools): the trees carry the experts each
token went to in the rollout (``PrefixTree.routing``, ``TreeNode.routing``, made by ``rollout.multiturn``), and the
tree forward and its reference (each path as its own row) route every token through them
(``experts.plan.RoutePlan``: the gate weights recomputed from the current router over the recorded experts).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.grouping.experts.plan import Routed
from app.grouping.experts.record import MISSING
from app.grouping.experts.routers import RoutingError
from app.grouping.modules import unwrap


def tree_replay(model, trees: Sequence) -> Routed:
    """The ``Routed`` of a replayed tree forward, after checking every tree's record against the model: the same
    sparse layers, expert ids in range, and a record for every token but a leaf's last (never fed back)."""
    from app.grouping.experts.patch import install

    shape = install(unwrap(model))
    if shape is None:
        raise RoutingError(f"a routing record was given, but {type(unwrap(model)).__name__} has no sparse layers")
    for i, tree in enumerate(trees):
        record = tree.packed_routing()
        if record is None:
            raise RoutingError(f"tree {i} of the micro-batch has no routing record (its rollout recorded none); "
                               "nothing is replayed from another prompt")
        if tuple(tree.layers) != tuple(shape.layers) or tuple(record.shape[1:]) != (len(shape.layers), shape.top_k):
            raise RoutingError(f"tree {i}: its routing record is of sparse layers {list(tree.layers)} x top-"
                               f"{record.shape[-1]}; this model routes layers {list(shape.layers)} with top-"
                               f"{shape.top_k}")
        missing = (record < 0).any(-1).any(-1)
        missing[[tree.starts[n] + tree.lengths[n] - 1 for n in tree.leaves]] = False
        bad = missing | (record >= shape.experts).any(-1).any(-1)
        if bool(bad.any()):
            where = int(bad.nonzero()[0])
            node = int(tree.node_of_token[where]) - 1
            part = "the prompt" if node < 0 else f"node {node}"
            raise RoutingError(f"tree {i}: the routing record of its token {where} ({part}) "
                               f"{'is missing' if bool(missing[where]) else 'names an expert out of range'}; "
                               "nothing is replayed from another prompt")
    return Routed(replay=True, shape=shape)


def forest_record(trees: Sequence, device) -> torch.Tensor:
    """[T, S, k] of the trees packed in one row (``TreeAttentionPlan``'s order)."""
    return torch.cat([tree.packed_routing().to(device) for tree in trees])


def paths_record(tree, width: int, device) -> torch.Tensor:
    """[paths * width, S, k]: each path's row [P; path] right-padded to ``width`` (-1), flattened as the model
    flattens the rows' tokens."""
    rows = [torch.cat([tree.routing, *[tree.nodes[n].routing for n in path]]).to(device) for path in tree.paths]
    return torch.cat([torch.cat([row, row.new_full((width - len(row), *row.shape[1:]), MISSING)]) for row in rows])
