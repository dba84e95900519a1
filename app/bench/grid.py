"""The paper's grid: one policy forward+backward, grouped vs repeated.

    python -m app.bench.grid --out outputs/bench/grid [--quick]

FLOPs are counted with torch's FlopCounterMode on the real Qwen2.5-VL class (text stack scaled down) built on the
meta device, so any shape "runs" without memory or time; they are set beside the analytic count (``analytic``,
the paper's Lemma 2 decomposition: per-token projection/MLP work plus per query-key pair attention work).
Peak memory (a fresh subprocess per point: peak RSS on CPU, max allocated on CUDA) and wall time are measured for
real on the subset that fits the machine.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from app.bench.common import cli, device, exit_if_failed, failed_points, markdown_table, point, timed, write_report
from app.grouping import (
    GroupedAttentionPlan,
    GroupLayout,
    attention_restored,
    completion_logprobs,
    set_text_attention,
)
from app.grouping.attention import PLAN_KWARG, response_chunks
from app.runtime.models import TinySizes, build_tokenizer, model_class, tiny_config

GROUP_SIZES = (2, 4, 8, 16)
PREFIXES = (4096, 8192, 16384)
RATIOS = tuple(2.0**k for k in range(-1, 6))  # prefix / suffix
# A Qwen2.5-VL text stack scaled down in width and depth (GQA 4:1 as in the 7B model).
BENCH_SIZES = TinySizes(hidden=256, layers=2, heads=4, kv_heads=1, head_dim=64, intermediate=704,
                        vision_hidden=32, max_positions=131072)


def bench_model(meta: bool = False, sizes: TinySizes = BENCH_SIZES, dtype=torch.float32):
    config = tiny_config("qwen2_5_vl", build_tokenizer(), sizes)
    if meta:
        with torch.device("meta"):
            return model_class(config).from_config(config, dtype=dtype)
    torch.manual_seed(0)
    return model_class(config).from_config(config, dtype=dtype).to(device())


def per_token_and_pair_flops(config) -> tuple[float, float, float]:
    """Forward FLOPs per token (projections + MLP), per query-key pair (QK^T and PV), per logit position."""
    t = config.text_config
    h, heads, kv, d, m = t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.hidden_size // t.num_attention_heads, t.intermediate_size
    linear = 2 * (h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * m)
    pair = 2 * 2 * heads * d
    return t.num_hidden_layers * linear, t.num_hidden_layers * pair, 2 * h * t.vocab_size


def analytic(prefix: int, suffix: int, group: int, config, variant: str) -> float:
    """Forward+backward FLOPs (backward = 2x forward for matmuls), counting every attention rectangle in full."""
    tok, pair, head = per_token_and_pair_flops(config)
    if variant == "repeated":
        tokens, pairs, logits = group * (prefix + suffix), group * (prefix + suffix) ** 2, group * (suffix + 1)
    elif variant == "paper":  # P with itself, each Ri against [P; Ri]
        tokens, pairs, logits = prefix + group * suffix, prefix**2 + group * suffix * (prefix + suffix), group * suffix
    else:  # packed: P with itself, each chunk of responses against [P; chunk]
        tokens = prefix + group * suffix
        chunks = [sum(c) for c in response_chunks(prefix, [suffix] * group)]
        pairs, logits = prefix**2 + sum(c * (prefix + c) for c in chunks), group * suffix
    return 3.0 * (tokens * tok + pairs * pair + logits * head)


def _inputs(prefix: int, suffix: int, group: int, vocab: int):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(10, vocab - 10, (1, prefix), generator=generator)
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}
    completions = torch.randint(10, vocab - 10, (group, suffix), generator=generator)
    return prompts, completions, torch.ones_like(completions)


def count_flops(prefix: int, suffix: int, group: int, variant: str) -> float:
    """FlopCounterMode over one forward+backward on the meta device (no data, any size)."""
    model = bench_model(meta=True)
    prompts, completions, mask = _inputs(prefix, suffix, group, model.config.text_config.vocab_size)
    counter = FlopCounterMode(display=False)
    with attention_restored(model):
        return _counted(model, prompts, completions, mask, counter, prefix=prefix, suffix=suffix, group=group,
                        variant=variant)


def _counted(model, prompts, completions, mask, counter, *, prefix: int, suffix: int, group: int, variant: str):
    meta = torch.device("meta")
    if variant == "repeated":
        set_text_attention(model, "sdpa")
        ids = torch.cat([prompts["input_ids"].expand(group, -1), completions], dim=1)
        positions = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, group, -1)
        with counter:
            out = model(input_ids=ids.to(meta), position_ids=positions.to(meta), use_cache=False,
                        logits_to_keep=suffix + 1)
            out.logits.float().log_softmax(-1).sum().backward()
    else:
        set_text_attention(model, "prefix_grouper")
        layout = GroupLayout.from_masks(prompts["attention_mask"], mask, group)
        ids = layout.pack(prompts["input_ids"], completions)[None]
        positions = torch.cat([torch.arange(prefix), prefix + torch.cat([torch.arange(suffix)] * group)])
        plan = GroupedAttentionPlan(layout, variant)
        with counter:
            out = model(input_ids=ids.to(meta), position_ids=positions.view(1, 1, -1).expand(3, 1, -1).to(meta),
                        use_cache=False, logits_to_keep=layout.predict_index.to(meta), **{PLAN_KWARG: plan})
            out.logits.float().log_softmax(-1).sum().backward()
    return float(counter.get_total_flops())


def measure_point(prefix: int, suffix: int, group: int, variant: str, repeats: int = 1) -> dict:
    """Real forward+backward of the completion log-probs (runs in a child process: peak memory is per point)."""
    model = bench_model()
    prompts, completions, mask = _inputs(prefix, suffix, group, model.config.text_config.vocab_size)
    prompts = {k: v.to(device()) for k, v in prompts.items()}
    completions, mask = completions.to(device()), mask.to(device())
    mode, backend = ("repeated", None) if variant == "repeated" else ("grouped", variant)
    if variant == "baseline":  # the model and inputs only: what every point pays before any compute
        return {"seconds": 0.0}

    def step():
        model.zero_grad(set_to_none=True)
        completion_logprobs(model, prompts, completions, mask, group, mode=mode, backend=backend).logprobs.sum().backward()

    return {"seconds": timed(step, repeats=repeats, warmup=1)}


def run(out: Path, quick: bool = False) -> dict:
    config = bench_model(meta=True).config
    groups, prefixes, ratios = ((2, 4), (256,), (0.5, 2.0, 8.0)) if quick else (GROUP_SIZES, PREFIXES, RATIOS)
    flop_rows = []
    for prefix in prefixes:
        for group in groups:
            for ratio in ratios:
                suffix = int(prefix / ratio)
                row = {"prefix": prefix, "suffix": suffix, "ratio": ratio, "G": group}
                for variant in ("repeated", "paper", "packed"):
                    row[f"flops_{variant}"] = count_flops(prefix, suffix, group, variant)
                    row[f"analytic_{variant}"] = analytic(prefix, suffix, group, config, variant)
                for variant in ("paper", "packed"):
                    row[f"ratio_{variant}"] = row[f"flops_{variant}"] / row["flops_repeated"]
                    row[f"analytic_ratio_{variant}"] = row[f"analytic_{variant}"] / row["analytic_repeated"]
                    row[f"ratio_error_{variant}"] = abs(row[f"ratio_{variant}"] / row[f"analytic_ratio_{variant}"] - 1)
                flop_rows.append(row)
                print(f"P={prefix} S={suffix} G={group}: grouped/repeated FLOPs {row['ratio_paper']:.4f} (paper), "
                      f"{row['ratio_packed']:.4f} (packed); analytic {row['analytic_ratio_paper']:.4f}", flush=True)
    measured = []
    points = [(256, 64, 4)] if quick else [(4096, 512, 8), (4096, 2048, 8), (2048, 256, 8), (4096, 512, 4)]
    for prefix, suffix, group in points:
        row = {"prefix": prefix, "suffix": suffix, "G": group}
        for variant in ("baseline", "repeated", "paper", "packed", "split"):
            result = point("app.bench.grid:measure_point", quick, prefix=prefix, suffix=suffix, group=group,
                           variant=variant, repeats=1 if quick else 2)
            if "error" in result:  # kept as a row that says why; the other variants and points still run
                row[f"error_{variant}"] = result["error"]
                print(f"P={prefix} S={suffix} G={group} {variant}: FAILED: {result['error']}", flush=True)
            elif variant == "baseline":  # the model and inputs only
                row["baseline_mb"] = result["peak_memory_mb"]
            else:
                row[f"seconds_{variant}"], row[f"peak_mb_{variant}"] = result["seconds"], result["peak_memory_mb"]
        for variant in ("paper", "packed", "split"):
            # split computes the paper's rectangles (S x P per response, then its own S x S block)
            counted = "paper" if variant == "split" else variant
            row[f"flop_ratio_{variant}"] = analytic(prefix, suffix, group, config, counted) / analytic(
                prefix, suffix, group, config, "repeated")
            if f"seconds_{variant}" not in row or "seconds_repeated" not in row:
                continue
            row[f"time_ratio_{variant}"] = row[f"seconds_{variant}"] / row["seconds_repeated"]
            row[f"memory_ratio_{variant}"] = row[f"peak_mb_{variant}"] / row["peak_mb_repeated"]
            row[f"time_over_flop_ratio_{variant}"] = row[f"time_ratio_{variant}"] / row[f"flop_ratio_{variant}"]
        measured.append(row)
    flop_table = markdown_table(flop_rows, ["prefix", "suffix", "G", "ratio_paper", "analytic_ratio_paper",
                                            "ratio_error_paper", "ratio_packed", "analytic_ratio_packed",
                                            "ratio_error_packed"],
                                {k: ".4f" for k in ("ratio_paper", "analytic_ratio_paper", "ratio_packed",
                                                    "analytic_ratio_packed")} | {"ratio_error_paper": ".2e",
                                                                                  "ratio_error_packed": ".2e"})
    columns = ["prefix", "suffix", "G", "seconds_repeated", "seconds_split", "seconds_paper", "seconds_packed",
               "flop_ratio_paper", "time_ratio_split", "time_over_flop_ratio_split", "time_ratio_paper",
               "time_ratio_packed", "peak_mb_repeated", "memory_ratio_split", "memory_ratio_paper",
               "memory_ratio_packed"]
    measured_table = markdown_table(measured, columns, {k: ".3f" for k in columns[3:]} | {"peak_mb_repeated": ".0f"})
    worst = max(max(r["ratio_error_paper"], r["ratio_error_packed"]) for r in flop_rows)
    failed = [f"- P={r['prefix']} S={r['suffix']} G={r['G']} {k.removeprefix('error_')}: {v}"
              for r in measured for k, v in r.items() if k.startswith("error_")]
    table = (f"## FLOPs, grouped / repeated (forward+backward; worst deviation from the analytic ratio: {worst:.2e})"
             f"\n\n{flop_table}\n\n## Measured on {device().type} (wall time, peak memory)\n\n{measured_table}"
             + failed_points(failed))
    payload = {"sizes": BENCH_SIZES.__dict__, "flops": flop_rows, "measured": measured, "worst_flop_ratio_error": worst}
    write_report(out, "grid", payload, table)
    plot(flop_rows, measured, out)
    exit_if_failed(len(failed), 5 * len(measured), out)  # five processes per point: the baseline and four layouts
    return payload


def plot(flop_rows: list[dict], measured: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefixes = sorted({r["prefix"] for r in flop_rows})
    fig, axes = plt.subplots(1, len(prefixes), figsize=(5 * len(prefixes), 4), squeeze=False, constrained_layout=True)
    for ax, prefix in zip(axes[0], prefixes):
        for group in sorted({r["G"] for r in flop_rows}):
            rows = [r for r in flop_rows if r["prefix"] == prefix and r["G"] == group]
            xs = [r["ratio"] for r in rows]
            line = ax.plot(xs, [r["flops_repeated"] for r in rows], "--", alpha=0.6)[0]
            ax.plot(xs, [r["flops_paper"] for r in rows], "-o", color=line.get_color(), label=f"G={group}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"prefix {prefix}: grouped (solid) vs repeated (dashed)")
        ax.set_xlabel("prefix / suffix")
        ax.set_ylabel("FLOPs (fwd+bwd)")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.savefig(out / "grid_flops.png", dpi=110)
    plt.close(fig)
    if measured:
        fig, ax = plt.subplots(figsize=(7, 4), constrained_layout=True)
        labels = [f"P{r['prefix']} S{r['suffix']} G{r['G']}" for r in measured]
        x = range(len(measured))
        for offset, variant in ((-0.3, "repeated"), (-0.1, "split"), (0.1, "paper"), (0.3, "packed")):
            ax.bar([i + offset for i in x], [r.get(f"peak_mb_{variant}", 0.0) for r in measured], width=0.2, label=variant)
        ax.set_xticks(list(x), labels)
        ax.set_ylabel("peak memory (MB)")
        ax.set_title("peak memory per point (fresh process each)")
        ax.legend()
        fig.savefig(out / "grid_memory.png", dpi=110)
        plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    cli(run, __doc__, "outputs/bench/grid", argv)


if __name__ == "__main__":
    main()
