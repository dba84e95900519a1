"""Sequence parallelism on long prefixes: per-rank memory and time of one policy forward + backward against the
prefix length, for S = 1, 2, 4 ranks holding one packed row (S processes on this machine, gloo).

    python -m app.bench.long_video --out outputs/bench/long_video [--quick]      (scripts/bench.sh long_video)

The model is fixed (a Qwen2.5-VL text stack, hidden 256, 4 query / 2 KV heads, 2 layers); the prefix is P tokens, the
group G = 4 completions of 64 tokens; S = 1 runs the ordinary grouped forward, S > 1 the sequence-parallel one.
Each point is a fresh set of processes. "activation" is a rank's peak resident memory during the forward +
backward minus its resident memory just before (model, inputs and interpreter excluded); the largest over the ranks
is reported. From the table: the longest prefix whose activation fits a budget (the S = 1 activation at the
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

from app.bench.common import ROOT, child_env, cli, markdown_table, write_report

SIZES = (1, 2, 4)
GROUP, COMPLETION = 4, 64


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(prefix: int, out: str) -> None:
    """One rank of one point (under torchrun, or alone for S = 1)."""
    import torch.distributed as dist

    from app.grouping import completion_logprobs
    from app.grouping.sequence_parallel import SequenceParallel, sequence_parallel_logprobs
    from app.models import TinySizes, build_tokenizer, model_class, tiny_config

    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if size > 1 else 0
    torch.manual_seed(0)
    config = tiny_config("qwen2_5_vl", build_tokenizer(),
                         TinySizes(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512,
                                   max_positions=prefix + COMPLETION + 16))
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
    start = time.perf_counter()
    if size > 1:
        logprobs = sequence_parallel_logprobs(model, prompts, completions, mask, GROUP,
                                              SequenceParallel(rank=rank, size=size), backend="split")
    else:
        logprobs = completion_logprobs(model, prompts, completions, mask, GROUP, backend="split").logprobs
    logprobs.sum().backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"rank": rank, "seconds": seconds, "before_mb": before, "peak_mb": peak,
              "activation_mb": peak - before, "loss": float(logprobs.detach().sum())}
    gathered = [result]
    if size > 1:
        gathered = [None] * size
        dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    if size > 1:
        from app.distributed import exit_worker

        exit_worker()


def point(size: int, prefix: int, out: Path) -> dict:
    target = out / f"point-S{size}-P{prefix}.json"
    module = ["-m", "app.bench.long_video", "--worker", str(prefix), str(target)]
    command = ([sys.executable, *module] if size == 1 else
               [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(size), *module])
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                          env=child_env(OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // size))))
    if done.returncode != 0:
        raise RuntimeError(f"S={size} P={prefix} failed:\n{done.stderr[-4000:]}")
    ranks = json.loads(target.read_text())
    return {"S": size, "prefix": prefix, "seconds": max(r["seconds"] for r in ranks),
            "activation_mb": max(r["activation_mb"] for r in ranks), "peak_mb": max(r["peak_mb"] for r in ranks),
            "loss": ranks[0]["loss"]}


def longest_within(rows: list[dict], size: int, budget: float) -> float:
    """The prefix at which S = size's activation line reaches ``budget`` MB (least squares through its points)."""
    pts = [(r["prefix"], r["activation_mb"]) for r in rows if r["S"] == size]
    slope, intercept = np.polyfit([p for p, _ in pts], [a for _, a in pts], 1)
    return float((budget - intercept) / slope)


def run(out: Path, quick: bool = False) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    prefixes = (256, 512) if quick else (4096, 8192, 16384, 32768)
    sizes = (1, 2) if quick else SIZES
    rows = []
    for prefix in prefixes:
        for size in sizes:
            rows.append(point(size, prefix, out))
            print(rows[-1], flush=True)
    one = {r["prefix"]: r for r in rows if r["S"] == 1}
    for row in rows:
        base = one[row["prefix"]]
        row["activation_vs_S1"] = row["activation_mb"] / base["activation_mb"]
        row["activation_x_S"] = row["activation_vs_S1"] * row["S"]  # 1.0 = a perfect 1/S split
        row["time_vs_S1"] = row["seconds"] / base["seconds"]
        row["loss_rel_diff"] = abs(row["loss"] - base["loss"]) / abs(base["loss"])
    budget = one[prefixes[-2]]["activation_mb"]
    longest = {size: longest_within(rows, size, budget) for size in sizes}
    growth = {size: longest[size] / longest[1] for size in sizes}
    table = markdown_table(rows, ["S", "prefix", "seconds", "time_vs_S1", "activation_mb", "activation_vs_S1",
                                  "activation_x_S", "peak_mb", "loss_rel_diff"],
                           {"seconds": ".2f", "time_vs_S1": ".2f", "activation_mb": ".0f", "activation_vs_S1": ".3f",
                            "activation_x_S": ".2f", "peak_mb": ".0f", "loss_rel_diff": ".1e"})
    fits = "\n".join(f"| {s} | {longest[s]:.0f} | {growth[s]:.2f} |" for s in sizes)
    table = (f"## Sequence parallelism: one forward + backward, G={GROUP} x {COMPLETION} tokens, per-rank memory "
             f"(largest rank) and time, {os.cpu_count()} CPU cores shared by the S processes\n\n{table}\n\n"
             f"Longest prefix within {budget:.0f} MB of activation (S=1's at P={prefixes[-2]}):\n\n"
             f"| S | longest prefix | vs S=1 |\n|---|---|---|\n{fits}")
    payload = {"rows": rows, "budget_mb": budget, "longest_prefix": longest, "growth": growth, "quick": quick}
    write_report(out, "long_video", payload, table)
    plot(rows, sizes, out / "long_video.png")
    return payload


def plot(rows: list[dict], sizes, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for size in sizes:
        pts = sorted((r["prefix"], r["activation_mb"], r["seconds"]) for r in rows if r["S"] == size)
        left.plot([p for p, _, _ in pts], [a for _, a, _ in pts], marker="o", label=f"S={size}")
        right.plot([p for p, _, _ in pts], [s for _, _, s in pts], marker="o", label=f"S={size}")
    left.set(xlabel="prefix tokens", ylabel="activation MB per rank (largest)", title="Memory")
    right.set(xlabel="prefix tokens", ylabel="seconds (forward + backward)", title="Time")
    for ax in (left, right):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(int(argv[1]), argv[2])
        return
    cli(run, __doc__, "outputs/bench/long_video", argv)


if __name__ == "__main__":
    main()
