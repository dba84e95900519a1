"""Attention only: our backends against the paper's `prefix-grouper` package on identical inputs.

    python -m app.bench.attention --out outputs/bench/attention [--quick]

One group of G responses after a long prefix, forward+backward of the attention output. The package runs its two
calls (prefix; each response against [P; Ri] with P's keys/values repeated per response) with an SDPA attention
function; ours run the same inputs through each backend. Each variant runs in a fresh process, so peak memory is
its own (a child that only builds the inputs gives the baseline that every variant pays).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from app.bench.common import cli, device, isolated, markdown_table, timed, write_report
from app.grouping import GroupedAttentionPlan, GroupLayout, grouped_attention, usable_backends

DEFAULT = {"heads": 8, "head_dim": 64, "prefix": 4096, "group": 8, "suffix": 256}


def _inputs(heads, head_dim, prefix, group, suffix):
    layout = GroupLayout((group,), (prefix,), (suffix,) * group, prefix, suffix)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    generator = torch.Generator().manual_seed(0)
    shape = (1, heads, layout.total_len, head_dim)
    q, k, v = (torch.randn(shape, generator=generator).to(device(), dtype).requires_grad_() for _ in range(3))
    weight = torch.randn(shape, generator=generator).to(device(), dtype)
    return layout, q, k, v, weight


def _package_attention(layout, q, k, v):
    from prefix_grouper import PrefixGrouper
    from prefix_grouper.forward import AttentionForward

    def attn_func(q_, k_, v_, padding_mask):
        lq, lk = q_.shape[2], k_.shape[2]
        causal = torch.ones(lq, lk, dtype=torch.bool, device=q_.device).tril(lk - lq)
        mask = causal[None, None] & padding_mask[:, None, None, :].bool()
        return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask).transpose(1, 2)

    start, prefix, lens = layout.group_spans[0]
    grouper = PrefixGrouper([[prefix, *lens]], device=q.device, padding_mode="right")
    out = AttentionForward(attn_func)(grouper, q, k, v)  # [1, T, H, D]
    return out.transpose(1, 2)


def run_variant(variant: str, heads: int, head_dim: int, *, prefix: int, group: int, suffix: int,
                repeats: int = 3) -> dict:
    layout, q, k, v, weight = _inputs(heads, head_dim, prefix, group, suffix)
    if variant == "inputs-only":
        return {"seconds": 0.0}

    def step():
        for t in (q, k, v):
            t.grad = None
        if variant == "prefix-grouper":
            out = _package_attention(layout, q, k, v)
        else:
            out = grouped_attention(GroupedAttentionPlan(layout, variant), q, k, v)
        (out * weight).sum().backward()

    return {"seconds": timed(step, repeats=repeats, warmup=1)}


def check_same_outputs(heads=4, head_dim=16, prefix=64, group=3, suffix=8) -> float:
    """Max |ours - package| over every backend on a small case (the benchmark compares like with like)."""
    layout, q, k, v, _ = _inputs(heads, head_dim, prefix, group, suffix)
    with torch.no_grad():
        theirs = _package_attention(layout, q, k, v).float()
        return max(float((grouped_attention(GroupedAttentionPlan(layout, b), q, k, v).float() - theirs).abs().max())
                   for b in usable_backends(device()))


def run(out: Path, quick: bool = False) -> dict:
    shape = {"heads": 4, "head_dim": 32, "prefix": 256, "group": 4, "suffix": 32} if quick else dict(DEFAULT)
    difference = check_same_outputs()
    baseline = isolated("app.bench.attention:run_variant", here=quick, variant="inputs-only", **shape)["peak_memory_mb"]
    rows = []
    for variant in ("prefix-grouper", *usable_backends(device())):
        result = isolated("app.bench.attention:run_variant", here=quick, variant=variant, repeats=1 if quick else 3,
                          **shape)
        rows.append({"variant": variant, "seconds": result["seconds"], "peak_mb": result["peak_memory_mb"],
                     "above_inputs_mb": result["peak_memory_mb"] - baseline})
    ref = rows[0]
    for row in rows:
        row["time_vs_package"] = row["seconds"] / ref["seconds"]
        row["memory_vs_package"] = row["peak_mb"] / ref["peak_mb"]
        row["memory_above_inputs_vs_package"] = row["above_inputs_mb"] / max(ref["above_inputs_mb"], 1e-9)
    ours = [r for r in rows if r["variant"] != "prefix-grouper"]
    best_time = min(ours, key=lambda r: r["seconds"])
    best_memory = min(ours, key=lambda r: r["peak_mb"])
    table = markdown_table(rows, ["variant", "seconds", "time_vs_package", "peak_mb", "memory_vs_package",
                                  "above_inputs_mb", "memory_above_inputs_vs_package"],
                           {"seconds": ".3f", "time_vs_package": ".3f", "peak_mb": ".0f", "memory_vs_package": ".3f",
                            "above_inputs_mb": ".0f", "memory_above_inputs_vs_package": ".3f"})
    table = (f"## Attention fwd+bwd on {device().type}: {shape} (inputs alone: {baseline:.0f} MB peak; "
             f"outputs agree with the package to {difference:.1e})\n\n{table}\n\n"
             f"fastest of ours: {best_time['variant']} ({best_time['time_vs_package']:.3f}x the package's time); "
             f"leanest: {best_memory['variant']} ({best_memory['memory_vs_package']:.3f}x its peak memory)")
    payload = {"shape": shape, "rows": rows, "max_abs_difference_vs_package": difference,
               "inputs_only_peak_mb": baseline}
    write_report(out, "attention", payload, table)
    return payload


def main(argv: list[str] | None = None) -> None:
    cli(run, __doc__, "outputs/bench/attention", argv)


if __name__ == "__main__":
    main()
