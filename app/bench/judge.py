"""The model judge's time per group: one grouped forward ([P; R1..RG], the video once) against G separate forwards
([P; Ri] each, the video G times), at a ~2k-token video context and G = 8.

    python -m app.bench.judge --out outputs/bench/judge [--quick]

The judge is a tiny Qwen2.5-VL of the real class (hidden 256, 2 layers, a 2-block tower) with Qwen's tokenizer and
vocabulary; the context is a generated video (64 frames at 224x224: about 2k prompt tokens), each completion ~64
tokens of text. Both paths give the same probabilities (checked here; the suite asserts 1e-5). Median of 3 trials
after a warm-up, fp32, this machine's threads.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch

from app.bench.common import cli, markdown_table, write_report
from app.runtime.models import TinySizes

SIZES = TinySizes(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=512, vision_hidden=64,
                  vision_depth=2, vision_heads=2)


def setup(out: Path, frames: int, side: int, group: int, words: int):
    from app.config.sections import DataConfig
    from app.data.video import write_mp4
    from app.rewards.judge import GroupedJudge
    from app.runtime.models import build_tiny_checkpoint, load_model, load_processor

    checkpoint = build_tiny_checkpoint(out / "judge", "qwen2_5_vl", seed=0, sizes=SIZES, real_tokenizer=True,
                                       max_pixels=side * side)
    rng = np.random.default_rng(0)
    write_mp4(out / "clip.mp4", rng.integers(0, 255, (frames, side, side, 3), dtype=np.uint8), fps=8)
    data = DataConfig(fps=8, max_frames=frames, min_pixels=side * side, max_pixels=side * side,
                      max_prompt_length=65536, prompt_template="video_r1")
    judge = GroupedJudge(load_model(checkpoint), load_processor(checkpoint), data, out)
    record = {"problem": "Which colour appears first?", "problem_type": "multiple choice", "data_type": "video",
              "options": ["A. red", "B. green", "C. blue", "D. yellow"], "path": "clip.mp4",
              "solution": "<answer>B</answer>"}
    vocabulary = "the red square moves left then a green one appears so the answer is".split()
    completions = [f"<think>{' '.join(rng.choice(vocabulary, words))}</think><answer>{'ABCD'[i % 4]}</answer>"
                   for i in range(group)]
    return judge, record, completions


def run(out: Path, quick: bool = False) -> dict:
    frames, side, group, words, trials = (8, 56, 4, 8, 1) if quick else (64, 224, 8, 40, 3)
    judge, record, completions = setup(out, frames, side, group, words)
    prompts = judge.prompt(record)
    reference = "B"
    timings, results = {}, {}
    ways = {"grouped": lambda: judge.group_scores(prompts, completions, reference),
            "separate": lambda: [judge.group_scores(prompts, [c], reference)[0] for c in completions]}
    for mode, once in ways.items():
        results[mode] = once()  # warm-up
        seconds = []
        for _ in range(trials):
            start = time.perf_counter()
            once()
            seconds.append(time.perf_counter() - start)
        timings[mode] = statistics.median(seconds)
    worst = max(abs(a - b) for a, b in zip(results["grouped"], results["separate"]))
    row = {"prompt_tokens": int(prompts["attention_mask"].sum()), "G": group,
           "completion_tokens": sum(len(judge.response_ids(c, reference)) for c in completions) // group,
           "grouped_s": timings["grouped"], "separate_s": timings["separate"],
           "grouped_over_separate": timings["grouped"] / timings["separate"], "max_probability_difference": worst}
    table = ("## The judge's time per group: one grouped forward vs G separate forwards (fp32, CPU)\n\n"
             + markdown_table([row], list(row), {"grouped_s": ".3f", "separate_s": ".3f",
                                                 "grouped_over_separate": ".3f", "max_probability_difference": ".1e"}))
    payload = {"frames": frames, "side": side, "sizes": SIZES.__dict__, "threads": torch.get_num_threads(),
               "rows": [row]}
    write_report(out, "judge", payload, table)
    return payload


def main(argv: list[str] | None = None) -> None:
    cli(run, __doc__, "outputs/bench/judge", argv)


if __name__ == "__main__":
    main()
