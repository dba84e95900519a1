"""What a real run's scale costs: ZeRO-3 rollouts, logits at Qwen's vocabulary, video decoding on the critical path.

    python -m app.bench.scale --out outputs/bench/scale [--quick]      (scripts/bench.sh scale)

Three parts, each comparing variants side by side in one run:
1. rollout: one greedy rollout (2 prompts per rank, G=4, every completion decoded to the token limit) with 2
   processes (gloo on CPU, NCCL on GPU): ZeRO-2 against ZeRO-3 under each ``rollout.zero3_gather`` mode, the two
   engines one after the other in one launch. Time, all-gathers and bytes gathered per rank, and whether the greedy
   tokens equal ZeRO-2's.
2. logprob_memory: peak memory of one grouped forward+backward at vocabulary 151,936 (a prompt and 8 completions),
   full logits against ``forward.logprob_chunk_size`` chunks; each variant in a fresh process; same loss and gradients.
3. prefetch: the trainer on a slow-decoding video (long, high-resolution, sparse keyframes), ``data.prefetch`` 0
   against 1: mean seconds each step waited for data and mean step time.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from app.bench.common import ROOT, child_env, cli, device, isolated, markdown_table, write_report
from app.runtime.models import TinySizes, build_tiny_checkpoint
from app.runtime.zero import GATHER_MODES

# ~69M parameters: large enough that gathering is the cost it is at scale, small enough for a CPU.
ROLLOUT_SIZES = TinySizes(hidden=768, layers=8, heads=12, kv_heads=2, head_dim=64, intermediate=3072,
                          vision_hidden=64, vision_depth=2, vision_heads=2, max_positions=32768)
QUICK_SIZES = TinySizes(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=128, vision_hidden=32,
                        vision_depth=1, vision_heads=1, max_positions=32768)
PREFETCH_SIZES = TinySizes(hidden=256, layers=2, heads=4, kv_heads=1, head_dim=64, intermediate=704, vision_hidden=64)
QWEN_VOCAB = 151_936


# ---- 1. ZeRO-3 rollouts ---------------------------------------------------------------------------------------
def _count_all_gathers() -> dict:
    """Count every all-gather DeepSpeed issues (they all end in its backend's all_gather_function)."""
    from deepspeed.comm import comm

    stats = {"calls": 0, "bytes": 0}
    original = comm.cdb.all_gather_function

    def counted(output_tensor, input_tensor, group=None, async_op=False):
        stats["calls"] += 1
        stats["bytes"] += output_tensor.numel() * output_tensor.element_size()
        return original(output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op)

    comm.cdb.all_gather_function = counted
    return stats


def rollout_worker(checkpoint: str, video: str, zeros: str, new_tokens: int, rounds: int, out: str) -> None:
    """Under torchrun: for each stage of ``zeros`` (``zero2,zero3``), one after the other in this process, build the
    engine and time greedy rollouts in each gather mode (one launch for both: the imports paid once)."""
    from app.data.prompts import encode_prompts
    from app.data.video import video_element
    from app.runtime import distributed
    from app.runtime.models import load_processor

    rank, world = distributed.init_distributed()
    processor = load_processor(checkpoint)
    questions = [f"Question {rank}-{i}: what happens in the video?" for i in range(2)]
    conversations = [[{"role": "user", "content": [video_element(video, fps=2, min_pixels=3136, max_pixels=3136),
                                                   {"type": "text", "text": q}]}] for q in questions]
    prompts = {k: v.to(device()) for k, v in encode_prompts(processor, conversations).items()}
    stats = _count_all_gathers()
    found = {zero: _timed_rollouts(checkpoint, zero, prompts, processor, new_tokens=new_tokens, rounds=rounds,
                                   stats=stats)
             for zero in zeros.split(",")}
    if rank == 0:
        Path(out).write_text(json.dumps({"world": world, **found}))
    distributed.exit_worker()  # leaves without the interpreter's finalization, where a worker once aborted


def _timed_rollouts(checkpoint: str, zero: str, prompts: dict, processor, *, new_tokens: int, rounds: int,
                    stats: dict) -> dict:
    """One engine with ``zero`` (zero2|zero3); its greedy rollouts timed in each gather mode. The engine goes when
    this returns."""
    from app.rollout.generate import SamplingConfig, generate_groups
    from app.runtime import distributed
    from app.runtime import zero as zero_setup
    from app.runtime.models import load_model

    dev = device()
    ds_config = zero_setup.load_deepspeed_config(f"deepspeed_configs/{zero}.json", gradient_accumulation_steps=1,
                                                  max_grad_norm=1.0, dtype="float32")
    keep = zero_setup.hf_deepspeed_config(ds_config)  # noqa: F841 (ZeRO-3 partitions at from_pretrained)
    model = load_model(checkpoint)
    engine = zero_setup.build_engine(model, ds_config, torch.optim.SGD(model.parameters(), lr=0.0), None)
    greedy = SamplingConfig(temperature=0, max_new_tokens=new_tokens)
    results = {}
    for mode in (GATHER_MODES if zero == "zero3" else ("full",)):
        times, tokens = [], None
        for _ in range(1 if mode == "per_step" else rounds):  # per_step is the slow one: once is enough
            distributed.barrier()
            stats["calls"] = stats["bytes"] = 0
            start = time.perf_counter()
            with torch.no_grad(), zero_setup.gathered_for_inference(engine, mode) as (module, collective):
                rollout = generate_groups(module, prompts, 4, greedy, tokenizer=processor.tokenizer, eos_ids=[],
                                          synced=collective)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            tokens = rollout.completion_ids.tolist()
        results[mode] = {"seconds": statistics.median(times), "rounds": len(times), "all_gathers": stats["calls"],
                         "gathered_mb": stats["bytes"] / 2**20, "tokens": tokens}
    parameters = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    engine.destroy()
    return {"results": results, "parameters": parameters}


def _torchrun(args: list[str], timeout: int = 1800) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
               "app.bench.scale", *args]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                            env=child_env(OMP_NUM_THREADS="1"))
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")


def bench_rollout(out: Path, quick: bool) -> list[dict]:
    from app.data.video import write_mp4

    checkpoint = out / ("rollout-model-quick" if quick else "rollout-model")
    if not (checkpoint / "config.json").exists():
        build_tiny_checkpoint(checkpoint, "qwen2_5_vl", seed=0, sizes=QUICK_SIZES if quick else ROLLOUT_SIZES)
    video = out / "rollout-clip.mp4"
    if not video.exists():
        write_mp4(video, np.random.default_rng(0).integers(0, 255, (8, 56, 56, 3), dtype=np.uint8), fps=4)
    new_tokens, rounds = (8, 1) if quick else (64, 3)
    target = out / "rollout-zero.json"
    _torchrun(["rollout-worker", str(checkpoint), str(video), "zero2,zero3", str(new_tokens), str(rounds),
               str(target)])
    found = json.loads(target.read_text())
    base = found["zero2"]["results"]["full"]
    rows = [{"variant": "ZeRO-2", **{k: v for k, v in base.items() if k != "tokens"}, "vs_zero2": 1.0,
             "same_tokens": True}]
    for mode, result in found["zero3"]["results"].items():
        rows.append({"variant": f"ZeRO-3 zero3_gather={mode}", **{k: v for k, v in result.items() if k != "tokens"},
                     "vs_zero2": result["seconds"] / base["seconds"], "same_tokens": result["tokens"] == base["tokens"]})
    for row in rows:
        row["parameters_m"] = found["zero3"]["parameters"] / 1e6
        row["new_tokens"] = new_tokens
    return rows


# ---- 2. log-prob memory at Qwen's vocabulary --------------------------------------------------------------------
def logprob_memory(chunk_size: int, prompt: int, completions: int, length: int, hidden: int, vocab: int) -> dict:
    """One grouped forward + backward of sum(log-probs) in this (fresh) process; returns time, loss, grad norm."""
    from app.bench.common import peak_memory_mb
    from app.grouping import completion_logprobs
    from app.runtime.models import build_tokenizer, model_class, tiny_config

    sizes = TinySizes(hidden=hidden, layers=2, heads=4, kv_heads=2, head_dim=hidden // 4, intermediate=2 * hidden,
                      max_positions=prompt + length + 16)
    config = tiny_config("qwen2", build_tokenizer(), sizes)
    config.vocab_size = vocab
    torch.manual_seed(0)
    model = model_class(config).from_config(config).to(device())
    model.train()
    generator = torch.Generator().manual_seed(0)
    prompts = {"input_ids": torch.randint(0, vocab, (1, prompt), generator=generator).to(device()),
               "attention_mask": torch.ones(1, prompt, dtype=torch.long, device=device())}
    ids = torch.randint(0, vocab, (completions, length), generator=generator).to(device())
    mask = torch.ones_like(ids)
    before = peak_memory_mb()
    start = time.perf_counter()
    scores = completion_logprobs(model, prompts, ids, mask, completions, mode="grouped", chunk_size=chunk_size,
                                 return_entropy=True)
    loss = scores.logprobs.sum() / mask.sum()
    loss.backward()
    seconds = time.perf_counter() - start
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return {"seconds": seconds, "loss": float(loss), "grad_norm": float(grad_norm), "peak_before_mb": before}


def bench_memory(quick: bool) -> list[dict]:
    shape = dict(prompt=64, completions=4, length=32, hidden=64) if quick else \
        dict(prompt=2048, completions=8, length=768, hidden=256)
    rows = []
    for chunk in (0, 1024):
        result = isolated("app.bench.scale:logprob_memory", here=quick, chunk_size=chunk, vocab=QWEN_VOCAB, **shape)
        rows.append({"variant": "full logits" if chunk == 0 else f"chunked ({chunk} tokens)", "chunk_size": chunk,
                     **result, "above_model_mb": result["peak_memory_mb"] - result["peak_before_mb"],
                     "vocab": QWEN_VOCAB, **shape})
    for row in rows:
        row["memory_vs_full"] = row["peak_memory_mb"] / rows[0]["peak_memory_mb"]
        row["above_model_vs_full"] = row["above_model_mb"] / rows[0]["above_model_mb"]
        row["time_vs_full"] = row["seconds"] / rows[0]["seconds"]
        row["loss_rel_diff"] = abs(row["loss"] - rows[0]["loss"]) / abs(rows[0]["loss"])
        row["grad_norm_rel_diff"] = abs(row["grad_norm"] - rows[0]["grad_norm"]) / rows[0]["grad_norm"]
    return rows


# ---- 3. prefetch on a slow-decoding video -----------------------------------------------------------------------
def bench_prefetch(out: Path, quick: bool) -> list[dict]:
    from app.data.video import write_mp4

    checkpoint = out / ("prefetch-model-quick" if quick else "prefetch-model")
    if not (checkpoint / "config.json").exists():  # a step long enough to hide a decode behind (hidden 256)
        build_tiny_checkpoint(checkpoint, "qwen2_5_vl", seed=0, sizes=QUICK_SIZES if quick else PREFETCH_SIZES)
    frames, side = (40, 112) if quick else (300, 320)  # 10 s at 30 fps: ~0.25 s per prompt in decord + processor
    data = out / "prefetch-data"
    video = data / f"slow_{frames}x{side}.mp4"
    if not video.exists():
        rng = np.random.default_rng(0)
        write_mp4(video, rng.integers(0, 255, (frames, side, side, 3), dtype=np.uint8), fps=30)
    lines = [json.dumps({"problem_id": i, "problem": "What moves first?", "data_type": "video",
                         "problem_type": "multiple choice", "options": ["A. a", "B. b"], "path": video.name,
                         "solution": "<answer>A</answer>"}) for i in range(16)]
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    steps = 2 if quick else 6  # the first step is left out of the means
    rows = []
    for prefetch in (0, 1):
        run_dir = out / f"prefetch-run-{prefetch}"
        command = [sys.executable, "-m", "app.training.trainer", str(ROOT / "configs" / "demo_cpu.yaml"),
                   f"model.path={checkpoint}", f"data.train_file={data / 'train.jsonl'}", f"train.output_dir={run_dir}",
                   f"data.prefetch={prefetch}", "data.max_frames=16", "data.fps=2", f"train.max_steps={steps}",
                   "train.prompts_per_rank=2", "train.groups_per_micro_batch=2",
                   f"rollout.group_size={4 if quick else 8}", f"rollout.max_completion_length={16 if quick else 48}", "train.save_every=0", "train.export_hf=false",
                   "logging.wandb_mode=disabled", "logging.progress_bar=false", "forward.self_check=false"]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                                env=child_env(WANDB_MODE="disabled"))
        if result.returncode != 0:
            raise RuntimeError(f"prefetch={prefetch} run failed:\n{result.stderr[-4000:]}")
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
        rows.append({"variant": f"data.prefetch={prefetch}", "steps_measured": len(metrics),
                     "data_wait_s": statistics.mean(m["time/data_wait"] for m in metrics),
                     "step_s": statistics.mean(m["time/step"] for m in metrics),
                     "video": f"{frames} frames {side}x{side} @30 fps"})
    for row in rows:
        row["step_vs_no_prefetch"] = row["step_s"] / rows[0]["step_s"]
    return rows


def plot(rows_rollout, rows_memory, rows_prefetch, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    names = [r["variant"].replace("ZeRO-3 zero3_gather=", "ZeRO-3\n") for r in rows_rollout]
    axes[0].bar(names, [r["seconds"] for r in rows_rollout], color=["#4c72b0", "#55a868", "#c4a000", "#c44e52"])
    for i, r in enumerate(rows_rollout):
        axes[0].text(i, r["seconds"], f"{r['vs_zero2']:.2f}x\n{r['all_gathers']} gathers", ha="center",
                     va="bottom", fontsize=8)
    axes[0].set_ylim(0, 1.2 * max(r["seconds"] for r in rows_rollout))
    axes[0].set_ylabel("seconds per rollout")
    axes[0].set_title("Rollout, 2 processes")
    axes[1].bar([r["variant"] for r in rows_memory], [r["peak_memory_mb"] / 1024 for r in rows_memory],
                color=["#c44e52", "#4c72b0"])
    for i, r in enumerate(rows_memory):
        axes[1].text(i, r["peak_memory_mb"] / 1024, f"{r['memory_vs_full']:.2f}x", ha="center", va="bottom")
    axes[1].set_ylim(0, 1.15 * max(r["peak_memory_mb"] for r in rows_memory) / 1024)
    axes[1].set_ylabel("peak memory (GiB)")
    axes[1].set_title(f"Forward+backward, vocab {QWEN_VOCAB:,}")
    width = 0.35
    x = np.arange(len(rows_prefetch))
    axes[2].bar(x - width / 2, [r["step_s"] for r in rows_prefetch], width, label="step")
    axes[2].bar(x + width / 2, [r["data_wait_s"] for r in rows_prefetch], width, label="waiting for data")
    axes[2].set_xticks(x, [r["variant"] for r in rows_prefetch])
    axes[2].set_ylabel("seconds (mean per step)")
    axes[2].set_title("Slow-decoding video")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(out: Path, quick: bool = False) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    rows_rollout = bench_rollout(out, quick)
    rows_memory = bench_memory(quick)
    rows_prefetch = bench_prefetch(out, quick)
    tables = [
        f"## Rollout with 2 processes on {device().type} ({rows_rollout[0]['parameters_m']:.0f}M parameters, "
        f"{rows_rollout[0]['new_tokens']} greedy tokens x 4 x 2 prompts per rank)\n\n" + markdown_table(
            rows_rollout, ["variant", "seconds", "vs_zero2", "all_gathers", "gathered_mb", "rounds", "same_tokens"],
            {"seconds": ".2f", "vs_zero2": ".2f", "gathered_mb": ".0f"}),
        f"## Policy forward+backward at vocab {QWEN_VOCAB:,} (peak memory, fresh process each)\n\n" + markdown_table(
            rows_memory, ["variant", "peak_memory_mb", "memory_vs_full", "above_model_mb", "above_model_vs_full",
                          "seconds", "time_vs_full", "loss_rel_diff", "grad_norm_rel_diff"],
            {"peak_memory_mb": ".0f", "memory_vs_full": ".2f", "above_model_mb": ".0f", "above_model_vs_full": ".2f",
             "seconds": ".2f", "time_vs_full": ".2f", "loss_rel_diff": ".1e", "grad_norm_rel_diff": ".1e"}),
        "## Prefetch (trainer, one process, first step excluded)\n\n" + markdown_table(
            rows_prefetch, ["variant", "data_wait_s", "step_s", "step_vs_no_prefetch", "steps_measured", "video"],
            {"data_wait_s": ".3f", "step_s": ".3f", "step_vs_no_prefetch": ".2f"}),
    ]
    payload = {"rollout": rows_rollout, "logprob_memory": rows_memory, "prefetch": rows_prefetch, "quick": quick}
    write_report(out, "scale", payload, "\n\n".join(tables))
    plot(rows_rollout, rows_memory, rows_prefetch, out / "scale.png")
    return payload


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "rollout-worker":
        checkpoint, video, zero, new_tokens, rounds, target = argv[1:7]
        rollout_worker(checkpoint, video, zero, int(new_tokens), int(rounds), target)
        return
    cli(run, __doc__, "outputs/bench/scale", argv)


if __name__ == "__main__":
    main()
