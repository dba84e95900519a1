"""The GPU acceptance's real-shape part: Qwen2.5-VL-7B's layer shape at a depth that fits one GPU, bfloat16.

    python -m app.bench.gpu_real_shape --out outputs/gpu/gpu_real_shape [--quick]

On CUDA: 4 of the 28 decoder layers at full width, bfloat16, the CUDA default grouped backend (flash-attn when
installed, else FlexAttention); video-length prefixes of 8k and 16k tokens, G = 8 completions of 256. For each:
grouped vs repeated policy forward+backward time and ``torch.cuda.max_memory_allocated`` above the weights and
gradients, with the planner's prediction beside them (a layout that runs out of memory is reported as such, with
the planner's figure); then grouped decoding vs HF ``generate`` of 64 new tokens per sample at that width.
``--quick`` runs the same code on this CPU at toy lengths (so the suite keeps it working).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from app.bench.common import cli, device, markdown_table, write_report

PRESET, LAYERS = "qwen2_5_vl_7b", 4
PREFIXES, GROUP, COMPLETION, NEW_TOKENS = (8192, 16384), 8, 256, 64


def _inputs(prefix: int, group: int, completion: int, dev):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 100000, (1, prefix), generator=generator)
    completions = torch.randint(1000, 100000, (group, completion), generator=generator)
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}
    return {k: v.to(dev) for k, v in prompts.items()}, completions.to(dev), torch.ones_like(completions).to(dev)


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def train_point(model, shape, prefix: int, group: int, completion: int, mode: str, *, dtype_bytes: int) -> dict:
    from app import costs
    from app.bench.measure import forward_backward
    from app.grouping.attention import default_backend

    dev = next(model.parameters()).device
    backend = None if mode == "repeated" else default_backend(dev)
    prompts, completions, mask = _inputs(prefix, group, completion, dev)
    work = costs.Workload(prefix=prefix, completion=completion, group_size=group)
    kind = "repeated" if mode == "repeated" else backend
    planned = costs.training_activations(shape, work, backend=kind, dtype_bytes=dtype_bytes, checkpointing=False,
                                         chunk=1024)["peak"]
    row = {"mode": mode, "prefix": prefix, "backend": kind, "planned_peak_gib": planned / 2**30}
    try:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        _sync(dev)
        start = time.perf_counter()
        measured = forward_backward(model, prompts, completions, mask, group, mode=mode, backend=backend,
                                    flops=False)
        _sync(dev)
        row["seconds"] = time.perf_counter() - start
        row["live_peak_gib"] = measured["peak"] / 2**30
        if dev.type == "cuda":
            row["cuda_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    except torch.OutOfMemoryError:
        row["seconds"], row["error"] = float("nan"), "out of memory"
        model.zero_grad(set_to_none=False)
    return row


def decode_point(model, prefix: int, group: int, new_tokens: int) -> dict:
    from app.rollout import SamplingConfig, generate_groups

    dev = next(model.parameters()).device
    prompts, _, _ = _inputs(prefix, 1, 1, dev)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, seed=0)
    row = {"prefix": prefix, "new_tokens": new_tokens}
    for name, fn in (
        ("grouped", lambda: generate_groups(model, prompts, group, sampling, eos_ids=[])),
        ("hf", lambda: model.generate(**prompts, do_sample=True, num_return_sequences=group,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=1.0,
                                      top_p=None, top_k=None)),
    ):
        try:
            with torch.no_grad():
                _sync(dev)
                start = time.perf_counter()
                fn()
                _sync(dev)
            row[f"{name}_seconds"] = time.perf_counter() - start
        except torch.OutOfMemoryError:
            row[f"{name}_seconds"] = float("nan")
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    row["ratio"] = row["grouped_seconds"] / row["hf_seconds"]
    return row


def run(out: Path, quick: bool = False) -> dict:
    from app import costs, shapes
    from app.models import model_class

    dev = device()
    if quick:
        preset, layers, prefixes, group, completion, new, dtype = "qwen2_5_vl_3b", 1, (96,), 2, 8, 4, torch.float32
    else:
        preset, layers, prefixes, group, completion, new, dtype = (PRESET, LAYERS, PREFIXES, GROUP, COMPLETION,
                                                                    NEW_TOKENS, torch.bfloat16)
    config = shapes.hf_config(preset, layers=layers, vision_layers=1)
    torch.manual_seed(0)
    model = model_class(config).from_config(config, dtype=dtype).to(dev)
    model.train()
    shape = costs.shape_of(config)
    size = 2 if dtype == torch.bfloat16 else 4
    training = []
    for prefix in prefixes:
        rows = {mode: train_point(model, shape, prefix, group, completion, mode, dtype_bytes=size) for mode in ("grouped", "repeated")}
        for mode, row in rows.items():
            training.append(row)
            print(f"P={prefix} {mode}: {row}", flush=True)
    model.eval()
    for p in model.parameters():
        p.grad = None
    decoding = [decode_point(model, prefix, group, new) for prefix in prefixes]
    for row in decoding:
        print(f"decode P={row['prefix']}: {row}", flush=True)
    table = (f"## {preset} layer shape, {layers} layers, {str(dtype).split('.')[-1]}, {dev.type}\n\n"
             + markdown_table(training, ["mode", "prefix", "backend", "seconds", "cuda_peak_gib", "live_peak_gib",
                                         "planned_peak_gib", "error"],
                              {k: ".2f" for k in ("seconds", "cuda_peak_gib", "live_peak_gib", "planned_peak_gib")})
             + "\n\n### decoding: grouped vs HF generate\n\n"
             + markdown_table(decoding, ["prefix", "new_tokens", "grouped_seconds", "hf_seconds", "ratio"],
                              {k: ".3f" for k in ("grouped_seconds", "hf_seconds", "ratio")}))
    payload = {"preset": preset, "layers": layers, "dtype": str(dtype), "group": group, "completion": completion,
               "training": training, "decoding": decoding}
    write_report(out, "gpu_real_shape", payload, table)
    return payload


def main(argv: list[str] | None = None) -> None:
    cli(run, __doc__, "outputs/gpu/gpu_real_shape", argv)


if __name__ == "__main__":
    main()
