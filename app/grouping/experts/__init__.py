"""Mixture-of-experts layers in a packed row: which experts each token goes to, recorded, replayed and counted per
logical token (the token of the repeated layout [P;Ri], where a prompt token shared by G responses counts G times).

transformers owns the sparse block (a top-k router ``gate`` and fused 3-D ``experts``); another package may register a
kind of its own (``blocks.register_kind``: DeepSpeed AutoEP's expert-parallel replacement is
``app.runtime.expert_parallel``'s, which this package never names). Routing is per token, so the grouped layout needs
nothing to be exact. What this package adds, through one instance patch per sparse decoder layer and its router
(``patch.install``), driven by a ``RoutePlan`` passed in the forward's keyword arguments (``plan.ROUTING_KWARG``, which
survives activation checkpointing's recompute):
- ``blocks``: the sparse layers of a model (every registered kind), its expert count and top-k, the experts
  implementation, its expert-parallel size; ``config_expert_shape``, the one rule of what is a mixture of experts;
- ``routers``: transformers' router as a plan routes it (``HFRouter``), ``RoutingError``;
- ``record``: ``Routing`` (the routed expert ids of every prompt and completion token in the prompts' and
  completions' own coordinates, int16, the layout-independent record; it travels with a rollout as its other
  per-row tensors do, ``app.rollout.rows``), the maps between a record and a layout's token order, ``check_routing``;
- ``plan``: ``RoutePlan`` (one forward's replay, record and statistics), ``Routed`` (what a forward asks), the tie gap;
- ``patch``: the instance patches (``install``);
- ``statistics``: ``RouterStatistics`` (per sparse layer: tokens per expert and router probability mass, each
  token weighted by its repeat count, and entropy), ``token_repeats`` for a layout.
Two records compared (the self-check's, the benchmarks') is ``app.grouping.checks.routing``.

May import: ``app.grouping``'s own modules (torch and transformers only).
"""
