"""Questions that share a video (data.questions_per_video = k): each stage of a step for a family of k questions on
one video against the same k questions as k separate groups, in one run, as ratios, with the planner's FLOP ratio
beside each.

    python -m app.bench.video.shared_video --out outputs/bench/shared_video [--quick] [--sizes tiny,7b]
        [--prefixes 4096,8192] [--ks 1,2,4,8] [--long-video] [--layers 1,2] [--phases policy,...]
        [--checkpointing] [--keep]                                                (scripts/bench.sh shared_video)

A point is one model size, one video (a prefix of about P visual tokens: an mp4 of P / 128 frames at 448 x 448,
decoded at 2 fps through the data path) and k questions of 20 words and 4 options, each followed by the template's
instruction (about 200 tokens of its own), G = 8 completions each. Measured for the
family (the k prompts marked as sharing the video, as the data stream marks a run) and for k separate groups (each
question alone, one after another: k micro-batches, k rollouts):

- decode: the data path from file to prompt (``records.encode_run``: the file decoded once and the processor run once
  for the run; separately ``encode_record`` per question);
- tower: the frozen vision tower on the video (once, or once per question);
- prefill: the grouped rollout engine's prefill (``GroupedDecoder``: the video once and each question on top, or each
  prompt whole);
- reference: the no-grad forward of the completion log-probs (one packed row [V; Q1; R1*; ...], or a row per group);
- policy: the forward+backward of the policy update.

Times are wall seconds (the median of a few runs at the tiny size, one run at the 7B shape); peaks are the CPU
allocator's (``measure.allocator_peak``) for one family against the largest of the k separate groups. Sizes: ``tiny``
(hidden 256, 2 layers, the project's 640-token tokenizer) and ``7b`` (Qwen2.5-VL-7B's layer shape: ``--layers``
decoder layers, one vision block, the real vocabulary and head, float32; the tower and the token embeddings frozen,
as a long video is trained; ``--checkpointing``: activation checkpointing, as the 7B configs train, which is what
lets 2 layers at an 8k video fit 24 GiB). ``--phases``: measure only these (the file's decode always runs);
``--keep``: add to the report in ``--out``, a point measured again replacing its row. The planner's ratio is its
FLOPs for the family over k single groups (``app.planning``).
``--long-video``: a 10-minute 640x360 H.264 video at 1 fps (600 frames) through the data path, once and for k
questions.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from app.bench import common
from app.bench.common import attempt, exit_if_failed
from app.bench.video.shared_report import GROUP, PHASES, plot, write

COMPLETION, QUESTION_WORDS = 128, 20
SIDE = 448  # frame side in pixels: (448 / 28)^2 = 256 visual tokens per temporal patch of 2 frames
WORDS = ("colour shape square circle moves left right up down first last frame video scene object count "
         "how many which where when does appear before after between during large small bright dark").split()


def question(i: int) -> str:
    rng = np.random.default_rng(i)
    return " ".join(rng.choice(WORDS, QUESTION_WORDS)) + "?"


def assets(root: Path, prefix: int, k: int) -> tuple[Path, list[dict]]:
    """An mp4 of ``prefix`` / 128 frames at 448 x 448 (2 fps), and k multiple-choice records on it."""
    from app.data.video import write_mp4

    frames = 2 * max(1, prefix // (SIDE // 28) ** 2)
    video = root / f"video_{prefix}.mp4"
    if not video.exists():
        rng = np.random.default_rng(prefix)
        clip = rng.integers(0, 255, (frames, SIDE, SIDE, 3), dtype=np.uint8)
        write_mp4(video, clip, fps=2)
    records = [{"problem_id": i, "problem": question(i), "problem_type": "multiple choice", "data_type": "video",
                "options": ["A. red", "B. green", "C. blue", "D. yellow"], "solution": "<answer>A</answer>",
                "path": video.name, "_where": f"bench:{i}"} for i in range(k)]
    return video, records


def data_config(prefix: int, size: str = "7b"):
    """The data settings of a point: 2 fps, every frame, 448 x 448 pixels; the tiny size with the project's shorter
    template (its 640-token tokenizer makes Video-R1's instruction 400 tokens; this one about 200, what Qwen's
    tokenizer makes of Video-R1's)."""
    from app.config.sections import DataConfig

    cfg = DataConfig()
    if size == "tiny":
        cfg.prompt_template = "prefix_grpo"
    cfg.fps, cfg.max_frames = 2.0, 2 * max(1, prefix // (SIDE // 28) ** 2)
    cfg.min_pixels = cfg.max_pixels = SIDE * SIDE
    cfg.max_prompt_length = 1 << 20
    return cfg


TINY = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512)  # long_video's tiny shape


def build_model(size: str, root: Path, layers: int = 1):
    """(model, processor). ``tiny``: a checkpoint of hidden 256 with the project's 640-token tokenizer (a head of
    Qwen's 151,936 rows at this width made every phase a page-faulting memory walk whose time varied 3x between
    identical runs). ``7b``: the 7B layer shape with a tiny checkpoint's processor that carries Qwen's real tokenizer
    (the real token ids)."""
    from app.planning import shapes
    from app.runtime.models import TinySizes, build_tiny_checkpoint, load_model, load_processor

    checkpoint = build_tiny_checkpoint(root / "tiny", "qwen2_5_vl", seed=0, real_tokenizer=size != "tiny",
                                       max_pixels=SIDE * SIDE, sizes=TinySizes(**TINY, max_positions=1 << 16))
    processor = load_processor(checkpoint)
    if size == "tiny":
        model = load_model(checkpoint)
    else:
        config = shapes.hf_config("qwen2_5_vl_7b", layers=layers, vision_layers=1)
        torch.manual_seed(0)
        model = shapes.random_model(config, torch.float32)
    model.requires_grad_(True)
    model.model.visual.requires_grad_(False)  # a frozen tower (LoRA, or model.freeze_vision_tower)
    model.get_input_embeddings().requires_grad_(False)
    model.train()
    return model, processor


def completions_for(model, k: int, completion: int, seed: int = 0):
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(seed)
    low = 1000 if vocab > 100_000 else 20  # ordinary tokens (the toy tokenizer's specials sit at its start)
    ids = torch.randint(low, min(vocab, 100_000) - 30, (k * GROUP, completion), generator=generator)
    return ids, torch.ones_like(ids)


def measure_pair(family, apart, repeats: int) -> dict:
    """Seconds and allocator peak bytes of two variants of a phase: each peak from one run under the profiler's
    memory events; the times the medians of ``repeats`` rounds that run the two alternately (family, apart, family,
    ...), so a slow spell of the machine falls on both; with ``repeats`` = 1 (a 7B-shape phase takes minutes) the
    profiled runs' own times."""
    from app.bench.measure import allocator_peak

    out, times = {}, {"family": [], "apart": []}
    for name, fn in (("family", family), ("apart", apart)):
        start = time.perf_counter()
        _, out[f"{name}_peak"] = allocator_peak(fn)
        times[name].append(time.perf_counter() - start)
    if repeats > 1:
        times = {"family": [], "apart": []}
        for _ in range(repeats):
            for name, fn in (("family", family), ("apart", apart)):
                times[name].append(_once(fn))
    for name, values in times.items():
        out[f"{name}_s"] = sorted(values)[len(values) // 2]
    return out


def _once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def point(size: str, prefix: int, k: int, root: str, *, completion: int = COMPLETION, repeats: int = 3,
          layers: int = 1, phases: tuple = PHASES, checkpointing: bool = False) -> dict:
    """One (size, video, k): each of ``phases`` for the family and for k separate groups (``layers``: the 7B
    shape's; ``checkpointing``: activation checkpointing in the policy pass, as the 7B configs train)."""
    from app.data.prompts import collate_prompts
    from app.data.records import encode_record, encode_run
    from app.grouping import completion_logprobs
    from app.grouping.decoding.decode import GroupedDecoder
    from app.grouping.modules import attention_restored
    from app.runtime.models import enable_activation_checkpointing

    torch.manual_seed(0)
    root = Path(root)
    video, records = assets(root, prefix, k)
    cfg = data_config(prefix, size)
    model, processor = build_model(size, root / size, layers)
    if checkpointing:
        enable_activation_checkpointing(model)
    pad = processor.tokenizer.pad_token_id
    out: dict = {"size": size, "prefix": prefix, "k": k, "layers": model.config.get_text_config().num_hidden_layers,
                 "checkpointing": checkpointing}
    runs = {}

    def decode_family():
        runs["family"] = encode_run(processor, records, root, cfg)[0]

    def decode_apart():
        runs["apart"] = [encode_record(processor, r, root, cfg) for r in records]

    encode_record(processor, records[0], root, cfg)  # warm-up: the file in the page cache, the readers loaded
    times = {"family": [], "apart": []}
    for _ in range(max(repeats, 3)):  # alternately, as the other phases (seconds each: at least 3 rounds)
        for name, fn in (("family", decode_family), ("apart", decode_apart)):
            times[name].append(_once(fn))
    for name, values in times.items():
        out[f"decode_{name}_s"] = sorted(values)[len(values) // 2]
    prompts = [p for p, _ in runs["family"]]
    out["prompt_tokens"] = prompts[0].length
    out["visual_tokens"] = int((prompts[0].inputs["input_ids"] == model.config.video_token_id).sum())
    family = collate_prompts([p.inputs for p in prompts], pad)
    alone = [collate_prompts([p.inputs], pad) for p in prompts]
    ids, mask = completions_for(model, k, completion)
    rows = [slice(i * GROUP, (i + 1) * GROUP) for i in range(k)]
    pixels, grid = family["pixel_values_videos"], family["video_grid_thw"][:1]
    video_pixels = pixels[: int(grid.prod())]

    def tower(times):
        with torch.no_grad():
            for _ in range(times):
                model.model.visual(video_pixels, grid_thw=grid)

    def prefill(batches, families):
        with torch.no_grad():
            for batch, fam in zip(batches, families):
                GroupedDecoder(model, batch, [GROUP] * batch["input_ids"].shape[0], completion, decode="eager",
                               families=fam).close()

    def reference(batches, families, pieces):
        with torch.no_grad():
            for batch, fam, part in zip(batches, families, pieces):
                completion_logprobs(model, batch, ids[part], mask[part], GROUP, backend="split", families=fam)

    def policy(batches, families, pieces):
        for batch, fam, part in zip(batches, families, pieces):
            with attention_restored(model):
                scores = completion_logprobs(model, batch, ids[part], mask[part], GROUP, backend="split",
                                             families=fam, return_entropy=True)
                scores.logprobs.sum().backward()
        model.zero_grad(set_to_none=True)

    whole = slice(0, k * GROUP)
    plan = {
        "tower": (lambda: tower(1), lambda: tower(k)),
        "prefill": (lambda: prefill([family], [[k]]), lambda: prefill(alone, [None] * k)),
        "reference": (lambda: reference([family], [[k]], [whole]), lambda: reference(alone, [None] * k, rows)),
        "policy": (lambda: policy([family], [[k]], [whole]), lambda: policy(alone, [None] * k, rows)),
    }
    for phase, (shared, apart) in ((p, plan[p]) for p in phases if p in plan):  # apart's peak: the largest group's
        measured = measure_pair(shared, apart, repeats)
        for name in ("family", "apart"):
            out[f"{phase}_{name}_s"] = measured[f"{name}_s"]
            out[f"{phase}_{name}_peak_mb"] = measured[f"{name}_peak"] / 2**20
    # a question's own tokens (k = 1: as in a family of two on the same video, so every row counts alike)
    pair = prompts if k > 1 else [p for p, _ in encode_run(processor, assets(root, prefix, 2)[1], root, cfg)[0]]
    out["question_tokens"] = question_tokens(pair)
    out.update(planned_ratios(model.config, prefix=out["prompt_tokens"], question=out["question_tokens"], k=k,
                              completion=completion, visual=out["visual_tokens"], patches=int(grid.prod()),
                              temporal=int(grid[0, 0]), checkpointing=checkpointing))
    return out


def question_tokens(prompts) -> int:
    """A question's own tokens: what follows the tokens every prompt of the family shares."""
    ids = [p.inputs["input_ids"][0] for p in prompts]
    common = min(len(i) for i in ids)
    for row in ids[1:]:
        differ = (row[:common] != ids[0][:common]).nonzero()
        common = int(differ[0, 0]) if len(differ) else common
    return ids[0].shape[0] - common


def planned_ratios(config, *, prefix: int, question: int, k: int, completion: int, visual: int, patches: int,
                   temporal: int, checkpointing: bool = False) -> dict:
    """The planner's FLOPs of each phase for the family over k single groups."""
    from app.planning import costs, flops

    if k == 1:
        return {f"planned_{phase}": 1.0 for phase in PHASES}
    shape = costs.shape_of(config)
    single = costs.Workload(prefix=prefix, completion=completion, group_size=GROUP, visual=visual, patches=patches,
                            temporal=temporal)
    fam = costs.Workload(prefix=prefix, completion=completion, group_size=GROUP, groups=k, questions=k,
                         question=question, visual=visual, patches=patches, temporal=temporal)
    train = {w: flops.train_flops(shape, work, "split", checkpointing=checkpointing, chunk=1024)["total"]
             for w, work in (("single", single), ("family", fam))}
    forward = {w: flops.forward_flops(shape, work, "split")["total"] for w, work in (("single", single),
                                                                                      ("family", fam))}
    # the prefill: V once and each question on top of it (its queries against V too), as the split kernel counts
    prefill_single = flops.forward_flops(shape, costs.Workload(prefix=prefix, completion=0, group_size=1),
                                         "split")["total"]
    prefill_family = flops.forward_flops(shape, costs.Workload(prefix=prefix, completion=0, group_size=1, groups=k,
                                                               questions=k, question=question), "split")["total"]
    return {"planned_policy": train["family"] / (k * train["single"]),
            "planned_reference": forward["family"] / (k * forward["single"]),
            "planned_prefill": prefill_family / (k * prefill_single), "planned_tower": 1 / k, "planned_decode": 1 / k}


def long_video(root: str, ks: list[int]) -> dict:
    """A 10-minute 640x360 H.264 video at 1 fps (600 frames) through the trainer's data path at the 7B config's
    pixel limit per frame: one question, and k questions as one run (the file decoded once)."""
    from app.data.records import encode_record, encode_run
    from app.data.video import write_mp4
    from app.runtime.models import build_tiny_checkpoint, load_processor

    root = Path(root)
    video = root / "ten_minutes.mp4"
    if not video.exists():
        rng = np.random.default_rng(0)
        frames = (rng.integers(0, 255, (600, 360, 640, 3), dtype=np.uint8) // 32 * 32).astype(np.uint8)
        write_mp4(video, np.repeat(frames, 2, axis=0), fps=2)  # 1,200 frames at 2 fps: 10 minutes
    processor = load_processor(build_tiny_checkpoint(root / "tiny", "qwen2_5_vl", seed=0, real_tokenizer=True,
                                                     max_pixels=336 * 588))
    from app.config.sections import DataConfig

    cfg = DataConfig()
    cfg.fps, cfg.max_frames, cfg.max_prompt_length = 1.0, 600, 1 << 22
    cfg.min_pixels, cfg.max_pixels = 3136, 336 * 588
    record = {"problem": question(0), "problem_type": "multiple choice", "data_type": "video", "path": video.name,
              "options": ["A. a", "B. b"], "solution": "<answer>A</answer>", "_where": "long"}
    start = time.perf_counter()
    prompt, reason = encode_record(processor, record, root, cfg)
    one = time.perf_counter() - start
    if prompt is None:
        raise RuntimeError(reason)
    out = {"seconds_one_question": one, "frames": int(prompt.inputs["video_grid_thw"][0, 0]) * 2,
           "visual_tokens": int(prompt.inputs["video_grid_thw"][0].prod()) // 4, "runs": {}}
    for k in ks:
        records = [{**record, "problem": question(i), "_where": f"long:{i}"} for i in range(k)]
        start = time.perf_counter()
        results, decodes = encode_run(processor, records, root, cfg)
        out["runs"][str(k)] = {"seconds": time.perf_counter() - start, "decodes": decodes,
                               "seconds_apart": one * k}
    return out


def run(out: Path, quick: bool, *, sizes=("tiny", "7b"), prefixes=(4096, 8192), ks=(1, 2, 4, 8),
        with_long_video: bool = False, layers=(1,), keep: bool = False, phases=PHASES, checkpointing=False) -> dict:
    """``layers``: the 7B shape's depths; ``keep``: add to the points already in ``out``'s report (a point measured
    again replaces its row)."""
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    if quick:
        sizes, prefixes, ks = ("tiny",), (512,), (1, 2)
    plan_points = [(s, p, k, n) for s in sizes for p in prefixes for k in ks for n in (layers if s == "7b" else (2,))
                   if s != "7b" or k == 4]  # the 7B shape at k = 4 only (a point takes many minutes on 2 cores)
    report = out / "shared_video.json"
    before = json.loads(report.read_text()) if keep and report.exists() else {}
    rows = [r for r in before.get("points", [])  # a point measured again replaces its earlier row
            if (r["size"], r["prefix"], r["k"], r.get("layers")) not in set(plan_points)]
    failed: list[str] = []
    for size, prefix, k, depth in plan_points:
        result = common.point("app.bench.video.shared_video:point", quick, size=size, prefix=prefix, k=k,
                              root=str(work), completion=16 if quick else COMPLETION,
                              repeats=1 if size == "7b" or quick else 5, layers=depth, phases=list(phases),
                              checkpointing=checkpointing)
        if "error" in result:
            failed.append(f"{size} P={prefix} k={k} layers={depth}: {result['error']}")
            rows.append({"size": size, "prefix": prefix, "k": k, "layers": depth})
        else:
            rows.append(result)
        write(out, rows, failed, None)
    long = attempt("app.bench.video.shared_video:long_video", root=str(work), ks=[2, 4, 8]) if with_long_video else \
        before.get("long_video")
    if long is not None and "error" in long:
        failed.append(f"long video: {long['error']}")
    payload = write(out, rows, failed, long)
    plot(out, rows)
    exit_if_failed(len(failed), len(plan_points) + bool(with_long_video), out)
    return payload


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/bench/shared_video")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (for tests)")
    parser.add_argument("--sizes", default="tiny,7b")
    parser.add_argument("--prefixes", default="4096,8192")
    parser.add_argument("--ks", default="1,2,4,8")
    parser.add_argument("--long-video", action="store_true", help="also a 10-minute video through the data path")
    parser.add_argument("--layers", default="1", help="decoder layers of the 7B shape (1-2 on this CPU)")
    parser.add_argument("--keep", action="store_true", help="add the points to the report already in --out")
    parser.add_argument("--phases", default=",".join(PHASES), help="which of decode,tower,prefill,reference,policy "
                        "(the file's decode always runs: it makes the prompts)")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing (the 7B configs')")
    args = parser.parse_args(argv)
    payload = run(Path(args.out), args.quick, sizes=tuple(args.sizes.split(",")),
                  prefixes=tuple(int(p) for p in args.prefixes.split(",")), ks=tuple(int(k) for k in args.ks.split(",")),
                  with_long_video=args.long_video, layers=tuple(int(n) for n in args.layers.split(",")),
                  keep=args.keep, phases=tuple(args.phases.split(",")), checkpointing=args.checkpointing)
    print((Path(args.out) / "shared_video.md").read_text())
    print(json.dumps({"points": len(payload["points"])}))


if __name__ == "__main__":
    main()
