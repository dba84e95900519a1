"""torch's own varlen flash kernel against the paths it replaces, at real width on one GPU (issue 67's figures).

    python -m app.bench.gpu.varlen --out outputs/gpu/gpu_varlen [--quick]

Qwen2.5-VL-7B's width, random weights made on the GPU, bfloat16:

- **decode**: one decode step at 28 layers, G = 8, prefixes of 8k / 16k / 64k tokens, and a family of k = 6
  questions (48 samples) on a 64k video, captured as a CUDA graph, with the kernel (prefix and video in key chunks
  merged by lse, the own part with ``seqused_k``) and without it (``kernels.varlen_off``: the two-bmm path), each
  against the bandwidth limit (the bytes a step reads over the nominal and the measured copy bandwidth; goal 1.5x,
  then 1.25x);
- **prefill**: the chunked prefill of the 64k prompt (chunks of 4,096) both ways;
- **tower**: one pass of the vision tower (28 blocks) over 64 and 640 frames at 448 x 448, transformers' per-chunk
  SDPA loop (one call per window or frame of every block) against one varlen call per block;
- **train**: one policy forward+backward at 4 of the 7B's layers, 8k and 16k prefixes, G = 8 x 256, the ``flash``
  backend on torch's kernel against ``flex`` (the CUDA default without flash-attn): when the first beats the second;
- **points**: what ``python -m app.bench.planning.calibrate --merge THIS.json`` adds to docs/gpu/points.json (the
  decode steps and the tower passes), from which it refits ``kv_efficiency`` and ``tower_call_ms``.

Every row is written as soon as it is measured. ``--quick`` runs the same code on this CPU at toy sizes, where the
kernel does not run (the rows say so): it tries the script, not the kernel.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from app.bench.common import device, markdown_table, write_report
from app.bench.gpu.decode import against_limit, build, copy_bandwidth, nominal_bandwidth, prompt_of, step_bytes, sync

PRESET, LAYERS, PREFIXES, GROUP, QUESTIONS, STEPS = "qwen2_5_vl_7b", 28, (8192, 16384, 65536), 8, 6, 32
TOWER_FRAMES, SIDE, CHUNK = (64, 640), 448, 4096


def kernel_state(dev, dtype) -> str:
    from app.grouping.kernels import varlen_unusable

    return varlen_unusable(dev, dtype, 128) or "torch's varlen flash kernel"


@torch.no_grad()
def decode_step(model, prompts: dict, group, steps: int, *, families=None, kernel: bool) -> dict:
    """The prefill (chunked) and ms per captured decode step (3 steps first), with or without the kernel."""
    from app.grouping import GroupedDecoder
    from app.grouping.kernels import varlen_off

    dev = prompts["input_ids"].device
    switch = varlen_off() if not kernel else _Nothing()
    with switch:
        sync(dev)
        start = time.perf_counter()
        sizes = [group] * prompts["input_ids"].shape[0]
        decoder = GroupedDecoder(model, prompts, sizes, steps + 3, decode="graph" if dev.type == "cuda" else "static",
                                 prefill_chunk_size=CHUNK, families=families)
        sync(dev)
        prefill = time.perf_counter() - start
        count = len(decoder.logits)
        tokens = torch.full((count,), 1000, dtype=torch.long, device=dev)
        try:
            for _ in range(3):
                decoder.step(tokens)
            sync(dev)
            start = time.perf_counter()
            for _ in range(steps):
                decoder.step(tokens)
            sync(dev)
            per_step = (time.perf_counter() - start) / steps
            return {"prefill_s": prefill, "step_ms": per_step * 1e3, "samples": count,
                    "graph": decoder.graph is not None, "graph_error": decoder.graph_error or "",
                    "varlen": decoder.cache.varlen is not None}
        finally:
            decoder.close()


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def family_prompts(prefix: int, questions: int, dev) -> tuple[dict, list[int]]:
    """k prompts sharing their first ``prefix - 64`` tokens (the video), each with 64 tokens of its own."""
    base = prompt_of(prefix, dev)["input_ids"]
    generator = torch.Generator().manual_seed(7)
    own = torch.randint(1000, 100000, (questions, 64), generator=generator).to(dev)
    ids = torch.cat([base[:, : prefix - 64].expand(questions, -1), own], dim=1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}, \
        [questions]


@torch.no_grad()
def tower_pass(preset: str, frames: int, dtype, dev, *, quick: bool) -> list[dict]:
    """One pass of the tower over ``frames`` frames, per-chunk loop (sdpa) against one varlen call per block."""
    from app.grouping.vision.attention import TOWER_ATTENTION, register_tower_attention
    from app.planning import costs, shapes
    from app.planning.timing import tower_calls

    blocks = 2 if quick else 28
    config = shapes.hf_config(preset, layers=1, vision_layers=blocks, narrow=quick)  # --quick: the decoder narrowed
    with torch.device(dev):
        model = shapes.random_model(config, dtype)
    visual = model.model.visual.eval()
    side = 56 if quick else SIDE
    patch, merge = config.vision_config.patch_size, config.vision_config.spatial_merge_size
    temporal = frames // 2
    grid = torch.tensor([[temporal, side // patch, side // patch]], device=dev)
    pixels = torch.randn(int(grid.prod()), 3 * 2 * patch * patch, device=dev, dtype=dtype)
    shape = costs.shape_of(config)
    work = costs.Workload(prefix=1, completion=0, group_size=1, patches=int(grid.prod()), temporal=temporal,
                          visual=int(grid.prod()) // merge**2)
    register_tower_attention()
    rows = []
    for name in (TOWER_ATTENTION, "sdpa"):
        model.set_attn_implementation({"vision_config": name})
        visual(pixels[: grid[0, 1] * grid[0, 2] * 2], grid_thw=torch.tensor([[2, *grid[0, 1:].tolist()]], device=dev))
        sync(dev)
        start = time.perf_counter()
        visual(pixels, grid_thw=grid)
        sync(dev)
        rows.append({"frames": frames, "attention": name, "blocks": blocks, "seconds": time.perf_counter() - start,
                     "calls": tower_calls(shape, work, name)})
        print(f"tower {frames} frames {name}: {rows[-1]}", flush=True)
        if name == "sdpa" or rows[-1]["seconds"] > 60:
            break
    del model
    return rows


def run(out: Path, quick: bool = False) -> dict:
    dev = device()
    if quick:
        preset, layers, prefixes, group, questions, steps = "qwen2_5_vl_3b", 1, (64, 160), 2, 2, 4
        dtype, frames = torch.float32, (4,)
    else:
        preset, layers, prefixes, group, questions, steps = PRESET, LAYERS, PREFIXES, GROUP, QUESTIONS, STEPS
        dtype, frames = torch.bfloat16, TOWER_FRAMES
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    bandwidth = {"nominal_tb_s": (nominal_bandwidth(name) or 0) / 1e12,
                 "copy_tb_s": copy_bandwidth(dev) / 1e12 if dev.type == "cuda" else 0.0}
    payload = {"preset": preset + (" narrowed" if quick else ""), "layers": layers, "dtype": str(dtype),
               "group": group, "device": name,
               "torch": torch.__version__, "kernel": kernel_state(dev, dtype), "bandwidth": bandwidth,
               "decode": [], "tower": []}

    def save():
        payload["points"] = points_of(payload)
        write_report(out, "gpu_varlen", payload, table(payload), quiet=True)

    start = time.perf_counter()
    model = build(preset, layers, dtype, dev, narrow=quick)  # --quick: the layout at a toy width
    print(f"{preset} x{layers} layers built in {time.perf_counter() - start:.1f} s; kernel: {payload['kernel']}",
          flush=True)
    cases = [(p, None) for p in prefixes] + [(prefixes[-1], questions)]
    for prefix, k in cases:
        prompts, families = (prompt_of(prefix, dev), None) if k is None else family_prompts(prefix, k, dev)
        need = step_bytes(model, prefix if k is None else prefix + 64 * (k - 1), group * (k or 1), steps + 3)
        for kernel in (True, False):
            row = against_limit({"prefix": prefix, "questions": k or 1, "kernel": kernel,
                                 **decode_step(model, prompts, group, steps, families=families, kernel=kernel)},
                                need, bandwidth)
            payload["decode"].append(row)
            print(f"decode {row}", flush=True)
            save()
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    for count in frames:
        payload["tower"] += tower_pass(preset, count, dtype, dev, quick=quick)
        save()
    payload["train"] = train_points(preset, dtype, dev, quick=quick)
    write_report(out, "gpu_varlen", payload, table(payload))
    return payload


def train_points(preset: str, dtype, dev, *, quick: bool) -> list[dict]:
    """One policy forward+backward, ``flash`` (torch's varlen kernel, no package) against ``flex``."""
    from app.bench.gpu.real_shape import build as build_train
    from app.bench.gpu.real_shape import inputs, pass_once
    from app.grouping.attention import flash_available

    if not flash_available(dev) or dev.type != "cuda":
        return [{"backend": "flash", "error": f"torch's varlen kernel does not run here ({kernel_state(dev, dtype)})"}]
    model, _ = build_train(preset, 1 if quick else 4, dtype, dev)
    rows = []
    for prefix in ((96,) if quick else (8192, 16384)):
        prompts, completions, mask = inputs(prefix, GROUP, 256 if not quick else 8, dev)
        for backend in ("flex", "flash"):
            row = {"prefix": prefix, "backend": backend}
            try:
                pass_once(model, prompts, completions, mask, GROUP, mode="grouped", backend=backend)
                sync(dev)
                start = time.perf_counter()
                pass_once(model, prompts, completions, mask, GROUP, mode="grouped", backend=backend)
                sync(dev)
                row["seconds"] = time.perf_counter() - start
            except Exception as error:  # noqa: BLE001 - the row says why
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
            model.zero_grad(set_to_none=True)
            rows.append(row)
            print(f"train {row}", flush=True)
    by = {(r["prefix"], r["backend"]): r for r in rows}
    for r in rows:
        flex = by.get((r["prefix"], "flex"), {})
        if r["backend"] == "flash" and r.get("seconds") and flex.get("seconds"):
            r["vs_flex"] = r["seconds"] / flex["seconds"]
    return rows


def points_of(payload: dict) -> dict:
    """What docs/gpu/points.json takes from this run (``calibrate --merge``): the decode steps with and without the
    kernel, and each tower pass with its attention calls."""
    steps = [{"prefix": r["prefix"], "questions": r["questions"], "mode": "varlen" if r["kernel"] else "graph",
              "step_ms": r["step_ms"], "bytes_gb": r["bytes_gb"]} for r in payload["decode"] if r.get("varlen", True)
             or not r["kernel"]]
    return {"card": payload["device"], "torch": payload["torch"], "kernel": payload["kernel"],
            "layers": payload["layers"], "decode_steps": steps,
            "tower_passes": [{k: r[k] for k in ("frames", "attention", "blocks", "seconds", "calls")}
                             for r in payload["tower"]]}


def table(payload: dict) -> str:
    bw = payload["bandwidth"]
    return "\n".join([
        f"## torch's varlen flash kernel at {payload['preset']}'s width, {payload['device']}, torch {payload['torch']}"
        f" ({payload['kernel']}; nominal {bw['nominal_tb_s']:.2f} TB/s, a copy {bw['copy_tb_s']:.2f} TB/s)", "",
        f"### One decode step, {payload['layers']} layers, G = {payload['group']}: with the kernel and without it "
        "(the two-bmm path)", "",
        markdown_table(payload["decode"], ["prefix", "questions", "samples", "kernel", "varlen", "graph", "prefill_s",
                                           "step_ms", "bytes_gb", "limit_nominal_ms", "vs_limit_nominal",
                                           "vs_limit_copy", "graph_error"],
                       {k: ".3f" for k in ("prefill_s", "step_ms", "bytes_gb", "limit_nominal_ms", "vs_limit_nominal",
                                           "vs_limit_copy")}),
        "", "prefill_s: the chunked prefill (chunks of 4,096) with / without the kernel.", "",
        "### One tower pass: one varlen call per block against the per-chunk SDPA loop", "",
        markdown_table(payload["tower"], ["frames", "attention", "blocks", "calls", "seconds"],
                       {"seconds": ".3f", "calls": ".0f"}), "",
        "### One policy forward+backward: the flash backend on torch's kernel against flex", "",
        markdown_table(payload.get("train", []), ["prefix", "backend", "seconds", "vs_flex", "error"],
                       {"seconds": ".3f", "vs_flex": ".3f"})])


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/gpu/gpu_varlen")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    run(Path(args.out), args.quick)


if __name__ == "__main__":
    main()
