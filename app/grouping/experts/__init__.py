"""Mixture-of-experts layers in a packed row: which experts each token goes to, recorded, replayed and counted per
logical token (the token of the repeated layout [P;Ri], where a prompt token shared by G responses counts G times).

transformers owns the sparse block (a top-k router ``gate`` and fused 3-D ``experts``), or under expert parallelism
DeepSpeed's AutoEP owns its replacement (``AutoEPMoELayer``: a router and the rank's share of the experts, an
all-to-all between ranks); routing is per token, so the grouped layout needs nothing to be exact. What this package adds, through one instance patch per sparse decoder
layer and its router (``routing.install``), driven by a ``RoutePlan`` passed in the forward's keyword arguments
(``routing.ROUTING_KWARG``, which survives activation checkpointing's recompute):
- ``blocks``: the sparse layers of a model (either kind of block), its expert count and top-k, the experts
  implementation, its expert-parallel size;
- ``routers``: a router as a plan routes it (transformers' ``HFRouter``, AutoEP's ``EPRouter``), ``RoutingError``;
- ``routing``: ``Routing`` (the routed expert ids of every prompt and completion token in the prompts' and
  completions' own coordinates, int16, the layout-independent record), ``RoutePlan`` (one forward's replay, record
  and statistics), the maps between a record and a layout's token order;
- ``statistics``: ``RouterStatistics`` (per sparse layer: tokens per expert and router probability mass, each
  token weighted by its repeat count, and entropy), ``token_repeats`` for a layout.

May import: ``app.grouping``'s own modules (torch and transformers only).
"""
