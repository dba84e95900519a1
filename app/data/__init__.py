"""Data: the record schema and its checks (``records``: Video-R1's records, named errors, encoding a record or a
run of records on one video), the per-rank prompt stream with prefetch and runs of questions per video
(``stream``), video/image decoding through qwen-vl-utils (``video``), prompt templates and collation (``prompts``),
converters from published benchmark files (``convert``), synthetic demo data (``synthetic``: ``python -m
app.data.synthetic``).

May import: ``app.common``, ``app.answers`` (a record's problem type and whether its solution can be scored),
``app.grouping`` (the batch's media format, ``app.grouping.media``), ``app.runtime``.
Exports: none at package level (``synthetic`` and ``convert`` are entry points); import the modules.
"""
