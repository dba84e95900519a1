"""The vision tower around the grouped forward: its passes (``passes``), the cache of a prompt's visual embeddings
across forwards (``cache``), and which tower calls a forward makes (``calls``, agreed across ranks under ZeRO-3).
Part of the grouping core: imports nothing outside ``app.grouping``."""
