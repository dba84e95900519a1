"""QSA at real lengths: transformers' indexer (a Python loop over every query) against this project's vectorised
choice, and the grouped layer over a packed row, time and peak memory.

    python -m app.bench.sparse.qsa --out docs/bench/qsa [--quick]      (scripts/bench.sh qsa)

One QSA layer of the tiny ``qwen4_exp`` model widened to the released indexer (4 index heads of 128, budget 2,048
keys in blocks of 4) and attention (hidden 512, 8 query / 2 KV heads of 128), random weights, float32, one row:

- ``reference`` / ``ours`` at 1k and 4k tokens: the indexer of an ordinary batch (transformers' 4-D causal mask),
  transformers' own forward against ``sparse.layer.vectorised_indexer``; both give the same keys (ties aside);
- ``grouped`` at 1k, 4k, 16k and 64k tokens: the layer over a packed row (``sparse.layer.grouped_qsa``: key blocks
  pooled once, the choice chunk by chunk of queries, masked attention over each chunk's keys), one prompt and one
  response of 64 tokens; no [T, T] tensor exists at any length.

Each point in its own process (peak RSS its own; ``--quick``: 256 and 512 tokens, here). CPU figures, float32: the
GPU path (torch's varlen kernel over each query's gathered keys, ``sparse.layer.gathered_attention``) is timed by
``scripts/gpu_check.sh --parts qsa``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from app.bench.common import cli, markdown_table, point, write_report

REFERENCE_LENGTHS, GROUPED_LENGTHS = (1024, 4096), (1024, 4096, 16384, 65536)
RESPONSE = 64


def layer():
    """A QSA layer at the released indexer's sizes (and its model's rotary), random weights."""
    from transformers import Qwen4ExpConfig

    from app.grouping.sparse.layer import is_qsa
    from app.runtime.models import TinySizes, build_tokenizer, model_class, tiny_config

    config = tiny_config("qwen4_exp", build_tokenizer(), TinySizes(hidden=512, heads=8, kv_heads=2, head_dim=64,
                                                                    hybrid_layers=2, max_positions=131072))
    text = config.text_config
    text.indexer_n_heads, text.indexer_head_dim, text.indexer_budget = 4, 128, 2048
    config = Qwen4ExpConfig(text_config=text.to_dict(), vision_config=config.vision_config.to_dict())
    torch.manual_seed(0)
    model = model_class(config).from_config(config, dtype=torch.float32).eval()
    return model, next(m for m in model.modules() if is_qsa(m))


def measure(kind: str, length: int) -> dict:
    from app.grouping.layout import GroupLayout
    from app.grouping.recurrent.segments import layout_segments
    from app.grouping.sparse.layer import grouped_qsa, vectorised_indexer

    model, attention = layer()
    hidden = torch.randn(1, length, model.config.text_config.hidden_size, generator=torch.Generator().manual_seed(1))
    rotary = model.model.language_model.rotary_emb
    cos, sin = rotary(hidden, torch.arange(length)[None].expand(3, 1, -1))
    start = time.perf_counter()
    with torch.no_grad():
        if kind == "grouped":
            prompt = length - RESPONSE
            plan = layout_segments(GroupLayout.from_masks(torch.ones(1, prompt, dtype=torch.long),
                                                          torch.ones(1, RESPONSE, dtype=torch.long), [1]))
            grouped_qsa(attention, hidden, (cos, sin), plan)
        else:
            mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
            indexer = attention.indexer
            if kind == "reference":
                type(indexer).forward(indexer, hidden, (cos, sin), mask, None)
            else:
                vectorised_indexer(indexer, hidden, (cos, sin), mask, None)
    return {"seconds": time.perf_counter() - start}


def run(out: Path, quick: bool = False) -> dict:
    references, grouped = ((256, 512), (256, 512)) if quick else (REFERENCE_LENGTHS, GROUPED_LENGTHS)
    rows = []
    for kind, lengths in (("reference", references), ("ours", references), ("grouped", grouped)):
        for length in lengths:
            result = point("app.bench.sparse.qsa:measure", quick, kind=kind, length=length)
            rows.append({"kind": kind, "tokens": length, **result})
            print(f"{kind} at {length}: {result}", flush=True)
    for row in rows:
        if row["kind"] == "ours":
            reference = next(r for r in rows if r["kind"] == "reference" and r["tokens"] == row["tokens"])
            if "seconds" in reference and "seconds" in row:
                row["speedup"] = reference["seconds"] / row["seconds"]
    payload = {"rows": rows}
    write_report(out, "qsa", payload, table(rows))
    return payload


def table(rows: list[dict]) -> str:
    """The report's markdown (a point that failed shows its error)."""
    return ("## QSA at real lengths (one layer, the released indexer's sizes, float32, CPU)\n\n"
            + markdown_table(rows, ["kind", "tokens", "seconds", "peak_memory_mb", "speedup", "error"],
                             {"seconds": ".2f", "peak_memory_mb": ".0f", "speedup": ".1f"})
            + "\n\nreference: transformers' indexer, a loop over every query; ours: the vectorised choice over the "
            "same 4-D mask (the peak includes the [T, T] mask both are given); grouped: the whole layer over a "
            "packed row, chunk by chunk of queries, no [T, T] tensor. peak_memory_mb: the process's peak RSS, the "
            "model's weights (about 0.5 GB) included.")


def main(argv: list[str] | None = None) -> None:
    cli(run, __doc__, "outputs/bench/qsa", argv)


if __name__ == "__main__":
    main()
