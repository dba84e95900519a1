"""Sparse indexed attention (QSA, Qwen3.8-Flash-Next's ``qwen4_exp``) in a packed row and in ordinary batches.

Each query attends to the top ``indexer_budget / indexer_compress_ratio`` blocks of C consecutive keys among the
keys it sees, plus the incomplete tail block. Blocks are cut along the query's visible keys in order, so in a packed
row [P; R1; ...; RG] response Ri's blocks are those of [P; Ri]: P's own, one straddling P's end and Ri's start, then
Ri's. The layout says which keys each query sees (``recurrent.segments.Segments``: a group, a family sharing a video,
prefix trees); the selection reads it, so every layout gets it alike.

- ``selection``: the blocks of a row's keys, pooled once per block (``KeyBlocks``), and each query chunk's choice of
  them (``choose``: relu-summed index scores, top-k with ties to the earlier block, never a [T, T] score matrix), as
  a key mask; ``Geometry`` of a packed row or of a left-padded batch; a plain per-query reference (``reference``).
- ``layer``: the instance patches: in a packed row the attention layer runs over the selection chunk by chunk; in an
  ordinary batch (the repeated layout, HF generate) the indexer alone is replaced by the vectorised selection, the
  layer's own attention kept.

May import: ``app.grouping``'s own modules (torch and transformers only).
"""
