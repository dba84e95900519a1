"""Qwen3.5 (Gated DeltaNet + attention) grouped against repeated, beside Qwen2.5-VL at the same width; with
``--moe``, the mixture-of-experts families beside the dense ones of the same active width.

    python -m app.bench.hybrid --out docs/bench/hybrid [--quick]      (scripts/bench.sh hybrid)
    python -m app.bench.hybrid --moe --out docs/bench/moe [--quick]   (scripts/bench.sh moe)
    python -m app.bench.hybrid --qsa --out docs/bench/qsa_grouping [--quick]   (scripts/bench.sh qsa_grouping)

A reduced width on this CPU: hidden 256, 4 decoder layers (Qwen3.5: 3 GDN layers, 1 gated attention layer; its GDN
with 4 key / 8 value heads of 64; Qwen2.5-VL: 4 attention layers), 4 query / 2 KV heads of 64, MLP 1,024, a 32k
vocabulary; a text prompt of 2k or 8k tokens, G = 8 completions of 128, float32. Each point runs in its own process
(a warm-up pass on a short prompt, then one measured forward+backward of the completion log-probs as training runs
them; ``--quick``: every point in this one): wall time, the allocator's peak above the weights and gradient buffers,
torch's flop counter. The GDN layers
run transformers' torch fallback here (flash-linear-attention is CUDA-only); the 9B-width case is
``scripts/gpu_check.sh``'s ``qwen3_5`` part.

``--moe``: the same points on Qwen3-VL-MoE with every layer sparse (16 experts, 4 per token, of 256) against Qwen3-VL
with an MLP of 1,024, and Qwen3.5-MoE (16 experts, 4 per token, of 192, plus a shared expert of 256) against Qwen3.5
with an MLP of 1,024: the same FLOPs per token in the MLPs, the routers and grouped_mm on top. The 30B-A3B-width case
is ``scripts/gpu_check.sh``'s ``moe`` part.

``--qsa``: Qwen3.8-Flash-Next (``qwen4_exp``: GDN layers with PLE, QSA layers of budget ``QSA_BUDGET``,
hyper-connections, the same experts) beside Qwen3.5-MoE at this width; its repeated layout runs the vectorised
indexer (transformers' loop over queries would take hours at 8k).
"""

from __future__ import annotations

from pathlib import Path

import torch

from app.bench.common import cli, exit_if_failed, failed_points, markdown_table, point, write_report

FAMILIES = ("qwen3_5", "qwen2_5_vl")
PREFIXES = (2048, 8192)
GROUP, COMPLETION = 8, 128


# Mixture-of-experts families at the same active width as the dense ones' MLP of 1,024: 16 experts, 4 per token, of
# 256 (Qwen3-VL-MoE, every layer sparse), or of 192 plus a shared expert of 256 (Qwen3.5-MoE).
MOE_SIZES = {"qwen3_vl_moe": dict(experts=16, experts_per_token=4, moe_intermediate=256, moe_layers=4,
                                  mlp_only_layers=()),
             "qwen3_5_moe": dict(experts=16, experts_per_token=4, moe_intermediate=192, shared_expert_intermediate=256),
             "qwen4_exp": dict(experts=16, experts_per_token=4, moe_intermediate=192, shared_expert_intermediate=256)}
QSA_BUDGET = 512  # --qsa: Qwen3.8-Flash-Next's keys a query attends to at this width (the released 2,048 at hidden 2,560)


# The released routing regime at the same width (``--replay``'s wide rows): 128 experts, 8 per token, of 32 (Qwen3-VL-
# MoE over 8 sparse layers; Qwen3.5-MoE keeps its 4 layers and shared expert).
WIDE_ROUTING = {"qwen3_vl_moe": dict(experts=128, experts_per_token=8, moe_intermediate=32, moe_layers=8,
                                     mlp_only_layers=()),
                "qwen3_5_moe": dict(experts=128, experts_per_token=8, moe_intermediate=32,
                                    shared_expert_intermediate=256)}


SHARP_EXPERTS_STD = 0.05  # ``routing="sharp"``: routed experts and routers drawn wider than the initializer's 0.02


def tiny_model(family: str, vocab: int = 32768, routing: str = "tiny"):
    """The reduced-width model of ``family`` (random weights, the real transformers class); a mixture of experts
    with ``MOE_SIZES``'s experts, ``WIDE_ROUTING``'s with ``routing="wide"``, or ``MOE_SIZES``'s with their routed
    experts and routers drawn at ``SHARP_EXPERTS_STD`` with ``routing="sharp"`` (experts that differ more from one
    another, as trained ones do)."""
    from app.runtime.models import HYBRID_FAMILIES, TinySizes, build_tokenizer, model_class, tiny_config

    experts = (WIDE_ROUTING if routing == "wide" else MOE_SIZES).get(family, {})
    hybrid = family in HYBRID_FAMILIES or family == "qwen4_exp"
    sizes = TinySizes(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64 if not hybrid else 32,
                      intermediate=1024, hybrid_layers=4, linear_heads=(4, 8, 64), max_positions=65536, **experts)
    config = tiny_config(family, build_tokenizer(), sizes, vocab_size=vocab)
    if family == "qwen4_exp":  # a budget that 2k and 8k prompts exceed, as an hour's video exceeds the released one
        config.text_config.indexer_budget = QSA_BUDGET
    torch.manual_seed(0)
    model = model_class(config).from_config(config, dtype=torch.float32)
    if routing == "sharp":
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".mlp.experts." in name or name.endswith("mlp.gate.weight"):
                    param.normal_(0.0, SHARP_EXPERTS_STD, generator=generator)
    return model


def measure(family: str, prefix: int, group: int, completion: int, mode: str) -> dict:
    """One point (in a child process, but under --quick)."""
    from app.bench.measure import forward_backward

    model = tiny_model(family)
    model.train()
    generator = torch.Generator().manual_seed(0)

    def inputs(length):
        ids = torch.randint(10, 30000, (1, length), generator=generator)
        completions = torch.randint(10, 30000, (group, completion), generator=generator)
        return ({"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)},
                completions, torch.ones_like(completions))

    backend = None if mode == "repeated" else "split"
    forward_backward(model, *inputs(64), group, mode=mode, backend=backend, flops=False)  # warm-up
    timed = forward_backward(model, *inputs(prefix), group, mode=mode, backend=backend)
    return {"seconds": timed["seconds"], "peak_mb": timed["peak"] / 2**20, "flops": timed["flops"]}


TITLE = ("Qwen3.5 (3 GDN + 1 attention layer) against Qwen2.5-VL (4 attention layers), grouped vs repeated (hidden "
         "256, float32, CPU; one measured forward+backward per point)")


def run(out: Path, quick: bool = False, families=FAMILIES, name: str = "hybrid", title: str = TITLE) -> dict:
    prefixes = (256,) if quick else PREFIXES
    group, completion = (4, 16) if quick else (GROUP, COMPLETION)
    rows: list[dict] = []
    payload = {"prefixes": list(prefixes), "group": group, "completion": completion, "rows": rows}
    for family in families:
        for prefix in prefixes:
            row = {"family": family, "prefix": prefix, "G": group, "completion": completion}
            for mode in ("grouped", "repeated"):
                result = point("app.bench.hybrid:measure", quick, family=family, prefix=prefix, group=group,
                               completion=completion, mode=mode)
                if "error" in result:
                    row[f"error_{mode}"] = result["error"]
                    print(f"{family} P={prefix} {mode}: FAILED: {result['error']}", flush=True)
                    continue
                row.update({f"{key}_{mode}": value for key, value in result.items()})
                print(f"{family} P={prefix} {mode}: {result['seconds']:.1f} s, peak {result['peak_mb']:.0f} MB, "
                      f"{result['flops'] / 1e12:.2f} TFLOPs", flush=True)
            if all(f"seconds_{m}" in row for m in ("grouped", "repeated")):
                row.update(time_ratio=row["seconds_grouped"] / row["seconds_repeated"],
                           memory_ratio=row["peak_mb_grouped"] / row["peak_mb_repeated"],
                           flop_ratio=row["flops_grouped"] / row["flops_repeated"])
            rows.append(row)
            write_report(out, name, payload, table(rows, title), quiet=True)
    write_report(out, name, payload, table(rows, title))
    if any("time_ratio" in r for r in rows):
        plot([r for r in rows if "time_ratio" in r], out / f"{name}.png")
    exit_if_failed(sum(any(k.startswith("error_") for k in r) for r in rows), len(rows), out)
    return payload


def table(rows: list[dict], title: str = TITLE) -> str:
    columns = ["family", "prefix", "G", "completion", "seconds_grouped", "seconds_repeated", "time_ratio",
               "peak_mb_grouped", "peak_mb_repeated", "memory_ratio", "flops_grouped", "flops_repeated", "flop_ratio"]
    formats = {c: ".2f" for c in ("seconds_grouped", "seconds_repeated")}
    formats |= {c: ".3f" for c in ("time_ratio", "memory_ratio", "flop_ratio")}
    formats |= {c: ".0f" for c in ("peak_mb_grouped", "peak_mb_repeated")}
    formats |= {c: ".3e" for c in ("flops_grouped", "flops_repeated")}
    errors = [f"- {r['family']} P={r['prefix']} {k.removeprefix('error_')}: {v}"
              for r in rows for k, v in r.items() if k.startswith("error_")]
    return (f"## {title}\n\n" + markdown_table(rows, columns, formats)
            + "\n\npeak_mb: the allocator's peak above weights and gradient buffers; flops: torch's flop counter "
            "(transformers' torch GDN fallback counted as its matmuls; a mixture of experts' routed experts through eager, "
            "as the counter does not count grouped_mm). Grouped runs each prompt once through "
            "every layer; repeated runs it G times." + failed_points(errors))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = [f"{r['family']}\nP={r['prefix']}" for r in rows]
    x = range(len(rows))
    for offset, key, name in ((-0.25, "time_ratio", "time"), (0.0, "memory_ratio", "peak memory"),
                              (0.25, "flop_ratio", "FLOPs")):
        ax.bar([i + offset for i in x], [r[key] for r in rows], width=0.25, label=name)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("grouped / repeated")
    ax.set_title(f"grouped vs repeated, G = {rows[0]['G']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


MOE_FAMILIES = ("qwen3_vl_moe", "qwen3_vl", "qwen3_5_moe", "qwen3_5")
MOE_TITLE = ("Mixture of experts against the dense model of the same active width, grouped vs repeated (hidden 256, "
             "4 layers, 16 experts of which 4 per token, float32, CPU; one measured forward+backward per point)")


def run_moe(out: Path, quick: bool = False) -> dict:
    return run(out, quick, families=MOE_FAMILIES, name="moe", title=MOE_TITLE)


QSA_FAMILIES = ("qwen4_exp", "qwen3_5_moe")
QSA_TITLE = ("Qwen3.8-Flash-Next (2 GDN layers with PLE, 2 QSA layers of budget 512, hyper-connections of 2 streams) "
             "against Qwen3.5-MoE (3 GDN, 1 attention), both 16 experts of which 4 per token, grouped vs repeated "
             "(hidden 256, float32, CPU; one measured forward+backward per point)")


def run_qsa(out: Path, quick: bool = False) -> dict:
    return run(out, quick, families=QSA_FAMILIES, name="qsa_grouping", title=QSA_TITLE)


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--moe" in argv:
        argv.remove("--moe")
        cli(run_moe, __doc__, "outputs/bench/moe", argv)
    elif "--qsa" in argv:
        argv.remove("--qsa")
        cli(run_qsa, __doc__, "outputs/bench/qsa_grouping", argv)
    else:
        cli(run, __doc__, "outputs/bench/hybrid", argv)


if __name__ == "__main__":
    main()
