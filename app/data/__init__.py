"""Data: the record schema and its checks (``records``: Video-R1's records, named errors, the prompt stream with
prefetch), video/image decoding through qwen-vl-utils (``video``), prompt templates and collation (``prompts``),
converters from published benchmark files (``convert``), synthetic demo data (``synthetic``: ``python -m
app.data.synthetic``).

May import: ``app.common``, ``app.answers`` (a record's problem type and whether its solution can be scored),
``app.runtime``.
Exports: none at package level (``synthetic`` and ``convert`` are entry points); import the modules.
"""
