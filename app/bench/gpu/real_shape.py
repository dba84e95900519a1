"""The GPU acceptance's real-shape training part: the Qwen2.5-VL-7B and Qwen3-VL-8B classes at full width, a few
decoder layers, bfloat16, one policy forward+backward as the trainer runs it.

    python -m app.bench.gpu.real_shape --out outputs/gpu/gpu_real_shape [--quick]

For each family and video-length prefix (8k and 16k tokens), G = 8 completions of 256: the CUDA default grouped
backend (``default_backend``: flash-attn when installed, else FlexAttention), the ``packed`` backend, and the
TRL-style repeated layout. Every point is called once at its own shape before it is timed (compilation, cuBLAS and
the allocator's first use), with gradient buffers allocated beforehand as ZeRO's are. Memory is the allocator's own
peak (``torch.cuda.max_memory_allocated`` above the weights and gradients), beside the planner's prediction
(``costs.training_activations``); no Python dispatch mode is active (torch.compile does not run under one). A point
that runs out of memory is a row saying so, with the planner's figure. ``--quick`` runs the same code on this CPU at
toy lengths (so the suite keeps it working).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from app.bench.common import cli, device, markdown_table, write_report

# (preset, decoder layers, [(prefix, variants)]): the default backend, packed, and repeated per prefix
POINTS = (("qwen2_5_vl_7b", 4, ((8192, ("default", "packed", "repeated")), (16384, ("default", "packed", "repeated")))),
          ("qwen3_vl_8b", 4, ((8192, ("default", "repeated")), (16384, ("default",)))))
QUICK_POINTS = (("qwen2_5_vl_3b", 1, ((96, ("default", "packed", "repeated")),)),
                ("qwen3_vl_2b", 1, ((96, ("default", "repeated")),)))
GROUP, COMPLETION = 8, 256


def inputs(prefix: int, group: int, completion: int, dev, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 100000, (1, prefix), generator=generator)
    completions = torch.randint(1000, 100000, (group, completion), generator=generator)
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}
    return {k: v.to(dev) for k, v in prompts.items()}, completions.to(dev), torch.ones_like(completions).to(dev)


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def build(preset: str, layers: int, dtype: torch.dtype, dev):
    """The real class at full width and ``layers`` decoder layers, random weights made on ``dev`` directly."""
    from app.planning import shapes

    config = shapes.hf_config(preset, layers=layers, vision_layers=1)
    torch.manual_seed(0)
    with torch.device(dev):
        model = shapes.random_model(config, dtype)
    return model.train(), config


def pass_once(model, prompts, completions, mask, group: int, *, mode: str, backend: str | None) -> None:
    """One policy forward+backward as the trainer runs it (entropy asked for on the first pass)."""
    from app.grouping import attention_restored, completion_logprobs

    with attention_restored(model):
        scores = completion_logprobs(model, prompts, completions, mask, group, mode=mode, backend=backend,
                                     return_entropy=True)
        scores.logprobs.sum().backward()


def train_point(model, shape, prefix: int, variant: str, *, group: int, completion: int, dtype_bytes: int) -> dict:
    from app.grouping.attention import default_backend
    from app.planning import costs

    dev = next(model.parameters()).device
    mode = "repeated" if variant == "repeated" else "grouped"
    backend = None if mode == "repeated" else (default_backend(dev) if variant == "default" else variant)
    kind = "repeated" if mode == "repeated" else backend
    work = costs.Workload(prefix=prefix, completion=completion, group_size=group)
    planned = costs.training_activations(shape, work, backend=kind, dtype_bytes=dtype_bytes, checkpointing=False,
                                         chunk=1024)["peak"]
    row = {"mode": mode, "variant": variant, "prefix": prefix, "backend": kind, "planned_peak_gib": planned / 2**30}
    batch = inputs(prefix, group, completion, dev)
    try:
        pass_once(model, *batch, group, mode=mode, backend=backend)  # warm-up at this very shape
        sync(dev)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        pass_once(model, *batch, group, mode=mode, backend=backend)
        sync(dev)
        row["seconds"] = time.perf_counter() - start
        if dev.type == "cuda":
            row["cuda_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            row["planner_vs_cuda"] = row["planned_peak_gib"] / row["cuda_peak_gib"]
    except torch.OutOfMemoryError:
        row["seconds"], row["error"] = float("nan"), "out of memory"
    finally:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return row


def run(out: Path, quick: bool = False) -> dict:
    from app.planning import costs

    dev = device()
    points, group, completion = (QUICK_POINTS, 2, 8) if quick else (POINTS, GROUP, COMPLETION)
    dtype = torch.float32 if quick else torch.bfloat16
    size = 2 if dtype == torch.bfloat16 else 4
    rows: list[dict] = []
    payload = {"dtype": str(dtype), "group": group, "completion": completion, "rows": rows}
    for preset, layers, prefixes in points:
        start = time.perf_counter()
        model, config = build(preset, layers, dtype, dev)
        for p in model.parameters():  # gradient buffers first, as ZeRO allocates them
            p.grad = torch.zeros_like(p)
        shape = costs.shape_of(config)
        print(f"{preset} x{layers} layers built in {time.perf_counter() - start:.1f} s", flush=True)
        for prefix, variants in prefixes:
            for variant in variants:
                row = {"preset": preset, "layers": layers, **train_point(model, shape, prefix, variant, group=group,
                                                                         completion=completion, dtype_bytes=size)}
                rows.append(row)
                print(f"{preset} P={prefix} {variant}: " + ", ".join(
                    f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                    if k not in ("preset", "layers", "prefix", "variant")), flush=True)
                write_report(out, "gpu_real_shape", payload, table(rows, dev, dtype, group, completion), quiet=True)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    for row in rows:  # grouped vs repeated at the same shape
        same = [r for r in rows if r["preset"] == row["preset"] and r["prefix"] == row["prefix"]
                and r["mode"] == "repeated" and r.get("seconds") == r.get("seconds")]
        if row["mode"] == "grouped" and same and row.get("seconds") == row.get("seconds"):
            row["time_vs_repeated"] = row["seconds"] / same[0]["seconds"]
            if "cuda_peak_gib" in row:
                row["memory_vs_repeated"] = row["cuda_peak_gib"] / same[0]["cuda_peak_gib"]
    write_report(out, "gpu_real_shape", payload, table(rows, dev, dtype, group, completion))
    return payload


def table(rows: list[dict], dev, dtype, group: int, completion: int) -> str:
    columns = ["preset", "layers", "prefix", "variant", "backend", "seconds", "time_vs_repeated", "cuda_peak_gib",
               "memory_vs_repeated", "planned_peak_gib", "planner_vs_cuda", "error"]
    formats = {k: ".3f" for k in ("seconds", "time_vs_repeated", "memory_vs_repeated", "planner_vs_cuda")}
    formats |= {k: ".2f" for k in ("cuda_peak_gib", "planned_peak_gib")}
    return (f"## Policy forward+backward at full width, {str(dtype).split('.')[-1]}, {dev.type} (G={group}, "
            f"completions {completion}; second call at each shape timed)\n\n" + markdown_table(rows, columns, formats)
            + "\n\ncuda_peak_gib: torch.cuda.max_memory_allocated above weights and gradient buffers; "
              "planned_peak_gib: costs.training_activations for the same shape and backend.")


def main(argv: list[str] | None = None) -> None:
    cli(run, __doc__, "outputs/gpu/gpu_real_shape", argv)


if __name__ == "__main__":
    main()
