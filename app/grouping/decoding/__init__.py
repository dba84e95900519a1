"""Decoding with a shared prefix: the grouped KV cache and decode steps (``decode``: eager, static-shape, CUDA
graphs), the chunked prefill (``prefill``). Part of the grouping core: imports nothing outside ``app.grouping``."""
