"""Expert parallelism against ZeRO-3 alone, 2 processes on this machine's cores (gloo), at reduced width.

    python -m app.bench.parallel.experts --out docs/bench/ep [--quick]      (scripts/bench.sh ep)

For each mixture-of-experts family (hidden 256, 4 layers, 16 experts of which 4 per token, float32; every rank its
own prompts), three variants of the same run, each in its own torchrun launch (``app.bench.parallel.worker``):
- ``zero3``: ZeRO-3 alone (train.expert_parallel_size=1): every forward gathers all 16 experts of a sparse layer
  from the 2 ranks;
- ``autoep1``: AutoEP's layer at EP = 1, every rank holding all experts (no all-to-all): what the layer itself
  costs against transformers' (the trainer never runs it: EP = 1 is ZeRO-3 alone);
- ``ep2``: train.expert_parallel_size=2: each rank holds 8 experts (ZeRO-3 partitions them over a group of 1: never
  gathered), each token's 4 routed copies sent to their experts' rank and back.
Per variant and rank: a training step's time (grouped forward with the routers' statistics, backward, AdamW step;
the median of 3), a rollout's (the full gather, 8 samples, greedy to a fixed length), the bytes each kind of
collective brought to the rank in a step and in a rollout, and the heap's peak above the step's start. Ratios are
against ``zero3``. On a 2-core CPU the all-to-all and the gathers are memory copies through gloo, not a GPU link:
the bytes carry over to GPUs, the times do not (``scripts/gpu_check.sh --parts ep`` on a multi-GPU host).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from app.bench.common import ROOT, child_env, cli, exit_if_failed, failed_points, markdown_table, write_report

VARIANTS = ("zero3", "autoep1", "ep2")
FAMILIES = ("qwen3_vl_moe", "qwen3_5_moe")
WORKLOAD = {"prompt": 1024, "group": 8, "completion": 128, "new_tokens": 32, "steps": 3}
QUICK = {"prompt": 64, "group": 2, "completion": 8, "new_tokens": 4, "steps": 1}
KINDS = ("gather", "reduce_scatter", "all_to_all", "all_reduce", "broadcast")


def checkpoint(family: str, root: Path, quick: bool) -> Path:
    """The reduced-width checkpoint of ``family`` (the real transformers class, random weights), written once."""
    from app.bench.hybrid import MOE_SIZES
    from app.runtime.models import HYBRID_FAMILIES, TinySizes, build_tokenizer, model_class, tiny_config

    out = root / family
    if (out / "config.json").is_file():
        return out
    sizes = TinySizes() if quick else TinySizes(
        hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64 if family not in HYBRID_FAMILIES else 32,
        intermediate=1024, hybrid_layers=4, linear_heads=(4, 8, 64), max_positions=65536, **MOE_SIZES[family])
    if quick:  # the tiny default with experts every rank can split in two
        sizes = TinySizes(experts=4, experts_per_token=2)
    config = tiny_config(family, build_tokenizer(), sizes, vocab_size=32768)
    torch.manual_seed(0)
    model_class(config).from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def launch(path: Path, variant: str, out: Path, work: dict, processes: int = 2) -> dict:
    """One variant's torchrun launch of ``processes`` processes; their rank files, or {"error": why}."""
    folder = out / "runs" / f"{path.name}_{variant}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes), "-m",
               "app.bench.parallel.worker", str(path), variant, str(folder), json.dumps(work)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=child_env(OMP_NUM_THREADS="1"),
                            timeout=3600)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "Error" in line and "ChildFailedError" not in line]
        return {"error": f"{variant}: exit {result.returncode}: {(errors or ['(no error line)'])[-1].strip()[:300]}"}
    return {"ranks": [json.loads((folder / f"rank{r}.json").read_text()) for r in range(processes)]}


def summarise(family: str, variant: str, ranks: list[dict]) -> dict:
    """A variant's row: the slowest rank's times (the ranks step together), each kind's bytes per rank (the ranks'
    mean), the largest peak."""
    row = {"family": family, "variant": variant, "ep": ranks[0]["ep"],
           "step_s": max(r["step_seconds"] for r in ranks), "rollout_s": max(r["rollout_seconds"] for r in ranks),
           "step_peak_mb": max(r["step_peak_bytes"] for r in ranks) / 2**20}
    for part in ("step", "rollout"):
        for kind in KINDS:
            row[f"{part}_{kind}_mb"] = sum(r[part].get(f"{kind}_bytes", 0.0) for r in ranks) / len(ranks) / 2**20
        row[f"{part}_mb"] = sum(row[f"{part}_{kind}_mb"] for kind in KINDS)
    return row


TITLE = ("Expert parallelism (AutoEP) against ZeRO-3 alone, 2 processes (gloo) on a 2-core CPU: hidden 256, 4 layers, "
         "16 experts of which 4 per token, float32; 2 prompts of {prompt} tokens a rank, G={group} completions of "
         "{completion}; a rollout of {group} samples x {new_tokens} tokens per prompt")


def compare(family: str, path: Path, out: Path, work: dict, variants, processes: int = 2) -> list[dict]:
    """``variants`` of one checkpoint, each launched (``launch``), as rows with ratios against the first; the report
    rewritten after each."""
    rows, base = [], None
    for variant in variants:
        measured = launch(path, variant, out, work, processes)
        if "error" in measured:
            rows.append({"family": family, "variant": variant, "error": measured["error"]})
            print(f"{family} {variant}: FAILED: {measured['error']}", flush=True)
            continue
        row = summarise(family, variant, measured["ranks"])
        base = base or (row if variant == variants[0] else None)
        if base is not None:
            row.update(step_ratio=row["step_s"] / base["step_s"], rollout_ratio=row["rollout_s"] / base["rollout_s"],
                       peak_ratio=row["step_peak_mb"] / max(base["step_peak_mb"], 1e-9))
        rows.append(row)
        print(f"{family} {variant}: step {row['step_s']:.2f} s, rollout {row['rollout_s']:.2f} s, "
              f"{row['step_mb']:.1f} MiB a step ({row['step_gather_mb']:.1f} gathered, "
              f"{row['step_all_to_all_mb']:.1f} all-to-all), peak {row['step_peak_mb']:.0f} MiB", flush=True)
    return rows


def table(rows: list[dict], work: dict, title: str = TITLE) -> str:
    columns = ["family", "variant", "step_s", "step_ratio", "rollout_s", "rollout_ratio", "step_mb", "step_gather_mb",
               "step_reduce_scatter_mb", "step_all_to_all_mb", "step_all_reduce_mb", "rollout_mb",
               "rollout_all_to_all_mb", "step_peak_mb", "peak_ratio"]
    formats = {c: ".2f" for c in ("step_s", "rollout_s", "step_ratio", "rollout_ratio", "peak_ratio")}
    formats |= {c: ".1f" for c in columns if c.endswith("_mb")}
    errors = [f"- {r['family']} {r['variant']}: {r['error']}" for r in rows if "error" in r]
    return (f"## {title.format(**work)}\n\n" + markdown_table([r for r in rows if "error" not in r], columns, formats)
            + "\n\nstep/rollout: the slowest rank's seconds; *_mb: MiB a rank received from the others per step "
            "(gathers and reduce-scatters of ZeRO-3, the all-to-all of EP, all-reduces) and per rollout (under the "
            "full gather); step_peak_mb: the memory's peak above the step's start (the heap on CPU, the allocator on "
            "CUDA); ratios against the first variant. On CPU gloo moves bytes as memory copies: the bytes carry over "
            "to GPUs, the times and their ratios do not." + failed_points(errors))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = sorted({r["family"] for r in rows})

    def value(family, variant, key):
        return next((r.get(key, 0.0) for r in rows if r["family"] == family and r["variant"] == variant), 0.0)

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for ax, (key, label) in zip(axes[:2], (("step_ratio", "step time / ZeRO-3"), ("rollout_ratio", "rollout time / "
                                                                                  "ZeRO-3"))):
        for offset, variant in zip((-0.25, 0.0, 0.25), VARIANTS):
            ax.bar([i + offset for i in range(len(families))], [value(f, variant, key) for f in families], width=0.25,
                   label=variant)
        ax.set_xticks(range(len(families)), families)
        ax.set_title(label)
    axes[0].legend()
    ax = axes[2]  # a step's bytes by kind: ZeRO-3's gathers and reduce-scatters, then EP's all-to-all on top
    for offset, variant in zip((-0.25, 0.0, 0.25), VARIANTS):
        x = [i + offset for i in range(len(families))]
        zero3 = [value(f, variant, "step_gather_mb") + value(f, variant, "step_reduce_scatter_mb") for f in families]
        a2a = [value(f, variant, "step_all_to_all_mb") for f in families]
        ax.bar(x, zero3, width=0.25, color="0.6", edgecolor="black")
        ax.bar(x, a2a, width=0.25, bottom=zero3, color="tab:red", edgecolor="black")
        for xi, total in zip(x, (z + a for z, a in zip(zero3, a2a))):
            ax.text(xi, total, variant, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(families)), families)
    ax.set_title("MiB a step: gathers + reduce-scatters (grey), all-to-all (red)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out: Path, quick: bool = False, name: str = "ep") -> dict:
    work = QUICK if quick else WORKLOAD
    families = FAMILIES[:1] if quick else FAMILIES
    rows: list[dict] = []
    payload = {"workload": work, "rows": rows}
    for family in families:  # the checkpoints stay out of the report's folder (outputs/ is not committed)
        path = checkpoint(family, ROOT / "outputs" / "bench_checkpoints" / ("ep_quick" if quick else "ep"), quick)
        rows += compare(family, path, out, work, ("zero3", "ep2") if quick else VARIANTS)  # --quick: a smoke run
        write_report(out, name, payload, table(rows, work), quiet=True)
    write_report(out, name, payload, table(rows, work))
    if any("step_ratio" in r for r in rows):
        plot([r for r in rows if "step_ratio" in r], out / f"{name}.png")
    exit_if_failed(sum("error" in r for r in rows), len(rows), out)
    return payload


def main(argv: list[str] | None = None) -> None:
    cli(run, __doc__, "outputs/bench/ep", argv)


if __name__ == "__main__":
    main()
