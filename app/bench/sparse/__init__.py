"""Benchmarks of sparse indexed attention (QSA, Qwen3.8-Flash-Next): the indexer's choice and the attention over it
at real lengths (``qsa``)."""
