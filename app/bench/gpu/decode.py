"""Rollouts at real width on one GPU: the grouped engine against HF generate, and its decode step against the
memory-bandwidth limit.

    python -m app.bench.gpu.decode --out outputs/gpu/gpu_decode [--quick] [--layers N] [--hf-compiled]
    python -m app.bench.gpu.decode --hf-compiled-only --out outputs/gpu/gpu_decode_hf_compiled [--quick]

The Qwen2.5-VL-7B class at full width (random weights made on the GPU), ``--layers`` decoder layers (default all
28), bfloat16; one prompt of 8k or 16k tokens, G = 8 samples of exactly 64 or 256 new tokens, temperature 1:

- **step**: one decode step of the grouped engine alone (no sampling), CUDA events over 64 steps after 3 (their
  time, the capture or compilation, apart), for the step captured as a CUDA graph (``decode="graph"``, the CUDA
  default), compiled then captured (``compiled``) and eager steps, beside the
  bandwidth limit of the same depth: the bytes a step must read (every weight the text model uses, the prefix K/V
  once for the group, the samples' own K/V) over the GPU's nominal bandwidth, and over the bandwidth a device copy
  measured here;
- **rollout**: ``generate_groups`` (one prefill, grouped decode; the engine's default) against HF
  ``generate(num_return_sequences=8)`` (the prompt prefilled 8 times, its K/V read 8 times a step), each timed
  after a short warm-up at the same prompt; with ``--hf-compiled`` also HF with a static cache and
  ``torch.compile`` at the longest prompt and most tokens (its compilation timed apart), which
  ``--hf-compiled-only`` runs alone (the GPU acceptance gives it its own time limit).

Every row is written as soon as it is measured. ``--quick`` runs the same code on this CPU at toy sizes (static
steps instead of a graph).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from app.bench.common import device, markdown_table, write_report

PRESET, LAYERS, PREFIXES, GROUP, NEW_TOKENS = "qwen2_5_vl_7b", 28, (8192, 16384), 8, (64, 256)
STEPS = 64
NOMINAL_TB_S = {"H200": 4.8, "H100 NVL": 3.9, "H100 PCIe": 2.0, "H100": 3.35, "A100": 2.0}  # HBM, TB/s


def nominal_bandwidth(name: str) -> float | None:
    for key, value in NOMINAL_TB_S.items():
        if key in name:
            return value * 1e12
    return None


def copy_bandwidth(dev, nbytes: int = 2**31) -> float:
    """Bytes per second a device-to-device copy moves (read + write), the fastest of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * nbytes / best


def step_bytes(model, prefix: int, group: int, own: int) -> dict:
    """What one grouped decode step must read: the text model's weights (all but the vision tower and the input
    embedding table, of which it reads G rows), the prefix K/V once, and the samples' own K/V."""
    from app.grouping.modules import text_config, unwrap

    weights = 0
    for name, p in unwrap(model).named_parameters():
        if "visual" in name or "embed_tokens" in name:
            continue
        weights += p.numel() * p.element_size()
    text = text_config(model)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    size = next(unwrap(model).parameters()).element_size()
    per_token = text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * size  # K and V
    return {"weights": weights, "prefix_kv": per_token * prefix, "own_kv": per_token * own * group,
            "total": weights + per_token * (prefix + own * group)}


def prompt_of(prefix: int, dev) -> dict:
    generator = torch.Generator().manual_seed(prefix)
    ids = torch.randint(1000, 100000, (1, prefix), generator=generator).to(dev)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def step_time(model, prompts: dict, group: int, decode: str, steps: int) -> dict:
    """Seconds of the prefill, and ms per decode step (3 steps first: the graph is captured after the first)."""
    from app.grouping import GroupedDecoder

    dev = prompts["input_ids"].device
    sync(dev)
    start = time.perf_counter()
    decoder = GroupedDecoder(model, prompts, [group], steps + 3, decode=decode)
    sync(dev)
    prefill = time.perf_counter() - start
    tokens = torch.full((group,), 1000, dtype=torch.long, device=dev)
    try:
        start = time.perf_counter()
        for _ in range(3):
            decoder.step(tokens)
        sync(dev)
        warmup = time.perf_counter() - start  # the graph's capture, the compiled step's compilation
        start = time.perf_counter()
        for _ in range(steps):
            decoder.step(tokens)
        sync(dev)
        per_step = (time.perf_counter() - start) / steps
        return {"prefill_s": prefill, "warmup_s": warmup, "step_ms": per_step * 1e3, "mode": decoder.mode,
                "graph": decoder.graph is not None, "graph_error": decoder.graph_error or ""}
    finally:
        decoder.close()


@torch.no_grad()
def grouped_rollout(model, prompts: dict, group: int, new: int) -> float:
    from app.rollout.generate import SamplingConfig, generate_groups

    dev = prompts["input_ids"].device
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new, seed=0)
    generate_groups(model, prompts, group, SamplingConfig(temperature=1.0, max_new_tokens=4, seed=0), eos_ids=[])
    sync(dev)
    start = time.perf_counter()
    rollout = generate_groups(model, prompts, group, sampling, eos_ids=[])
    sync(dev)
    assert rollout.completion_ids.shape == (group, new)
    return time.perf_counter() - start


@torch.no_grad()
def hf_rollout(model, prompts: dict, group: int, new: int, **extra) -> float:
    dev = prompts["input_ids"].device

    def go(tokens):
        return model.generate(**prompts, do_sample=True, num_return_sequences=group, max_new_tokens=tokens,
                              min_new_tokens=tokens, temperature=1.0, top_p=None, top_k=None, **extra)

    go(4)
    sync(dev)
    start = time.perf_counter()
    out = go(new)
    sync(dev)
    assert out.shape[0] == group
    return time.perf_counter() - start


def build(preset: str, layers: int, dtype, dev, *, narrow: bool = False):
    from app.planning import shapes

    config = shapes.hf_config(preset, layers=layers, vision_layers=1, narrow=narrow)
    torch.manual_seed(0)
    with torch.device(dev):
        model = shapes.random_model(config, dtype)
    model.eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    return model


def run(out: Path, quick: bool = False, layers: int | None = None, hf_compiled: bool = False,
        hf_compiled_only: bool = False) -> dict:
    dev = device()
    if quick:
        preset, layers, prefixes, group, news, steps = "qwen2_5_vl_3b", layers or 1, (64,), 2, (8,), 4
        dtype, graph = torch.float32, "static" if dev.type == "cpu" else "graph"
    else:
        preset, layers, prefixes, group, news, steps = PRESET, layers or LAYERS, PREFIXES, GROUP, NEW_TOKENS, STEPS
        dtype, graph = torch.bfloat16, "graph"
    start = time.perf_counter()
    model = build(preset, layers, dtype, dev, narrow=quick)  # --quick: the layout at a toy width
    print(f"{preset} x{layers} layers built in {time.perf_counter() - start:.1f} s", flush=True)
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    bandwidth = {"nominal_tb_s": (nominal_bandwidth(name) or 0) / 1e12,
                 "copy_tb_s": copy_bandwidth(dev) / 1e12 if dev.type == "cuda" else 0.0}
    steps_rows: list[dict] = []
    rollout_rows: list[dict] = []
    payload = {"preset": preset + (" narrowed" if quick else ""), "layers": layers, "dtype": str(dtype),
               "group": group, "device": name,
               "bandwidth": bandwidth, "steps": steps_rows, "rollouts": rollout_rows}

    # the report's name is what app.bench.gpu.report looks for: one per part, so the two never overwrite each other
    name = "gpu_decode_hf_compiled" if hf_compiled_only else "gpu_decode"

    def save():
        write_report(out, name, payload, table(payload), quiet=True)

    if hf_compiled_only:
        compiled_rows(model, prefixes[-1], group, news[-1], payload, save)
        write_report(out, name, payload, table(payload))
        return payload
    for prefix in prefixes:
        prompts = prompt_of(prefix, dev)
        need = step_bytes(model, prefix, group, steps + 3)
        for mode in (graph, "compiled", "eager"):  # compiled: fused by torch.compile, then captured on CUDA
            row = against_limit({"prefix": prefix, "decode": mode, **step_time(model, prompts, group, mode, steps)},
                                need, bandwidth)
            steps_rows.append(row)
            print(f"step P={prefix} {mode}: {row}", flush=True)
            save()
    # the headline first (the longest prompt, the most tokens), so a time limit cuts the least telling rows
    order = sorted(((p, n) for p in prefixes for n in news), key=lambda pn: (pn != (prefixes[-1], news[-1]), pn[1], pn[0]))
    for prefix, new in order:
        prompts = prompt_of(prefix, dev)
        row = {"prefix": prefix, "G": group, "new_tokens": new}
        row["grouped_s"] = grouped_rollout(model, prompts, group, new)
        print(f"rollout P={prefix} new={new}: grouped {row['grouped_s']:.2f} s", flush=True)
        rollout_rows.append(row)
        save()
        try:
            row["hf_s"] = hf_rollout(model, prompts, group, new)
            row["grouped_vs_hf"] = row["grouped_s"] / row["hf_s"]
            row["hf_vs_grouped"] = row["hf_s"] / row["grouped_s"]
        except torch.OutOfMemoryError:
            row["hf_error"] = "out of memory"
            torch.cuda.empty_cache()
        print(f"rollout P={prefix} new={new}: {row}", flush=True)
        save()
    if hf_compiled:
        compiled_rows(model, prefixes[-1], group, news[-1], payload, save)
    write_report(out, name, payload, table(payload))
    return payload


def compiled_rows(model, prefix: int, group: int, new: int, payload: dict, save) -> None:
    """HF generate with a static cache and ``torch.compile`` (transformers compiles the decoding forward when the
    cache is static and the class allows it) beside the grouped engine at the same depth; the first call, which
    compiles, is timed apart."""
    dev = next(model.parameters()).device
    prompts = prompt_of(prefix, dev)
    row = {"prefix": prefix, "G": group, "new_tokens": new, "can_compile_fullgraph":
           bool(getattr(model, "_can_compile_fullgraph", False))}
    payload["hf_static_compiled"] = row
    row["grouped_s"] = grouped_rollout(model, prompts, group, new)
    save()
    kwargs = dict(cache_implementation="static")
    start = time.perf_counter()
    try:
        with torch.no_grad():
            model.generate(**prompts, do_sample=True, num_return_sequences=group, max_new_tokens=8,
                           min_new_tokens=8, top_p=None, top_k=None, **kwargs)
        sync(dev)
        row["first_call_s"] = time.perf_counter() - start
        save()
        row["hf_static_s"] = hf_rollout(model, prompts, group, new, **kwargs)
        row["grouped_vs_hf_static"] = row["grouped_s"] / row["hf_static_s"]
    except Exception as error:  # noqa: BLE001 - the row says why it did not run
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
    print(f"hf static+compile P={prefix} new={new}: {row}", flush=True)
    save()


def table(payload: dict) -> str:
    bw = payload["bandwidth"]
    lines = [f"## Decoding at {payload['preset']}'s width, {payload['layers']} layers, {payload['dtype']}, "
             f"{payload['device']} (G={payload['group']}; nominal {bw['nominal_tb_s']:.2f} TB/s, a device copy "
             f"measured {bw['copy_tb_s']:.2f} TB/s)", "", "### One decode step (no sampling) against the bandwidth "
             "limit of the same depth", "",
             markdown_table(payload["steps"], ["prefix", "decode", "graph", "prefill_s", "warmup_s", "step_ms",
                                               "bytes_gb", "limit_nominal_ms", "vs_limit_nominal", "limit_copy_ms",
                                               "vs_limit_copy", "graph_error"],
                            {k: ".3f" for k in ("prefill_s", "warmup_s", "step_ms", "bytes_gb", "limit_nominal_ms",
                                                "vs_limit_nominal", "limit_copy_ms", "vs_limit_copy")}),
             "", "warmup_s: the first 3 steps (the graph's capture; the compiled step's compilation).",
             "", "### Whole rollouts (prefill + sampling every token): grouped engine vs HF generate", "",
             markdown_table(payload["rollouts"], ["prefix", "G", "new_tokens", "grouped_s", "hf_s", "grouped_vs_hf",
                                                  "hf_vs_grouped", "hf_error"],
                            {k: ".3f" for k in ("grouped_s", "hf_s", "grouped_vs_hf", "hf_vs_grouped")})]
    if "hf_static_compiled" in payload:
        row = payload["hf_static_compiled"]
        lines += ["", "### HF generate with a static cache and torch.compile", "",
                  markdown_table([row], ["prefix", "G", "new_tokens", "can_compile_fullgraph", "grouped_s",
                                         "first_call_s", "hf_static_s", "grouped_vs_hf_static", "error"],
                                 {"first_call_s": ".2f", "hf_static_s": ".3f", "grouped_s": ".3f",
                                  "grouped_vs_hf_static": ".3f"}),
                  "", "first_call_s: the first generate call (8 tokens), which compiles; a row without it ran out "
                  "of time compiling."]
    return "\n".join(lines)


def against_limit(row: dict, need: dict, bandwidth: dict) -> dict:
    """``row`` (with its ``step_ms``) and the step's bytes ``need``: the bytes, and the step against the time they
    take at the card's nominal and measured copy bandwidth."""
    row["bytes_gb"] = need["total"] / 1e9
    for key in ("nominal", "copy"):
        speed = bandwidth[f"{key}_tb_s"] * 1e12
        if speed:
            row[f"limit_{key}_ms"] = need["total"] / speed * 1e3
            row[f"vs_limit_{key}"] = row["step_ms"] / row[f"limit_{key}_ms"]
    return row


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/gpu/gpu_decode")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hf-compiled", action="store_true")
    parser.add_argument("--hf-compiled-only", action="store_true")
    args = parser.parse_args(argv)
    run(Path(args.out), args.quick, args.layers, args.hf_compiled, args.hf_compiled_only)


if __name__ == "__main__":
    main()
