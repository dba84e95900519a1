"""Decoding with a shared prefix: the grouped KV cache and a decode step's attention (``cache``; through torch's
varlen kernel on CUDA: ``varlen``), the decoder (``decode``: eager, static-shape, CUDA graphs), the chunked prefill
(``prefill``), the shared video's prefill (``shared``), the kept static steps (``static``). Part of the grouping
core: imports nothing outside ``app.grouping``."""
