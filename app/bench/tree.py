"""Prefix trees: tokens computed and time of one training forward + backward for a multi-turn group of rollouts,
three ways, at a ~2k-token video prompt, 2 turns, branching [4, 2] (G = 8), observations of 8 frames.

    python -m app.bench.tree --out outputs/bench/tree [--quick]

- ``tree``: the group packed as a prefix tree (``app.grouping.tree.layout``): P once, each first turn (a tool call and
  its 8-frame observation) once, each second turn once;
- ``flat``: multi-turn grouping without tree sharing: P once, each of the 8 rollouts [turn 1; observation; turn 2]
  as its own response (first turns and their clips 2 times each);
- ``paths``: the repeated layout: each rollout as its own row [P; path] (P and its video 8 times).

All three give the same log-probs (checked here; tests/test_tree.py asserts 1e-5 and every gradient). The model is
a tiny Qwen2.5-VL of the real class (hidden 256, 2 layers, a 2-block tower) with Qwen's tokenizer and vocabulary,
fp32 on this machine's CPU threads; median of 3 trials after a warm-up. Tree attention is the default ``masked``
(one call under the dense tree mask); ``tree_split`` times the ``split`` backend beside it (no [T, T] mask).
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
BRANCHING = (4, 2)


def build(out: Path, frames: int, clip_frames: int, side: int, words: int):
    from app.config.sections import DataConfig
    from app.data.prompts import encode_observation, encode_prompts
    from app.data.records import build_conversation
    from app.data.video import video_element, write_mp4
    from app.grouping.tree.layout import PrefixTree, TreeNode
    from app.runtime.models import build_tiny_checkpoint, load_model, load_processor

    checkpoint = build_tiny_checkpoint(out / "model", "qwen2_5_vl", seed=0, sizes=SIZES, real_tokenizer=True,
                                       max_pixels=side * side)
    rng = np.random.default_rng(0)
    write_mp4(out / "video.mp4", rng.integers(0, 255, (frames, side, side, 3), dtype=np.uint8), fps=8)
    processor = load_processor(checkpoint)
    tokenizer = processor.tokenizer
    data = DataConfig(fps=8, max_frames=frames, min_pixels=side * side, max_pixels=side * side,
                      max_prompt_length=65536, prompt_template="video_r1")
    record = {"problem": "What digit is shown in the corner?", "problem_type": "numerical", "data_type": "video",
              "path": "video.mp4", "solution": "<answer>7</answer>"}
    prompt = encode_prompts(processor, [build_conversation(record, out, data)])
    vocabulary = "the digit appears near the end so look closer at that window then read it".split()

    def text(n, seed):
        words_ = np.random.default_rng(seed).choice(vocabulary, n)
        return tokenizer.encode(" ".join(words_), add_special_tokens=False, return_tensors="pt")[0]

    def model_turn(parent, seed, observation=None):
        ids = text(words, seed)
        if observation is None:
            return TreeNode(parent, ids, torch.ones(len(ids), dtype=torch.bool), torch.zeros_like(ids))
        seen = observation["input_ids"][0]
        vision = {k: v for k, v in observation.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        return TreeNode(parent, torch.cat([ids, seen]),
                        torch.cat([torch.ones(len(ids), dtype=torch.bool), torch.zeros(len(seen), dtype=torch.bool)]),
                        torch.cat([torch.zeros_like(ids), observation["mm_token_type_ids"][0]]), vision)

    nodes = []
    for i in range(BRANCHING[0]):  # turn 1: a tool call, then its observation: an 8-frame clip of the video
        start = i * frames / 8 / BRANCHING[0]
        clip = video_element(out / "video.mp4", fps=8, max_frames=clip_frames, min_pixels=side * side,
                             max_pixels=side * side)
        clip.update(video_start=start, video_end=start + clip_frames / 8)
        nodes.append(model_turn(-1, seed=i, observation=encode_observation(processor, [clip])))
    first = list(range(len(nodes)))
    for parent in first:  # turn 2: the answer, BRANCHING[1] of them per first turn
        for j in range(BRANCHING[1]):
            nodes.append(model_turn(parent, seed=100 + 10 * parent + j))
    tree = PrefixTree(prompt, nodes)
    flat = PrefixTree(prompt, [TreeNode(-1, tree.path_tokens(p), tree.path_tokens(p, "trained").bool(),
                                        tree.path_tokens(p, "mm_token_type_ids"), _path_vision(tree, p))
                                for p in tree.paths])
    return load_model(checkpoint), tree, flat


def _path_vision(tree, path) -> dict:
    """The vision tensors of a path's nodes only (P's are the flat tree's prompt's)."""
    out = {}
    for key in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "pixel_values", "image_grid_thw"):
        parts = [tree.nodes[n].vision[key] for n in path if tree.nodes[n].vision.get(key) is not None]
        if parts:
            out[key] = torch.cat(parts)
    return out


def tokens_computed(tree, mode: str) -> int:
    if mode == "paths":
        return sum(tree.prompt_len + sum(tree.lengths[n] for n in p) for p in tree.paths)
    return tree.total_len


def run(out: Path, quick: bool = False) -> dict:
    import tempfile

    frames, clip_frames, side, words, trials = (8, 4, 56, 6, 1) if quick else (64, 8, 224, 48, 3)
    with tempfile.TemporaryDirectory() as scratch:  # the checkpoint and the video: not beside the report
        model, tree, flat = build(Path(scratch), frames, clip_frames, side, words)
        return measure(out, model, tree, flat, trials, (frames, clip_frames, side))


def measure(out: Path, model, tree, flat, trials: int, sizes: tuple[int, int, int]) -> dict:
    from app.grouping.tree.forward import tree_logprobs

    frames, clip_frames, side = sizes
    ways = {"tree": (tree, "tree", "masked"), "tree_split": (tree, "tree", "split"), "flat": (flat, "tree", "masked"),
            "paths": (tree, "paths", None)}
    timings, results = {}, {}
    for name, (layout, mode, backend) in ways.items():
        def once(layout=layout, mode=mode, backend=backend):
            model.zero_grad(set_to_none=True)
            scores = tree_logprobs(model, layout, mode, backend=backend)
            (scores.logprobs * scores.trained).sum().backward()
            return scores.logprobs.detach()

        results[name] = once()  # warm-up
        seconds = []
        for _ in range(trials):
            start = time.perf_counter()
            once()
            seconds.append(time.perf_counter() - start)
        timings[name] = statistics.median(seconds)
    rows = []
    for name, (layout, mode, _) in ways.items():
        rows.append({"layout": name, "tokens_computed": tokens_computed(layout, mode),
                     "videos_encoded": len(layout.vision()["video_grid_thw"]) if mode == "tree"
                     else sum(len(layout.vision(p)["video_grid_thw"]) for p in layout.paths),
                     "fwd_bwd_s": timings[name], "time_vs_paths": timings[name] / timings["paths"],
                     "tokens_vs_paths": tokens_computed(layout, mode) / tokens_computed(tree, "paths"),
                     "max_logprob_diff_vs_paths": float((results[name] - results["paths"]).abs().max())})
    shape = {"prompt_tokens": tree.prompt_len, "G": len(tree.paths), "branching": list(BRANCHING),
             "turn1_tokens": tree.lengths[0], "turn2_tokens": tree.lengths[-1], "frames": frames,
             "clip_frames": clip_frames, "side": side}
    table = ("## A multi-turn group: prefix tree vs flat grouping vs one row per path (fwd + bwd, fp32, CPU)\n\n"
             + ", ".join(f"{k} {v}" for k, v in shape.items()) + "\n\n"
             + markdown_table(rows, list(rows[0]), {"fwd_bwd_s": ".3f", "time_vs_paths": ".3f",
                                                    "tokens_vs_paths": ".3f", "max_logprob_diff_vs_paths": ".1e"}))
    payload = {**shape, "sizes": SIZES.__dict__, "threads": torch.get_num_threads(), "rows": rows}
    write_report(out, "tree", payload, table)
    return payload


def main(argv: list[str] | None = None) -> None:
    cli(run, __doc__, "outputs/bench/tree", argv)


if __name__ == "__main__":
    main()
