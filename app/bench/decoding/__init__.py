"""Rollout and decoding benchmarks: the grouped engine against HF generate and vLLM (``rollout``, with its vLLM
worker), one decode step eager against compiled (``decode_step``), chunked prefill of long prompts
(``long_prefill``)."""
