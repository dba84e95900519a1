"""FlexAttention over successive packed lengths: does any call after the first few pay a compile?

    python -m app.bench.flex_shapes --out outputs/bench/flex_shapes [--quick]

GRPO packs a new total length at every step. Runs the ``flex`` backend on 20 successive random layouts (new length
each time) and prints each call's time and dynamo's compiled-graph count: forward on CPU (torch has no
FlexAttention backward there), forward + backward on CUDA. Writes flex_shapes.json/.md and a PNG of time per call.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from app.bench.common import cli, device, markdown_table, write_report
from app.grouping import GroupedAttentionPlan, GroupLayout, grouped_attention


def layouts(count: int, seed: int, prefix: tuple[int, int], response: tuple[int, int], group: int):
    rng = random.Random(seed)
    for _ in range(count):
        p = rng.randint(*prefix)
        lens = [rng.randint(*response) for _ in range(group)]
        completion = (torch.arange(max(lens))[None] < torch.tensor(lens)[:, None]).long()
        yield GroupLayout.from_masks(torch.ones(1, p, dtype=torch.long), completion, [group])


def run(out: Path, quick: bool) -> None:
    from torch._dynamo.utils import counters

    dev = device()
    backward = dev.type == "cuda"
    dtype = torch.bfloat16 if backward else torch.float32
    heads, kv_heads, dim = (4, 2, 16) if quick else (28, 4, 128)
    prefix, response = ((100, 400), (10, 60)) if quick else ((2000, 8000), (100, 768))
    rows = []
    for call, layout in enumerate(layouts(20, 0, prefix, response, 8)):
        shape = (1, heads, layout.total_len, dim)
        q = torch.randn(shape, device=dev, dtype=dtype, requires_grad=backward)
        k, v = (torch.randn(1, kv_heads, layout.total_len, dim, device=dev, dtype=dtype, requires_grad=backward)
                for _ in range(2))
        before = counters["stats"]["unique_graphs"]
        if backward:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            result = grouped_attention(GroupedAttentionPlan(layout, "flex"), q, k, v)
            if backward:
                result.sum().backward()
                torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        rows.append({"call": call + 1, "packed_tokens": layout.total_len, "seconds": seconds,
                     "new_graphs": counters["stats"]["unique_graphs"] - before})
    steady = sorted(r["seconds"] for r in rows[3:])
    summary = {"calls": len(rows), "graphs_compiled": sum(r["new_graphs"] for r in rows),
               "compiles_after_call_3": sum(r["new_graphs"] for r in rows[3:]),
               "first_call_seconds": rows[0]["seconds"], "median_later_call_seconds": steady[len(steady) // 2],
               "pass": "forward+backward" if backward else "forward", "dtype": str(dtype)}
    table = markdown_table(rows, ["call", "packed_tokens", "seconds", "new_graphs"], {"seconds": ".3f"})
    table += (f"\n\n{summary['pass']} ({summary['dtype']}, {dev.type}): {summary['graphs_compiled']} graph(s) compiled "
              f"over {len(rows)} lengths, {summary['compiles_after_call_3']} after call 3; first call "
              f"{summary['first_call_seconds']:.2f} s, later calls median {summary['median_later_call_seconds']:.4f} s")
    write_report(out, "flex_shapes", {"rows": rows, "summary": summary}, table)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar([r["call"] for r in rows], [r["seconds"] for r in rows])
    ax.set_yscale("log")
    ax.set_xlabel("call (a new packed length each)")
    ax.set_ylabel("seconds")
    ax.set_title(f"flex backend, {summary['pass']} on {dev.type}")
    fig.tight_layout()
    fig.savefig(out / "flex_shapes.png", dpi=120)


if __name__ == "__main__":
    cli(run, __doc__, "outputs/bench/flex_shapes")
