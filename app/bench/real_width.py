"""Grouped vs repeated at a real width: forward+backward of Qwen2.5-VL-7B's real decoder layer shape.

    python -m app.bench.real_width --out docs/bench/real_width [--quick]

Hidden 3584, 28 query / 4 KV heads of 128, MLP 18,944, vocabulary 152,064 (configs/models/qwen2_5_vl_7b.json), at
1 or 2 decoder layers, float32 on this CPU; a video-length prefix of 1k or 2k text tokens, G = 8 completions of 128.
Each point runs in its own process (one warm-up pass on a short prompt, then one measured pass): wall time, the
peak of live tensor memory above the weights and gradient buffers (app/bench/measure.py), the process's resident
peak, FLOPs counted by torch's flop counter, and the planner's prediction of memory and FLOPs beside them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from app.bench.common import attempt, cli, exit_if_failed, failed_points, markdown_table, write_report

PRESET = "qwen2_5_vl_7b"
GROUP, COMPLETION = 8, 128
POINTS = ((1, 1024), (1, 2048), (2, 1024))  # (decoder layers, prefix)


def measure(preset: str, layers: int, prefix: int, group: int, completion: int, mode: str) -> dict:
    """One point, in a child process."""
    from app.bench.measure import forward_backward
    from app.planning import costs, flops, shapes

    torch.manual_seed(0)
    config = shapes.hf_config(preset, layers=layers, vision_layers=1)
    model = shapes.random_model(config, torch.float32)
    model.train()
    generator = torch.Generator().manual_seed(0)

    def inputs(length):
        ids = torch.randint(1000, 100000, (1, length), generator=generator)
        completions = torch.randint(1000, 100000, (group, completion), generator=generator)
        return ({"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)},
                completions, torch.ones_like(completions))

    backend = None if mode == "repeated" else "split"
    forward_backward(model, *inputs(64), group, mode=mode, backend=backend, flops=False)  # warm-up
    timed = forward_backward(model, *inputs(prefix), group, mode=mode, backend=backend, flops=False)
    shape = costs.shape_of(config)
    work = costs.Workload(prefix=prefix, completion=completion, group_size=group)
    kind = "repeated" if mode == "repeated" else "split"
    plan = costs.training_activations(shape, work, backend=kind, dtype_bytes=4, checkpointing=False, chunk=1024)
    counted = flops.train_flops(shape, work, kind, checkpointing=False, chunk=1024)
    return {"seconds": timed["seconds"], "peak_mb": timed["peak"] / 2**20, "saved_mb": timed["saved"] / 2**20,
            "planned_peak_mb": plan["peak"] / 2**20,
            "planned_saved_mb": plan["saved"] / 2**20, "planned_flops": counted["total"],
            "causal_flops": counted["total_causal"]}


def run(out: Path, quick: bool = False) -> dict:
    preset, points = (("qwen2_5_vl_3b", ((1, 128),)) if quick else (PRESET, POINTS))
    group, completion = (4, 16) if quick else (GROUP, COMPLETION)
    rows: list[dict] = []
    payload = {"preset": preset, "rows": rows}
    for layers, prefix in points:
        row = {"layers": layers, "prefix": prefix, "G": group, "completion": completion}
        for mode in ("grouped", "repeated"):
            result = attempt("app.bench.real_width:measure", preset=preset, layers=layers, prefix=prefix,
                             group=group, completion=completion, mode=mode)
            if "error" in result:  # kept as a row that says why; the other points still run
                row[f"error_{mode}"] = result["error"]
                print(f"layers={layers} P={prefix} {mode}: FAILED: {result['error']}", flush=True)
                continue
            for key, value in result.items():
                row[f"{key}_{mode}"] = value
            print(f"layers={layers} P={prefix} {mode}: {result['seconds']:.1f} s, peak {result['peak_mb']:.0f} MB "
                  f"(planned {result['planned_peak_mb']:.0f}), resident {result['peak_memory_mb']:.0f} MB", flush=True)
        rows.append(row | ratios(row))
        write_report(out, "real_width", payload, table(preset, rows), quiet=True)  # a point at a time
    write_report(out, "real_width", payload, table(preset, rows))
    if any("time_ratio" in r for r in rows):
        plot([r for r in rows if "time_ratio" in r], out / "real_width.png")
    exit_if_failed(sum(any(k.startswith("error_") for k in r) for r in rows), len(rows), out)
    return payload


def ratios(row: dict) -> dict:
    """Grouped over repeated, where both passes of the point ran; nothing where one failed."""
    if any(f"seconds_{m}" not in row for m in ("grouped", "repeated")):
        return {}
    return {"time_ratio": row["seconds_grouped"] / row["seconds_repeated"],
            "memory_ratio": row["peak_mb_grouped"] / row["peak_mb_repeated"],
            "planned_memory_ratio": row["planned_peak_mb_grouped"] / row["planned_peak_mb_repeated"],
            "flop_ratio": row["planned_flops_grouped"] / row["planned_flops_repeated"],
            "causal_flop_ratio": row["causal_flops_grouped"] / row["causal_flops_repeated"],
            "planned_memory_error": max(abs(row[f"planned_peak_mb_{m}"] / row[f"peak_mb_{m}"] - 1)
                                        for m in ("grouped", "repeated"))}


def table(preset: str, rows: list[dict]) -> str:
    columns = ["layers", "prefix", "G", "completion", "seconds_grouped", "seconds_repeated", "time_ratio",
               "flop_ratio", "causal_flop_ratio", "peak_mb_grouped", "peak_mb_repeated", "memory_ratio",
               "planned_peak_mb_grouped", "planned_peak_mb_repeated", "planned_memory_error",
               "peak_memory_mb_grouped", "peak_memory_mb_repeated"]
    formats = {c: ".2f" for c in columns[4:]} | {c: ".3f" for c in ("time_ratio", "flop_ratio", "causal_flop_ratio",
                                                                       "memory_ratio")}
    formats |= {c: ".0f" for c in columns if "_mb_" in c} | {"planned_memory_error": ".1e"}
    errors = [f"- layers {r['layers']}, prefix {r['prefix']}, {k.removeprefix('error_')}: {v}"
              for r in rows for k, v in r.items() if k.startswith("error_")]
    return (f"## Grouped vs repeated at {preset}'s real layer shape (float32, CPU; one measured pass per point)\n\n"
            + markdown_table(rows, columns, formats) +
            "\n\npeak_mb: live tensor memory above weights and gradient buffers; peak_memory_mb: the process's "
            "resident peak (weights and gradients included). flop_ratio: the kernels' FLOPs (the planner's count, "
            "which tests/test_plan.py checks against torch's flop counter within 5%); causal_flop_ratio: the "
            "causal pairs only."
            + failed_points(errors))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['layers']}L P={r['prefix']}" for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    x = range(len(rows))
    for offset, key, name in ((-0.2, "time_ratio", "time"), (0.0, "memory_ratio", "peak memory"),
                              (0.2, "causal_flop_ratio", "causal FLOPs")):
        ax[0].bar([i + offset for i in x], [r[key] for r in rows], width=0.2, label=name)
    ax[0].set_xticks(list(x), labels)
    ax[0].set_ylabel("grouped / repeated")
    ax[0].legend()
    ax[0].set_title("grouped vs repeated (Qwen2.5-VL-7B layer, G=8)")
    for mode, marker in (("grouped", "o"), ("repeated", "s")):
        ax[1].scatter([r[f"peak_mb_{mode}"] for r in rows], [r[f"planned_peak_mb_{mode}"] for r in rows],
                      marker=marker, label=mode)
    top = max(max(r["peak_mb_repeated"], r["planned_peak_mb_repeated"]) for r in rows) * 1.1
    ax[1].plot([0, top], [0, top], color="grey", linewidth=0.8)
    ax[1].set_xlabel("measured peak (MB)")
    ax[1].set_ylabel("planned peak (MB)")
    ax[1].legend()
    ax[1].set_title("planner vs measurement")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    cli(run, __doc__, "outputs/bench/real_width", argv)


if __name__ == "__main__":
    main()
