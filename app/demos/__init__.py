"""Demos that run the product end to end on the embedded default, on 2 CPU cores: ``video`` (``make demo``:
synthetic video QA, format warm start, GRPO, held-out accuracy), ``objectives`` (GRPO, GSPO, CISPO, SAPO side by
side), ``tools`` (multi-turn GRPO with tools on prefix trees). Each launches the real scripts.

May import: everything but ``app.bench``.
Exports: none (each module is an entry point: ``python -m app.demos.video`` ...).
"""
