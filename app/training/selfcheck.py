"""Grouped vs repeated on a tiny Qwen2.5-VL with real mp4 videos: a one-minute look at the core promise.

    python -m app.training.selfcheck [--family qwen2_5_vl] [--group-size 4] [--out outputs/selfcheck]

Builds a tiny checkpoint (save_pretrained, then loaded back with from_pretrained) and two videos, samples random
completions of uneven lengths, and for each CPU backend prints how far the grouped log-probs and every parameter
gradient are from the repeated baseline, and how many tokens and vision patches each layout processed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from app.data.prompts import encode_prompts
from app.data.video import video_element, write_mp4
from app.grouping import completion_logprobs, usable_backends
from app.runtime.models import FAMILIES, build_tiny_checkpoint, load_model, load_processor


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _run(model, prompts, ids, mask, group_sizes, mode, *, backend=None):
    patches = []
    visual = getattr(model.model, "visual", None)
    hook = visual.register_forward_hook(lambda m, args, out: patches.append(args[0].shape[0])) if visual else None
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    scores = completion_logprobs(model, prompts, ids, mask, group_sizes, mode=mode, backend=backend)
    scores.logprobs.sum().backward()
    seconds = time.perf_counter() - start
    if hook:
        hook.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return scores, grads, seconds, sum(patches)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen2_5_vl", choices=FAMILIES)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--out", default="outputs/selfcheck")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    out = Path(args.out)
    checkpoint = out / f"tiny-{args.family}"
    if not (checkpoint / "config.json").exists():
        build_tiny_checkpoint(checkpoint, args.family, seed=args.seed)
    model, processor = load_model(checkpoint), load_processor(checkpoint)
    tokenizer = getattr(processor, "tokenizer", processor)

    rng = np.random.default_rng(args.seed)
    factor = 32 if args.family == "qwen3_vl" else 28
    conversations = []
    for i, question in enumerate(["Which way does the square move?", "How many shapes are there?"]):
        content = [{"type": "text", "text": question}]
        if hasattr(processor, "video_processor"):
            clip = rng.integers(0, 255, (8 + 4 * i, 56, 84, 3), dtype=np.uint8)
            path = write_mp4(out / f"clip{i}.mp4", clip, fps=4)
            content.insert(0, video_element(path, fps=2, min_pixels=factor * factor * 2, max_pixels=factor * factor * 6))
        conversations.append([{"role": "user", "content": content}])
    prompts = encode_prompts(processor, conversations)
    group_sizes = [args.group_size] * len(conversations)
    lengths = rng.integers(1, 21, sum(group_sizes)).tolist()
    width = max(lengths)
    ids = torch.from_numpy(rng.integers(10, len(tokenizer), (len(lengths), width)))
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()

    ref, ref_grads, ref_seconds, ref_patches = _run(model, prompts, ids, mask, group_sizes, "repeated")
    layout = ref.layout
    rows = [{"layout": "repeated", "backend": "-", "tokens": layout.repeated_tokens, "vision_patches": ref_patches,
             "seconds": ref_seconds, "logprob_rel_diff": 0.0, "grad_rel_diff": 0.0}]
    for backend in usable_backends("cpu"):
        scores, grads, seconds, patches = _run(model, prompts, ids, mask, group_sizes, "grouped", backend=backend)
        rows.append({
            "layout": "grouped", "backend": backend, "tokens": layout.packed_tokens, "vision_patches": patches,
            "seconds": seconds, "logprob_rel_diff": _relative(scores.logprobs.detach(), ref.logprobs.detach()),
            "grad_rel_diff": max(_relative(grads[n], ref_grads[n]) for n in ref_grads),
        })

    print(f"\n{args.family}: {len(conversations)} prompts (prefix lengths {list(layout.prefix_lens)}), "
          f"G={args.group_size}, completion lengths {lengths}")
    header = f"{'layout':<9} {'backend':<7} {'tokens':>7} {'patches':>8} {'seconds':>8} {'logprob rel diff':>17} {'max grad rel diff':>18}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['layout']:<9} {r['backend']:<7} {r['tokens']:>7} {r['vision_patches']:>8} {r['seconds']:>8.3f} "
              f"{r['logprob_rel_diff']:>17.2e} {r['grad_rel_diff']:>18.2e}")
    worst = max(r["grad_rel_diff"] for r in rows)
    ok = worst <= 1e-4 and max(r["logprob_rel_diff"] for r in rows) <= 1e-5
    print(f"\ngrouped == repeated within tolerance (log-probs 1e-5, gradients 1e-4 relative): {'yes' if ok else 'NO'}")
    summary = {"family": args.family, "rows": rows, "equivalent": ok}
    (out / "selfcheck.json").write_text(json.dumps(summary, indent=2))
    if not ok:
        raise SystemExit("grouped and repeated disagree beyond tolerance")
    return summary


if __name__ == "__main__":
    main()
