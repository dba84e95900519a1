"""Questions that share a video (data.questions_per_video = k): each stage of a step for a family of k questions on
one video against the same k questions as k separate groups, in one run, as ratios, with the planner's FLOP ratio
beside each.

    python -m app.bench.shared_video --out outputs/bench/shared_video [--quick] [--sizes tiny,7b]
        [--prefixes 4096,8192] [--ks 1,2,4,8] [--long-video]                      (scripts/bench.sh shared_video)

A point is one model size, one video (a prefix of about P visual tokens: an mp4 of P / 128 frames at 448 x 448,
decoded at 2 fps through the data path) and k questions of about 60 tokens, G = 8 completions each. Measured for the
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
(the test suite's Qwen2.5-VL with Qwen's real vocabulary) and ``7b`` (Qwen2.5-VL-7B's layer shape: one decoder
layer, one vision block, the real vocabulary and head, float32; the tower and the token embeddings frozen, as a long
video is trained). The planner's ratio is its FLOPs for the family over k single groups (``app.planning``).
``--long-video``: a 10-minute 640x360 H.264 video at 1 fps (600 frames) through the data path, once and for k
questions.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from app.bench.common import attempt, exit_if_failed, failed_points, markdown_table, write_report

GROUP, COMPLETION, QUESTION_WORDS = 8, 128, 40
SIDE = 448  # frame side in pixels: (448 / 28)^2 = 256 visual tokens per temporal patch of 2 frames
PHASES = ("decode", "tower", "prefill", "reference", "policy")
GOALS = {"policy": 0.45, "prefill": 0.30, "decode": 0.30, "tower": 0.30}  # at k = 4, an 8k-token video
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


def data_config(prefix: int):
    from app.config.sections import DataConfig

    cfg = DataConfig()
    cfg.fps, cfg.max_frames = 2.0, 2 * max(1, prefix // (SIDE // 28) ** 2)
    cfg.min_pixels = cfg.max_pixels = SIDE * SIDE
    cfg.max_prompt_length = 1 << 20
    return cfg


TINY = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512)  # long_video's tiny shape


def build_model(size: str, root: Path):
    """(model, processor). ``tiny``: a checkpoint of hidden 256 with the project's 640-token tokenizer (a head of
    Qwen's 151,936 rows at this width made every phase a page-faulting memory walk whose time varied 3x between
    identical runs). ``7b``: the 7B layer shape with a tiny checkpoint's processor that carries Qwen's real tokenizer
    (the real token ids)."""
    from app.planning import shapes
    from app.runtime.models import TinySizes, build_tiny_checkpoint, load_model, load_processor, model_class

    checkpoint = build_tiny_checkpoint(root / "tiny", "qwen2_5_vl", seed=0, real_tokenizer=size != "tiny",
                                       max_pixels=SIDE * SIDE, sizes=TinySizes(**TINY, max_positions=1 << 16))
    processor = load_processor(checkpoint)
    if size == "tiny":
        model = load_model(checkpoint)
    else:
        config = shapes.hf_config("qwen2_5_vl_7b", layers=1, vision_layers=1)
        torch.manual_seed(0)
        model = model_class(config).from_config(config, dtype=torch.float32)
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


def point(size: str, prefix: int, k: int, root: str, completion: int = COMPLETION, repeats: int = 3) -> dict:
    """One (size, video, k): every phase for the family and for k separate groups."""
    from app.data.prompts import collate_prompts
    from app.data.records import encode_record, encode_run
    from app.grouping import completion_logprobs
    from app.grouping.decoding.decode import GroupedDecoder
    from app.grouping.modules import attention_restored

    torch.manual_seed(0)
    root = Path(root)
    video, records = assets(root, prefix, k)
    cfg = data_config(prefix)
    model, processor = build_model(size, root / size)
    pad = processor.tokenizer.pad_token_id
    out: dict = {"size": size, "prefix": prefix, "k": k}
    runs = {}

    def decode_family():
        runs["family"] = encode_run(processor, records, root, cfg)[0]

    def decode_apart():
        runs["apart"] = [encode_record(processor, r, root, cfg) for r in records]

    encode_record(processor, records[0], root, cfg)  # warm-up: the file in the page cache, the readers loaded
    times = {"family": [], "apart": []}
    for _ in range(repeats):  # alternately, as the other phases
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
    for phase, (shared, apart) in plan.items():  # the k separate groups' peak: the largest of theirs
        measured = measure_pair(shared, apart, repeats)
        for name in ("family", "apart"):
            out[f"{phase}_{name}_s"] = measured[f"{name}_s"]
            out[f"{phase}_{name}_peak_mb"] = measured[f"{name}_peak"] / 2**20
    out.update(planned_ratios(model.config, prefix=out["prompt_tokens"], question=question_tokens(prompts), k=k,
                              completion=completion, visual=out["visual_tokens"], patches=int(grid.prod()),
                              temporal=int(grid[0, 0])))
    return out


def question_tokens(prompts) -> int:
    """A question's own tokens: what follows the tokens every prompt of the family shares."""
    ids = [p.inputs["input_ids"][0] for p in prompts]
    if len(ids) == 1:
        return 60
    common = min(len(i) for i in ids)
    for row in ids[1:]:
        differ = (row[:common] != ids[0][:common]).nonzero()
        common = int(differ[0, 0]) if len(differ) else common
    return ids[0].shape[0] - common


def planned_ratios(config, *, prefix: int, question: int, k: int, completion: int, visual: int, patches: int,
                   temporal: int) -> dict:
    """The planner's FLOPs of each phase for the family over k single groups."""
    from app.planning import costs, flops

    if k == 1:
        return {f"planned_{phase}": 1.0 for phase in PHASES}
    shape = costs.shape_of(config)
    single = costs.Workload(prefix=prefix, completion=completion, group_size=GROUP, visual=visual, patches=patches,
                            temporal=temporal)
    fam = costs.Workload(prefix=prefix, completion=completion, group_size=GROUP, groups=k, questions=k,
                         question=question, visual=visual, patches=patches, temporal=temporal)
    train = {w: flops.train_flops(shape, work, "split", checkpointing=False, chunk=1024)["total"]
             for w, work in (("single", single), ("family", fam))}
    forward = {w: flops.forward_flops(shape, work, "split")["total"] for w, work in (("single", single),
                                                                                      ("family", fam))}
    prefill_single = flops.forward_flops(shape, costs.Workload(prefix=prefix, completion=0, group_size=1),
                                         "flash")["total"]
    prefill_family = flops.forward_flops(shape, costs.Workload(prefix=prefix - question, completion=0, group_size=1),
                                         "flash")["total"] + k * flops.forward_flops(
        shape, costs.Workload(prefix=question, completion=0, group_size=1), "flash")["total"]
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


def run(out: Path, quick: bool, sizes=("tiny", "7b"), prefixes=(4096, 8192), ks=(1, 2, 4, 8),
        with_long_video: bool = False) -> dict:
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    if quick:
        sizes, prefixes, ks = ("tiny",), (512,), (1, 2)
    plan_points = [(s, p, k) for s in sizes for p in prefixes for k in ks
                   if s != "7b" or k == 4]  # the 7B shape at k = 4 only (a point takes many minutes on 2 cores)
    rows, failed = [], []
    for size, prefix, k in plan_points:
        result = attempt("app.bench.shared_video:point", size=size, prefix=prefix, k=k, root=str(work),
                         completion=16 if quick else COMPLETION, repeats=1 if size == "7b" or quick else 5)
        if "error" in result:
            failed.append(f"{size} P={prefix} k={k}: {result['error']}")
            rows.append({"size": size, "prefix": prefix, "k": k})
        else:
            rows.append(result)
        write(out, rows, failed, None)
    long = attempt("app.bench.shared_video:long_video", root=str(work), ks=[2, 4, 8]) if with_long_video else None
    if long is not None and "error" in long:
        failed.append(f"long video: {long['error']}")
    payload = write(out, rows, failed, long)
    plot(out, rows)
    exit_if_failed(len(failed), len(plan_points) + bool(with_long_video), out)
    return payload


def table_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        line = {"size": r["size"], "video tokens": r.get("visual_tokens", ""), "k": r["k"]}
        for phase in PHASES:
            if f"{phase}_family_s" in r:
                line[f"{phase} time"] = r[f"{phase}_family_s"] / max(r[f"{phase}_apart_s"], 1e-9)
                line[f"{phase} plan"] = r.get(f"planned_{phase}", "")
            if f"{phase}_family_peak_mb" in r:
                line[f"{phase} peak"] = r[f"{phase}_family_peak_mb"] / max(r[f"{phase}_apart_peak_mb"], 1e-9)
        out.append(line)
    return out


def write(out: Path, rows: list[dict], failed: list[str], long: dict | None) -> dict:
    columns = ["size", "video tokens", "k"] + [f"{p} {what}" for p in PHASES for what in ("time", "plan", "peak")
                                              if p != "decode" or what != "peak"]
    table = ("Family of k questions on one video over k separate groups (time ratio; the planner's FLOP ratio; peak "
             "memory of the family over one separate group's)\n\n"
             + markdown_table(table_rows(rows), columns, {c: ".3f" for c in columns[3:]}))
    if long and "runs" in long:
        table += (f"\n\nA 10-minute video at 1 fps ({long['frames']} frames, {long['visual_tokens']} visual tokens) "
                  f"through the data path: {long['seconds_one_question']:.1f} s for one question; k questions as one "
                  "run: " + ", ".join(f"k={k} {v['seconds']:.1f} s ({v['seconds'] / v['seconds_apart']:.2f}x of "
                                     f"{v['seconds_apart']:.1f} s apart)" for k, v in long["runs"].items()))
    table += failed_points(failed)
    payload = {"group_size": GROUP, "goals_at_k4_8k": GOALS, "points": rows, "long_video": long}
    write_report(out, "shared_video", payload, table, quiet=True)
    return payload


def plot(out: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = sorted({(r["size"], r.get("visual_tokens", r["prefix"])) for r in rows if "policy_family_s" in r})
    if not series:
        return
    fig, axes = plt.subplots(1, len(series), figsize=(4.5 * len(series), 3.6), squeeze=False)
    for ax, (size, tokens) in zip(axes[0], series):
        mine = sorted((r for r in rows if r["size"] == size and r.get("visual_tokens", r["prefix"]) == tokens
                       and "policy_family_s" in r), key=lambda r: r["k"])
        ks = [r["k"] for r in mine]
        for phase, colour in zip(PHASES, ("C0", "C1", "C2", "C3", "C4")):
            ax.plot(ks, [r[f"{phase}_family_s"] / r[f"{phase}_apart_s"] for r in mine], "o-", color=colour,
                    label=phase)
            ax.plot(ks, [r[f"planned_{phase}"] for r in mine], "--", color=colour, alpha=0.5)
        ax.plot(ks, [1 / k for k in ks], ":", color="grey", label="1/k")
        ax.set_title(f"{size}, {tokens} video tokens")
        ax.set_xlabel("questions per video k")
        ax.set_ylabel("time vs k separate groups")
        ax.set_xticks(ks)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Questions sharing a video: measured (solid) and planned FLOPs (dashed)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "shared_video.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/bench/shared_video")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (for tests)")
    parser.add_argument("--sizes", default="tiny,7b")
    parser.add_argument("--prefixes", default="4096,8192")
    parser.add_argument("--ks", default="1,2,4,8")
    parser.add_argument("--long-video", action="store_true", help="also a 10-minute video through the data path")
    args = parser.parse_args(argv)
    payload = run(Path(args.out), args.quick, tuple(args.sizes.split(",")),
                  tuple(int(p) for p in args.prefixes.split(",")), tuple(int(k) for k in args.ks.split(",")),
                  args.long_video)
    print((Path(args.out) / "shared_video.md").read_text())
    print(json.dumps({"points": len(payload["points"])}))


if __name__ == "__main__":
    main()
