"""Prefix trees: groups whose rollouts share more than the prompt (multi-turn with tools). ``layout``: the trees,
their packed row and attention; ``forward``: per-token log-probs of every path from one packed row. Part of the
grouping core: imports nothing outside ``app.grouping``."""
