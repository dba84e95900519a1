"""The planner against the allocator: planned and measured memory (and FLOPs) of passes the formulas were not fitted on.

    python -m app.bench.planning.accuracy --out docs/bench/planner_accuracy [--quick]

Real transformers classes at real widths (Qwen2-VL-2B to Qwen3-VL-8B), cut to 1-2 decoder layers or 2-5 tower blocks,
float32 on this CPU, random weights, each point in a fresh process. The meter is the allocator's own peak above what
was held before the pass (``app.bench.measure.allocator_peak``: the profiler's record of every CPU allocation; on CUDA
``max_memory_allocated``), gradient buffers allocated beforehand as ZeRO's are. FLOPs by ``torch.utils.flop_counter``
in a separate pass. What the planner predicts is what ``scripts/plan.sh`` adds up: ``costs.training_activations`` for
the policy's forward+backward as the trainer runs it (``completion_logprobs``, the chunked head, entropy on),
``costs.vision_activations`` for a tower trained (with or without activation checkpointing) or frozen, and both for
one video prompt whose tower trains under checkpointing. tests/test_planner_accuracy.py asserts the same points
(memory within 15%, FLOPs within 5%); this script prints them as a table and a plot.

The video point is issue 47's proof: a budget between what the planner said before 2ce49cb (every tower block's saved
tensors, checkpointing ignored) and what it says now; the measured pass stays within it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from app.bench.common import attempt, cli, exit_if_failed, failed_points, markdown_table, write_report

# (preset, decoder layers, prefix, G, completion, layout, activation checkpointing, LoRA)
LANGUAGE = [
    ("qwen2_vl_2b", 1, 512, 8, 64, "grouped", False, False),
    ("qwen3_vl_4b", 1, 1024, 4, 48, "repeated", True, False),
    ("qwen2_5_vl_7b", 1, 768, 8, 32, "grouped", False, True),
    ("qwen3_vl_8b", 1, 512, 4, 64, "grouped", True, True),
    ("qwen2_5_vl_3b", 2, 1536, 6, 40, "repeated", False, False),
    ("qwen3_vl_2b", 2, 2048, 8, 24, "grouped", True, False),
]
# (preset, tower blocks, patches, activation checkpointing): other depths and sizes than the formulas' fit
TOWERS = [
    ("qwen2_5_vl_3b", 4, 2560, True), ("qwen3_vl_4b", 2, 1024, False), ("qwen2_vl_7b", 2, 1536, True),
    ("qwen3_vl_8b", 4, 768, True), ("qwen3_vl_4b", 5, 3072, True), ("qwen2_5_vl_32b", 2, 640, False),
]
FROZEN = [("qwen3_vl_8b", 2, 1024), ("qwen2_5_vl_7b", 4, 2048)]  # (preset, tower blocks, patches)
VIDEO = {"preset": "qwen2_vl_2b", "blocks": 8, "temporal": 32, "group": 2, "completion": 16}
QUICK = {"language": [("qwen3_vl_2b", 1, 128, 2, 16, "grouped", True, False)],
         "towers": [("qwen3_vl_2b", 2, 256, True)], "frozen": [("qwen2_vl_2b", 1, 256)],
         "video": {"preset": "qwen2_vl_2b", "blocks": 2, "temporal": 4, "group": 2, "completion": 8}}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(preset: str, layers: int, vision_layers: int = 1, *, lora: bool = False, checkpointing: bool = False):
    """The real class of ``preset`` at full width and the given depth, float32, random weights, in training mode."""
    from app.planning import shapes
    from app.runtime.models import enable_activation_checkpointing

    config = shapes.hf_config(preset, layers=layers, vision_layers=vision_layers)
    torch.manual_seed(0)
    model = shapes.random_model(config).train()
    if lora:
        from app.runtime import lora as adapters

        adapters.apply(model, SimpleNamespace(rank=16, alpha=32, dropout=0.0, vision_tower=False, projector=False,
                                              target_modules=LORA_TARGETS))
    if checkpointing:
        enable_activation_checkpointing(model)
    return model, config


def tower(preset: str, blocks: int, *, checkpointing: bool = False):
    """The vision tower of ``preset`` alone (its own class, ``blocks`` blocks), float32, random weights, training
    mode: the tower points measure nothing else, so the language model is not built."""
    from app.planning import shapes
    from app.runtime.models import enable_activation_checkpointing

    config = shapes.hf_config(preset, layers=1, vision_layers=blocks)
    torch.manual_seed(0)
    visual = shapes.random_tower(config).train()
    if checkpointing:
        enable_activation_checkpointing(visual)
    return visual, config


def language_point(preset: str, layers: int, prefix: int, group: int, completion: int, mode: str, *,
                   checkpointing: bool, lora: bool) -> dict:
    """The policy's forward+backward over a text prompt, planned and measured."""
    from app.bench.measure import forward_backward
    from app.planning import costs, flops

    model, config = build(preset, layers, lora=lora, checkpointing=checkpointing)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 100000, (1, prefix), generator=generator)
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}
    completions = torch.randint(1000, 100000, (group, completion), generator=generator)
    backend = "repeated" if mode == "repeated" else "split"
    measured = forward_backward(model, prompts, completions, torch.ones_like(completions), group, mode=mode,
                                backend=None if mode == "repeated" else "split", flops=not lora)  # LoRA: none read
    shape, work = costs.shape_of(config), costs.Workload(prefix=prefix, completion=completion, group_size=group)
    planned = costs.training_activations(shape, work, backend=backend, dtype_bytes=4, checkpointing=checkpointing,
                                         chunk=1024, trains_head=not lora)["peak"]
    counted = flops.train_flops(shape, work, backend, checkpointing=checkpointing, chunk=1024)["total"]
    return {"planned": planned, "measured": measured["peak"],
            # LoRA's adapters add their own small matmuls, which the planner leaves out
            "planned_flops": None if lora else counted, "measured_flops": None if lora else measured["flops"]}


def tower_inputs(config, patches: int, side: int = 8):
    """``patches`` patches of a video ``side`` x ``side`` patches wide, at the tower's input width."""
    vision = config.vision_config
    temporal = patches // (side * side)
    pixels = torch.randn(temporal * side * side, 3 * vision.temporal_patch_size * vision.patch_size**2,
                         generator=torch.Generator().manual_seed(0))
    return pixels, torch.tensor([[temporal, side, side]]), temporal


def tower_loss(output) -> torch.Tensor:
    """What reaches the language model: the merged output, and Qwen3-VL's deepstack features."""
    loss = output.pooler_output.float().sum()
    for extra in getattr(output, "deepstack_features", None) or []:
        loss = loss + extra.float().sum()
    return loss


def tower_point(preset: str, blocks: int, patches: int, checkpointing: bool) -> dict:
    """The vision tower trained: forward and backward of what it hands the language model, planned and measured."""
    from torch.utils.flop_counter import FlopCounterMode

    from app.bench.measure import allocator_peak, cpu_attention_flops
    from app.planning import costs, flops

    visual, config = tower(preset, blocks, checkpointing=checkpointing)
    for p in visual.parameters():
        p.grad = torch.zeros_like(p)
    pixels, grid, temporal = tower_inputs(config, patches)
    _, peak = allocator_peak(lambda: tower_loss(visual(pixels, grid_thw=grid)).backward())
    counter = FlopCounterMode(display=False, custom_mapping=cpu_attention_flops())
    with counter:
        tower_loss(visual(pixels, grid_thw=grid)).backward()
    shape = costs.shape_of(config)
    return {"planned": costs.vision_activations(shape, patches, training=True, chunk_patches=0, dtype_bytes=4,
                                                checkpointing=checkpointing),
            "measured": peak, "measured_flops": counter.get_total_flops(),
            "planned_flops": flops.vision_flops(shape, patches, temporal, training=True, checkpointing=checkpointing)}


def frozen_point(preset: str, blocks: int, patches: int) -> dict:
    """The vision tower frozen: one forward without gradients, planned and measured."""
    from torch.utils.flop_counter import FlopCounterMode

    from app.bench.measure import allocator_peak, cpu_attention_flops
    from app.planning import costs, flops

    visual, config = tower(preset, blocks)
    visual.eval()
    pixels, grid, temporal = tower_inputs(config, patches)
    with torch.no_grad():
        _, peak = allocator_peak(lambda: visual(pixels, grid_thw=grid))
        counter = FlopCounterMode(display=False, custom_mapping=cpu_attention_flops())
        with counter:
            visual(pixels, grid_thw=grid)
    shape = costs.shape_of(config)
    return {"planned": costs.vision_activations(shape, patches, training=False, chunk_patches=0, dtype_bytes=4),
            "measured": peak, "planned_flops": flops.vision_flops(shape, patches, temporal),
            "measured_flops": counter.get_total_flops()}


def video_prompt(config, temporal: int, side: int = 16, text: int = 24) -> dict:
    """One video prompt as the processor makes it: text, <vision_start>, one placeholder per merged token,
    <vision_end>, text; ``temporal`` x ``side`` x ``side`` patches at the tower's input width."""
    vision = config.vision_config
    visual = temporal * side * side // vision.spatial_merge_size**2
    generator = torch.Generator().manual_seed(0)
    words = torch.randint(1000, 100000, (text,), generator=generator)
    ids = torch.cat([words[: text // 2], torch.tensor([config.vision_start_token_id]),
                     torch.full((visual,), config.video_token_id), torch.tensor([config.vision_end_token_id]),
                     words[text // 2:]])[None]
    pixels = torch.randn(temporal * side * side, 3 * vision.temporal_patch_size * vision.patch_size**2,
                         generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": (ids == config.video_token_id).long() * 2,  # the processor's: 2 marks video
            "pixel_values_videos": pixels, "video_grid_thw": torch.tensor([[temporal, side, side]])}


def video_point(preset: str, blocks: int, temporal: int, group: int, completion: int) -> dict:
    """A video prompt through the whole policy pass (tower trained under checkpointing, language model, head,
    entropy), measured; planned as the planner puts it together now (``planned``: ``pass_with_trained_tower``) and
    before 2ce49cb (``planned_old``: the tower's blocks counted as if checkpointing were off, and the tower's peak
    added to the language model's); ``budget`` halfway between the two."""
    from app.bench.measure import forward_backward
    from app.planning import costs

    model, config = build(preset, 1, blocks, checkpointing=True)
    prompts = video_prompt(config, temporal)
    completions = torch.randint(1000, 100000, (group, completion), generator=torch.Generator().manual_seed(1))
    measured = forward_backward(model, prompts, completions, torch.ones_like(completions), group, backend="split",
                                flops=False)["peak"]
    shape = costs.shape_of(config)
    patches = int(prompts["video_grid_thw"].prod())
    work = costs.Workload(prefix=prompts["input_ids"].shape[1], completion=completion, group_size=group)
    language = costs.training_activations(shape, work, backend="split", dtype_bytes=4, checkpointing=True,
                                          chunk=1024, trains_head=True)["peak"]
    tower = {old: costs.vision_activations(shape, patches, training=True, chunk_patches=0, dtype_bytes=4,
                                           checkpointing=not old) for old in (False, True)}
    held = costs.vision_held(shape, patches, checkpointing=True, dtype_bytes=4)
    new = costs.pass_with_trained_tower(shape, language, tower[False], held, trains_head=True, dtype_bytes=4)
    old = language + tower[True]  # the planner before 2ce49cb added the two peaks
    return {"planned": new, "planned_old": old, "budget": (new + old) / 2, "measured": measured,
            "frames": temporal * config.vision_config.temporal_patch_size, "patches": patches,
            "tower_planned": tower[False], "tower_planned_old": tower[True]}


def run(out: Path, quick: bool = False) -> dict:
    cases = QUICK if quick else {"language": LANGUAGE, "towers": TOWERS, "frozen": FROZEN, "video": VIDEO}
    rows = []
    points = ([("language", f"{p} x{n} {mode} P={pre} G={g} C={c}" + " ckpt" * ck + " LoRA" * lo,
                "app.bench.planning.accuracy:language_point",
                dict(preset=p, layers=n, prefix=pre, group=g, completion=c, mode=mode, checkpointing=ck, lora=lo))
               for p, n, pre, g, c, mode, ck, lo in cases["language"]]
              + [("tower trained", f"{p} {b} blocks, {n} patches" + " ckpt" * ck,
                  "app.bench.planning.accuracy:tower_point", dict(preset=p, blocks=b, patches=n, checkpointing=ck))
                 for p, b, n, ck in cases["towers"]]
              + [("tower frozen", f"{p} {b} blocks, {n} patches", "app.bench.planning.accuracy:frozen_point",
                  dict(preset=p, blocks=b, patches=n)) for p, b, n in cases["frozen"]])
    v = cases["video"]
    points.append(("video, whole pass", f"{v['preset']} x1, {v['blocks']} tower blocks ckpt, "
                   f"{2 * v['temporal']} frames, G={v['group']} C={v['completion']}",
                   "app.bench.planning.accuracy:video_point", v))
    for part, what, target, kwargs in points:
        result = attempt(target, **kwargs)
        if "error" in result:  # kept as a row that says why; the other points still run
            row = {"part": part, "point": what, "error": result["error"]}
            print(f"{part}: {what}: FAILED: {result['error']}", flush=True)
        else:
            row = {"part": part, "point": what, "planned_mb": result["planned"] / 2**20,
                   "measured_mb": result["measured"] / 2**20, "memory_ratio": result["planned"] / result["measured"]}
            if result.get("planned_flops"):
                row["flop_ratio"] = result["planned_flops"] / result["measured_flops"]
            if "planned_old" in result:
                row |= {"planned_old_mb": result["planned_old"] / 2**20, "budget_mb": result["budget"] / 2**20,
                        "fits_budget": result["measured"] <= result["budget"]}
            print(f"{part}: {what}: planned {row['planned_mb']:.0f} MB, measured {row['measured_mb']:.0f} MB "
                  f"({row['memory_ratio']:.3f})", flush=True)
        rows.append(row)
        report(out, rows, quiet=True)  # a point at a time, so a run cut short keeps what it measured
    payload = report(out, rows)
    measured = [r for r in rows if "error" not in r]
    if measured:
        plot(measured, out / "planner_accuracy.png")
    exit_if_failed(len(rows) - len(measured), len(rows), out)
    return payload


def report(out: Path, rows: list[dict], quiet: bool = False) -> dict:
    """planner_accuracy.json/.md for the rows so far: the summary over the points measured, the failed ones listed."""
    measured = [r for r in rows if "error" not in r]
    memory = [r["memory_ratio"] for r in measured]
    flops = [r["flop_ratio"] for r in measured if "flop_ratio" in r]
    summary = {"memory_ratio_min": min(memory, default=None), "memory_ratio_max": max(memory, default=None),
               "flop_ratio_min": min(flops, default=None), "flop_ratio_max": max(flops, default=None),
               "within_15_percent": sum(abs(m - 1) <= 0.15 for m in memory), "points": len(measured),
               "failed": len(rows) - len(measured)}
    table = ("## The planner against the allocator (float32, CPU, real widths at reduced depth)\n\n"
             + markdown_table(rows, ["part", "point", "planned_mb", "measured_mb", "memory_ratio", "flop_ratio"],
                              {"planned_mb": ".1f", "measured_mb": ".1f", "memory_ratio": ".3f", "flop_ratio": ".4f"}))
    if memory:
        table += (f"\n\nmemory planned/measured {min(memory):.3f}-{max(memory):.3f} "
                  f"({summary['within_15_percent']} of {summary['points']} within 15%)")
    if flops:
        table += f"; FLOPs {min(flops):.4f}-{max(flops):.4f}."
    video = next((r for r in measured if r["part"] == "video, whole pass"), None)
    if video:
        table += (f"\n\nVideo point: planned now {video['planned_mb']:.0f} MB, before 2ce49cb "
                  f"{video['planned_old_mb']:.0f} MB; a budget of {video['budget_mb']:.0f} MB refused by the old plan, "
                  f"accepted by the new; measured {video['measured_mb']:.0f} MB: "
                  f"{'within' if video['fits_budget'] else 'OVER'} the budget.")
    table += failed_points([f"- {r['part']}: {r['point']}: {r['error']}" for r in rows if "error" in r])
    payload = {"rows": rows, "summary": summary}
    write_report(out, "planner_accuracy", payload, table, quiet=quiet)
    return payload


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    for part, marker in (("language", "o"), ("tower trained", "s"), ("tower frozen", "^"),
                         ("video, whole pass", "D")):
        chosen = [r for r in rows if r["part"] == part]
        ax.scatter([r["measured_mb"] for r in chosen], [r["planned_mb"] for r in chosen], marker=marker, label=part)
    top = max(max(r["measured_mb"], r["planned_mb"]) for r in rows) * 1.1
    ax.plot([1, top], [1, top], color="grey", linewidth=0.8)
    ax.plot([1, top], [1.15, 1.15 * top], color="grey", linewidth=0.5, linestyle="--")
    ax.plot([1, top], [0.85, 0.85 * top], color="grey", linewidth=0.5, linestyle="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured peak (MB, the allocator's)")
    ax.set_ylabel("planned peak (MB)")
    ax.set_title("planner vs allocator (dashed: +/-15%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    cli(run, __doc__, "outputs/bench/planner_accuracy", argv)


if __name__ == "__main__":
    main()
