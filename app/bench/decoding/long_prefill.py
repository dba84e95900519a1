"""Rollouts of long video prompts: memory and time of the prefill (vision tower + decoder over the whole prompt),
whole against chunked, against the prompt's length.

    python -m app.bench.decoding.long_prefill --out outputs/bench/long_prefill [--quick]     (scripts/bench.sh long_prefill)

The model is fixed: Qwen2.5-VL with the long_video benchmark's "7b_ratio" text layer (hidden 512, head_dim 128,
MLP 2708, 2 layers) and a 2-block vision tower (hidden 128), the tower frozen as in a LoRA run. The prompt is one
video of T temporal patches, 16 x 16 patches each (64 tokens per temporal patch after merging) between 16 text
tokens either side; G = 4 samples. Settings, side by side at every length:

- ``whole``: one decoder call over the prompt, the tower over the whole video (rollout.prefill_chunk_size=0,
  forward.vision_chunk_frames=0);
- ``prefill``: the decoder 1,024 positions per call (rollout.prefill_chunk_size=1024), the tower whole;
- ``prefill+tower``: and the tower 8 temporal patches per pass (forward.vision_chunk_frames=8).

Each point runs in a fresh process (a peak is a process's high-water mark): "activation" is the peak resident
memory during the prefill minus the resident memory just before it (model and inputs excluded); "kv_cache" the
prompt's K/V the decoder keeps (the same for every setting); "logits_diff" the largest |difference| of the first
sampling logits from ``whole``'s (the same numbers up to float summation order).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from app.bench.common import ROOT, child_env, cli, markdown_table, write_report

SETTINGS = {"whole": (0, 0), "prefill": (1024, 0), "prefill+tower": (1024, 8)}  # (prefill chunk, tower frames)
QUICK_SETTINGS = {"whole": (0, 0), "prefill": (256, 0), "prefill+tower": (256, 2)}  # --quick: short prompts
TOKENS_PER_PATCH = 64  # 16 x 16 patches per temporal patch, merged 2 x 2
GROUP, TEXT = 4, 16


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(prefix: int, setting: str, out: str, quick: bool = False) -> None:
    """One point: build the model and a prompt of about ``prefix`` tokens, prefill it once, write the result."""
    from app.bench.long_video import SHAPES
    from app.grouping import GroupedDecoder
    from app.grouping.vision.cache import VisionCache, attach, tower_of
    from app.runtime.models import TinySizes, build_tokenizer, model_class, tiny_config

    chunk, frames = (QUICK_SETTINGS if quick else SETTINGS)[setting]
    torch.manual_seed(0)
    config = tiny_config("qwen2_5_vl", build_tokenizer(),
                         TinySizes(**SHAPES["7b_ratio"], vision_hidden=128, vision_heads=2,
                                   max_positions=prefix * 4 + 64))
    model = model_class(config).from_config(config).eval()
    tower_of(model).requires_grad_(False)
    attach(model, VisionCache("outputs", store=False, chunk_frames=frames))
    temporal = max(1, (prefix - 2 * TEXT - 2) // TOKENS_PER_PATCH)
    grid = torch.tensor([[temporal, 16, 16]])
    generator = torch.Generator().manual_seed(1)
    pixels = torch.randn(temporal * 256, 3 * 2 * 14 * 14, generator=generator)
    special = {config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id}
    plain = torch.tensor([t for t in range(config.get_text_config().vocab_size) if t not in special])
    text = plain[torch.randint(0, len(plain), (TEXT,), generator=generator)]
    video = [config.vision_start_token_id, *[config.video_token_id] * (temporal * TOKENS_PER_PATCH),
             config.vision_end_token_id]
    ids = torch.cat([text, torch.tensor(video), text])[None]
    types = torch.zeros_like(ids)
    types[ids == config.video_token_id] = 2
    prompts = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": types,
               "pixel_values_videos": pixels, "video_grid_thw": grid, "second_per_grid_ts": torch.tensor([1.0])}
    before = _rss_mb()
    start = time.perf_counter()
    with torch.no_grad():
        decoder = GroupedDecoder(model, prompts, [GROUP], 4, prefill_chunk_size=chunk)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cache_mb = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in decoder.cache.prefix) / 2**20
    torch.save(decoder.logits[0].clone(), Path(out).with_suffix(".pt"))
    decoder.close()
    Path(out).write_text(json.dumps({"setting": setting, "prefix": int(ids.shape[1]), "temporal_patches": temporal,
                                     "seconds": seconds, "activation_mb": peak - before, "kv_cache_mb": cache_mb,
                                     "peak_mb": peak}))


def point(prefix: int, setting: str, out: Path, quick: bool = False) -> dict:
    """One point in its own process (its memory apart); under ``--quick`` (the suite's smoke run: every setting, no
    figure read) in this one, without a child's imports."""
    target = out / f"point-{setting}-P{prefix}.json"
    if quick:
        worker(prefix, setting, str(target), quick)
        return {**json.loads(target.read_text()), "logits_file": target.with_suffix(".pt").name}
    done = subprocess.run([sys.executable, "-m", "app.bench.decoding.long_prefill", "--worker", str(prefix), setting,
                           str(target)], cwd=ROOT, capture_output=True, text=True, timeout=3600, env=child_env())
    if done.returncode != 0:
        raise RuntimeError(f"{setting} P={prefix} failed:\n{done.stderr[-4000:]}")
    return {**json.loads(target.read_text()), "logits_file": target.with_suffix(".pt").name}


def run(out: Path, quick: bool = False) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    prefixes = (600,) if quick else (4096, 8192, 16384, 32768)  # --quick: every setting, at one length
    rows = []
    for prefix in prefixes:
        for setting in SETTINGS:
            row = point(prefix, setting, out, quick)
            print(row, flush=True)
            rows.append(row)
    return report(out, rows, quick)


def report(out: Path, rows: list[dict], quick: bool = False) -> dict:
    whole = {r["prefix"]: r for r in rows if r["setting"] == "whole"}
    for row in rows:
        base = whole[row["prefix"]]
        row["activation_vs_whole"] = row["activation_mb"] / base["activation_mb"]
        row["time_vs_whole"] = row["seconds"] / base["seconds"]
        logits = torch.load(out / row["logits_file"])
        reference = torch.load(out / base["logits_file"])
        row["logits_diff"] = float((logits - reference).abs().max())
    table = markdown_table(rows, ["setting", "prefix", "temporal_patches", "seconds", "time_vs_whole",
                                  "activation_mb", "activation_vs_whole", "kv_cache_mb", "logits_diff"],
                           {"seconds": ".2f", "time_vs_whole": ".2f", "activation_mb": ".0f",
                            "activation_vs_whole": ".3f", "kv_cache_mb": ".0f", "logits_diff": ".1e"})
    settings = QUICK_SETTINGS if quick else SETTINGS
    chunk, frames = settings["prefill+tower"]
    table = (f"## Prefill of one long video prompt (G={GROUP}): whole vs chunked decoder ({chunk} positions per "
             f"call) vs chunked decoder and tower ({frames} temporal patches per pass), {os.cpu_count()} CPU "
             f"cores\n\n{table}")
    payload = {"rows": rows, "settings": {k: {"prefill_chunk_size": c, "vision_chunk_frames": f}
                                          for k, (c, f) in settings.items()}, "quick": quick}
    write_report(out, "long_prefill", payload, table)
    plot(rows, out / "long_prefill.png")
    return payload


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for setting in SETTINGS:
        pts = sorted((r["prefix"], r["activation_mb"], r["seconds"]) for r in rows if r["setting"] == setting)
        left.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=setting)
        right.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=setting)
    kv = sorted((r["prefix"], r["kv_cache_mb"]) for r in rows if r["setting"] == "whole")
    left.plot([p[0] for p in kv], [p[1] for p in kv], linestyle=":", color="grey", label="prompt K/V (kept)")
    left.set(xlabel="prompt tokens", ylabel="MB (peak resident minus before)", title="Prefill memory")
    right.set(xlabel="prompt tokens", ylabel="seconds", title="Prefill time")
    for ax in (left, right):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(int(argv[1]), argv[2], argv[3], argv[4:5] == ["quick"])
        return
    cli(run, __doc__, "outputs/bench/long_prefill", argv)


if __name__ == "__main__":
    main()
