"""Sequence parallelism on long prefixes: per-rank memory and time of one policy forward + backward against the
prefix length, for S = 1, 2, 4 ranks holding one packed row (S processes on this machine, gloo).

    python -m app.bench.long_video --out outputs/bench/long_video [--quick] [--shape tiny|7b_ratio]
        [--prefixes 4096,8192] [--sizes 1,2,4]                                    (scripts/bench.sh long_video)

The model is fixed (a Qwen2.5-VL text stack, hidden 256, 4 query / 2 KV heads, 2 layers); the prefix is P tokens, the
group G = 4 completions of 64 tokens; S = 1 runs the ordinary grouped forward, S > 1 the sequence-parallel one.
Each point is a fresh set of processes. "activation" is a rank's peak resident memory during the forward +
backward minus its resident memory just before (model, inputs and interpreter excluded); the largest over the ranks
is reported (points run with ``common.LIVE_MEMORY_ENV``: the allocator returns freed blocks, so this follows the
live tensors); "saved" is what autograd keeps for the backward (unique storages, parameters excluded: exact, not
subject to the allocator's reuse and fragmentation that make the resident figure noisy). From the table: the longest prefix whose activation fits a budget (the S = 1 activation at the
second-longest prefix) for each S, read off a straight line through each S's points (activation is linear in P
here: the attention never holds a P x P matrix). Communication: the time of S ranks against S = 1's divided by S
(the work per rank) is printed as the overhead.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from app.bench.common import LIVE_MEMORY_ENV, ROOT, child_env, cli, markdown_table, write_report

SIZES = (1, 2, 4)
GROUP, COMPLETION = 4, 64
# The fixed model's layer shape. "tiny": attention as wide as the MLP's input (the default, the table in README).
# "7b_ratio": Qwen2.5-VL-7B's proportions at a CPU-sized width (head_dim 128, MLP 5.3x hidden: 3584 -> 18944),
# where the MLP's activations, which split perfectly, outweigh the whole-row q/k/v a rank holds for its H/S heads.
SHAPES = {"tiny": dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512),
          "7b_ratio": dict(hidden=512, heads=4, kv_heads=2, head_dim=128, intermediate=2708)}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(prefix: int, out: str, shape: str = "tiny") -> None:
    """One rank of one point (under torchrun, or alone for S = 1)."""
    import torch.distributed as dist

    from app.grouping import completion_logprobs
    from app.grouping.sequence_parallel import SequenceParallel, sequence_parallel_scores
    from app.runtime.models import TinySizes, build_tokenizer, model_class, tiny_config

    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if size > 1 else 0
    torch.manual_seed(0)
    config = tiny_config("qwen2_5_vl", build_tokenizer(),
                         TinySizes(**SHAPES[shape], max_positions=prefix + COMPLETION + 16))
    model = model_class(config).from_config(config)
    model.train()
    vocab = config.get_text_config().vocab_size
    special = {getattr(config, k, None) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                   "vision_end_token_id")}
    plain = torch.tensor([t for t in range(vocab) if t not in special])  # text tokens only
    generator = torch.Generator().manual_seed(1)

    def draw(*shape):
        return plain[torch.randint(0, len(plain), shape, generator=generator)]

    ids = draw(1, prefix)
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
               "mm_token_type_ids": torch.zeros_like(ids)}
    completions = draw(GROUP, COMPLETION)
    mask = torch.ones_like(completions)
    before = _rss_mb()
    saved: dict[int, int] = {}  # storage address -> bytes, of every tensor autograd keeps for the backward

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        if size > 1:
            logprobs = sequence_parallel_scores(model, prompts, completions, mask, GROUP,
                                                SequenceParallel(rank=rank, size=size), backend="split").logprobs
        else:
            logprobs = completion_logprobs(model, prompts, completions, mask, GROUP, backend="split").logprobs
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved_mb = sum(n for ptr, n in saved.items() if ptr not in parameters) / 2**20
    logprobs.sum().backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"rank": rank, "seconds": seconds, "before_mb": before, "peak_mb": peak,
              "activation_mb": peak - before, "saved_mb": saved_mb, "loss": float(logprobs.detach().sum())}
    gathered = [result]
    if size > 1:
        gathered = [None] * size
        dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    if size > 1:
        from app.runtime.distributed import exit_worker

        exit_worker()


def point(size: int, prefix: int, out: Path, shape: str = "tiny", here: bool = False) -> dict:
    """One (S, prefix) point in its own processes; ``here`` (``--quick``: every code path, no figure read) runs
    S = 1 in this process."""
    target = out / f"point-S{size}-P{prefix}.json"
    if size == 1 and here:
        worker(prefix, str(target), shape)
    else:
        module = ["-m", "app.bench.long_video", "--worker", str(prefix), str(target), shape]
        command = ([sys.executable, *module] if size == 1 else
                   [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(size),
                    *module])
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                              env=child_env(OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // size)),
                                            **LIVE_MEMORY_ENV))
        if done.returncode != 0:
            raise RuntimeError(f"S={size} P={prefix} failed:\n{done.stderr[-4000:]}")
    ranks = json.loads(target.read_text())
    return {"S": size, "prefix": prefix, "seconds": max(r["seconds"] for r in ranks),
            "activation_mb": max(r["activation_mb"] for r in ranks), "peak_mb": max(r["peak_mb"] for r in ranks),
            "saved_mb": max(r["saved_mb"] for r in ranks),
            "loss": ranks[0]["loss"]}


def longest_within(rows: list[dict], size: int, budget: float, key: str = "activation_mb") -> float:
    """The prefix at which S = size's ``key`` line reaches ``budget`` MB (least squares through its points)."""
    pts = [(r["prefix"], r[key]) for r in rows if r["S"] == size]
    slope, intercept = np.polyfit([p for p, _ in pts], [a for _, a in pts], 1)
    return float((budget - intercept) / slope)


def run(out: Path, quick: bool = False, shape: str = "tiny", prefixes=None, sizes=None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    prefixes = prefixes or ((256, 512) if quick else (4096, 8192, 16384, 32768))
    sizes = sizes or ((1, 2) if quick else SIZES)
    rows = []
    for prefix in prefixes:
        for size in sizes:
            rows.append(point(size, prefix, out, shape, here=quick))
            print(rows[-1], flush=True)
    return report(out, rows, shape, quick)


def report(out: Path, rows: list[dict], shape: str, quick: bool = False) -> dict:
    """Ratios, the longest prefix within a budget (by resident and by saved memory), table, JSON and plot from the
    measured points (``python -c 'from app.bench.long_video import report...'`` rebuilds them from a JSON's rows)."""
    prefixes = sorted({r["prefix"] for r in rows})
    sizes = sorted({r["S"] for r in rows})
    one = {r["prefix"]: r for r in rows if r["S"] == 1}
    for row in rows:
        base = one[row["prefix"]]
        row["activation_vs_S1"] = row["activation_mb"] / base["activation_mb"]
        row["activation_x_S"] = row["activation_vs_S1"] * row["S"]  # 1.0 = a perfect 1/S split
        row["saved_x_S"] = row["saved_mb"] / base["saved_mb"] * row["S"]
        row["time_vs_S1"] = row["seconds"] / base["seconds"]
        row["loss_rel_diff"] = abs(row["loss"] - base["loss"]) / abs(base["loss"])
    budgets, longest, growth = {}, {}, {}
    for key in ("activation_mb", "saved_mb"):
        budgets[key] = one[prefixes[-2]][key]
        longest[key] = {size: longest_within(rows, size, budgets[key], key) for size in sizes}
        growth[key] = {size: longest[key][size] / longest[key][1] for size in sizes}
    table = markdown_table(rows, ["S", "prefix", "seconds", "time_vs_S1", "activation_mb", "activation_vs_S1",
                                  "activation_x_S", "saved_mb", "saved_x_S", "peak_mb", "loss_rel_diff"],
                           {"seconds": ".2f", "time_vs_S1": ".2f", "activation_mb": ".0f", "activation_vs_S1": ".3f",
                            "activation_x_S": ".2f", "saved_mb": ".0f", "saved_x_S": ".2f", "peak_mb": ".0f",
                            "loss_rel_diff": ".1e"})
    fits = "\n".join(f"| {s} | {longest['activation_mb'][s]:.0f} | {growth['activation_mb'][s]:.2f} | "
                     f"{longest['saved_mb'][s]:.0f} | {growth['saved_mb'][s]:.2f} |" for s in sizes)
    table = (f"## Sequence parallelism ({shape} layer: {SHAPES[shape]}): one forward + backward, G={GROUP} x "
             f"{COMPLETION} tokens, per-rank memory (largest rank) and time, {os.cpu_count()} CPU cores shared by "
             f"the S processes\n\n{table}\n\n"
             f"Longest prefix within S=1's memory at P={prefixes[-2]} ({budgets['activation_mb']:.0f} MB resident "
             f"activation; {budgets['saved_mb']:.0f} MB saved for the backward):\n\n"
             f"| S | longest (resident) | vs S=1 | longest (saved) | vs S=1 |\n|---|---|---|---|---|\n{fits}")
    payload = {"rows": rows, "budget_mb": budgets, "longest_prefix": longest, "growth": growth, "quick": quick,
               "shape": shape, "layer": SHAPES[shape]}
    write_report(out, "long_video", payload, table)
    plot(rows, sizes, out / "long_video.png")
    return payload


def plot(rows: list[dict], sizes, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for size in sizes:
        pts = sorted((r["prefix"], r["activation_mb"], r["seconds"], r["saved_mb"]) for r in rows if r["S"] == size)
        line = left.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"S={size} resident")[0]
        left.plot([p[0] for p in pts], [p[3] for p in pts], marker="x", linestyle="--", color=line.get_color(),
                  label=f"S={size} saved")
        right.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=f"S={size}")
    left.set(xlabel="prefix tokens", ylabel="MB per rank (largest)", title="Memory: resident peak, saved for backward")
    right.set(xlabel="prefix tokens", ylabel="seconds (forward + backward)", title="Time")
    for ax in (left, right):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(int(argv[1]), argv[2], *argv[3:4])
        return
    shape, prefixes, sizes = "tiny", None, None  # --shape NAME, --prefixes 8192,16384, --sizes 1,2 (before cli's)
    for flag in ("--shape", "--prefixes", "--sizes"):
        if flag in argv:
            i = argv.index(flag)
            value = argv[i + 1]
            del argv[i : i + 2]
            if flag == "--shape":
                shape = value
            elif flag == "--prefixes":
                prefixes = tuple(int(v) for v in value.split(","))
            else:
                sizes = tuple(int(v) for v in value.split(","))
    if shape not in SHAPES:
        raise SystemExit(f"--shape must be one of {sorted(SHAPES)}, got {shape!r}")
    cli(lambda out, quick: run(out, quick, shape, prefixes, sizes), __doc__, "outputs/bench/long_video", argv)


if __name__ == "__main__":
    main()
