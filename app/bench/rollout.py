"""Rollouts for one long video prompt: ours (one prefill, grouped decode) vs HF generate(num_return_sequences=G).

    python -m app.bench.rollout --out outputs/bench/rollout [--quick]

Both sample G completions of exactly `new_tokens` tokens (EOS ignored) from the same prompt; each variant runs in
a fresh process for its own peak memory. Also counted: prompt tokens through the decoder in prefill and video
patches through the vision tower.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from app.bench.common import cli, device, isolated, markdown_table, timed, write_report
from app.models import TinySizes, build_tiny_checkpoint

BENCH_SIZES = TinySizes(hidden=256, layers=2, heads=4, kv_heads=1, head_dim=64, intermediate=704, vision_hidden=64,
                        vision_depth=2, vision_heads=2, max_positions=32768)


def prepare(root: Path, frames: int, side: int) -> tuple[Path, Path]:
    from app.data.video import write_mp4

    checkpoint = root / "tiny-qwen2_5_vl"
    if not (checkpoint / "config.json").exists():
        build_tiny_checkpoint(checkpoint, "qwen2_5_vl", seed=0, sizes=BENCH_SIZES, max_pixels=side * side)
    video = root / f"long_{frames}x{side}.mp4"
    if not video.exists():
        clip = np.random.default_rng(0).integers(0, 255, (frames, side, side, 3), dtype=np.uint8)
        write_mp4(video, clip, fps=8)
    return checkpoint, video


def run_variant(engine: str, checkpoint: str, video: str, *, frames: int, side: int, group: int,
                new_tokens: int) -> dict:
    from app.data.prompts import encode_prompts
    from app.data.video import video_element
    from app.models import load_model, load_processor
    from app.rollout import SamplingConfig, generate_groups

    model, processor = load_model(checkpoint).to(device()), load_processor(checkpoint)
    element = video_element(video, fps=8, max_frames=frames, min_pixels=side * side, max_pixels=side * side)
    conversation = [{"role": "user", "content": [element, {"type": "text", "text": "Describe the video."}]}]
    prompts = {k: v.to(device()) for k, v in encode_prompts(processor, [conversation]).items()}
    patches = []
    model.model.visual.register_forward_hook(lambda m, args, out: patches.append(args[0].shape[0]))
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens, seed=0)
    tokenizer = processor.tokenizer

    if engine == "prompt-only":
        return {"seconds": 0.0, "prefix_tokens": int(prompts["attention_mask"].sum())}

    def ours():
        return generate_groups(model, prompts, group, sampling, tokenizer=tokenizer, eos_ids=[])

    def hf():
        torch.manual_seed(0)
        return model.generate(**prompts, do_sample=True, num_return_sequences=group, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, temperature=1.0, top_p=None, top_k=None)

    fn = ours if engine == "grouped" else hf
    with torch.no_grad():
        seconds = timed(fn, repeats=1, warmup=0)
        result = fn()
    generated = (result.completion_ids.shape if engine == "grouped"
                 else (result.shape[0], result.shape[1] - prompts["input_ids"].shape[1]))
    prefill = prompts["attention_mask"].sum().item() * (1 if engine == "grouped" else group)
    return {"seconds": seconds, "prefix_tokens": int(prompts["attention_mask"].sum()), "prefill_tokens": int(prefill),
            "vision_patches_per_run": sum(patches) // 2, "generated": list(generated)}


def run(out: Path, quick: bool = False) -> dict:
    frames, side, group, new_tokens = (8, 56, 4, 8) if quick else (64, 224, 8, 64)
    checkpoint, video = prepare(out, frames, side)
    kwargs = dict(checkpoint=str(checkpoint), video=str(video), frames=frames, side=side, group=group,
                  new_tokens=new_tokens)
    baseline = isolated("app.bench.rollout:run_variant", engine="prompt-only", **kwargs)
    rows = []
    for engine, label in (("grouped", "ours: one prefill + grouped decode"), ("hf", "HF generate(num_return_sequences)")):
        result = isolated("app.bench.rollout:run_variant", engine=engine, **kwargs)
        rows.append({"variant": label, "seconds": result["seconds"], "peak_mb": result["peak_memory_mb"],
                     "above_prompt_mb": result["peak_memory_mb"] - baseline["peak_memory_mb"],
                     "prefill_tokens": result["prefill_tokens"], "vision_patches": result["vision_patches_per_run"],
                     "completions": f"{result['generated'][0]} x {result['generated'][1]}"})
    for row in rows:
        row["time_vs_hf"] = row["seconds"] / rows[1]["seconds"]
        row["memory_vs_hf"] = row["peak_mb"] / rows[1]["peak_mb"]
    table = markdown_table(rows, ["variant", "seconds", "time_vs_hf", "peak_mb", "memory_vs_hf", "above_prompt_mb",
                                  "prefill_tokens", "vision_patches", "completions"],
                           {"seconds": ".2f", "time_vs_hf": ".3f", "peak_mb": ".0f", "memory_vs_hf": ".3f",
                            "above_prompt_mb": ".0f"})
    table = (f"## Rollout on {device().type}: one video prompt of {baseline['prefix_tokens']} tokens, G={group}, "
             f"{new_tokens} new tokens each\n\n{table}")
    payload = {"prefix_tokens": baseline["prefix_tokens"], "group": group, "new_tokens": new_tokens, "rows": rows,
               "prompt_only_peak_mb": baseline["peak_memory_mb"]}
    write_report(out, "rollout", payload, table)
    return payload


def main(argv: list[str] | None = None) -> None:
    cli(run, __doc__, "outputs/bench/rollout", argv)


if __name__ == "__main__":
    main()
