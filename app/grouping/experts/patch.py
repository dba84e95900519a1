"""The instance patches that make a ``plan.RoutePlan`` work: each sparse decoder layer's ``forward`` takes the plan
from its keyword arguments (``plan.ROUTING_KWARG``, popped there: attention never sees it) and hands it to its router
for the layer's call; the router routes as the plan says, by its own rule (``blocks.router_kind``: transformers'
router, or a kind another package registered, e.g. DeepSpeed AutoEP's). Activation checkpointing's recompute calls the
layer with the same arguments, so a replay holds in backward too. Without a plan the class's forwards run.
"""

from __future__ import annotations

import types

from app.grouping.experts.blocks import ExpertShape, expert_shape, is_sparse_block, kind_of, router_of, sparse_layers
from app.grouping.experts.plan import ROUTING_KWARG
from app.grouping.modules import current_forward

MARK = "_prefix_grouping_routing"
_ACTIVE = "_prefix_grouping_route"  # on a router, for the duration of its layer's call: (plan, layer index)


def _decoder_layers(model) -> list:
    """Every text decoder layer (a module with an ``mlp`` beside ``self_attn`` or ``linear_attn``)."""
    model = getattr(model, "module", model)
    return [m for m in model.modules() if hasattr(m, "mlp") and (hasattr(m, "self_attn") or hasattr(m, "linear_attn"))]


def install(model) -> ExpertShape | None:
    """Patch the decoder layers and routers of ``model`` (once; idempotent) so that a ``RoutePlan`` in a layer's
    keyword arguments drives its sparse block's routing (a dense layer of a MoE model just drops it). Returns the
    model's ``ExpertShape`` (None: a dense model, left unpatched)."""
    found = {id(s.layer): s for s in sparse_layers(model)}
    if not found:
        return None
    for layer in _decoder_layers(model):
        sparse = found.get(id(layer))
        router = router_of(sparse.block) if sparse is not None else None
        # a layer whose block was replaced since it was patched (AutoEP, at the engine's start) patches its new router
        if getattr(layer, MARK, False) and (router is None or getattr(router, MARK, False)):
            continue

        layer_forward = current_forward(layer)  # unbound (chained with other patches): a deep copy routes its own

        def forward(self, *args, _original=layer_forward, _index=sparse and sparse.index, **kwargs):
            plan = kwargs.pop(ROUTING_KWARG, None)
            router = router_of(self.mlp) if plan is not None and is_sparse_block(self.mlp) else None
            if router is None:
                return _original(self, *args, **kwargs)
            object.__setattr__(router, _ACTIVE, (plan, _index))
            try:
                return _original(self, *args, **kwargs)
            finally:
                router.__dict__.pop(_ACTIVE, None)

        object.__setattr__(layer, "forward", types.MethodType(forward, layer))
        object.__setattr__(layer, MARK, True)
        if router is None:
            continue
        router_forward, kind = type(router).forward, kind_of(sparse.block)

        def route(self, *args, _original=router_forward, _kind=kind, **kwargs):
            active = self.__dict__.get(_ACTIVE)
            if active is None:
                return _original(self, *args, **kwargs)
            return _kind.route(*active, self, _original, *args, **kwargs)  # plan, layer index, the router

        object.__setattr__(router, "forward", types.MethodType(route, router))
        object.__setattr__(router, MARK, True)
    return expert_shape(model)
