"""The tool-needing demo: a tiny Qwen3-VL learns, on CPU, where to look for an answer only a tool call shows.

    python -m app.demos.tools [--fresh] [--family qwen3_vl|qwen2_5_vl] [--warm-steps N] [section.key=value ...]

The task (``app.data.synthetic``, ``glimpse``): an 8 s clip in which, for two seconds at a random time, a white bar
lines the top and, on the frames of those two seconds that an 8-frame overview does not take, the frame below it is
coloured; the question asks the colour. The overview the prompt holds (``configs/demo_tools_cpu.yaml``:
8 frames of 56 x 56 pixels, each frame group's time written before it by Qwen3-VL's processor) shows the bar, never
the colour; ``get_frames`` returns up to 4 frames of the asked window, which show the colour when the window is the
bar's. Measured (docs/agents.md): held-out accuracy 0.633 after the warm start, 0.817 after GRPO.

1. build the tiny checkpoint and the data, if missing;
2. a warm start through SFT with tools (``scripts/sft.sh`` with ``rollout.tools``, ``app.training.agent_sft``): each
   record's written trajectory is a ``get_frames`` call on a random two-second window (the call runs, its frames
   become the next turn), then an answer: the right letter when those frames show the colour, a random one when
   they miss it. It teaches the call's form and reading what a call returns, never where to look;
3. held-out accuracy of the untrained model and of the warm start, without tools and with them;
4. GRPO with tools (``scripts/train.sh configs/demo_tools_cpu.yaml``: multi-turn rollouts as prefix trees);
5. held-out accuracy after GRPO, with tools, and the share of calls whose frames show the answer; a table
   (``demo_summary.md``), JSON, a bar plot and the training curves.

What the run shows is written as measured, gain or none. Re-running reuses what is there; ``--fresh`` starts over.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sys
import time
from pathlib import Path

from app.config.loading import load_config
from app.data.synthetic import generate
from app.demos.video import DEMO_SIZES, FORMAT_REASONING, ROOT, WARM_START, demo_paths, eval_settings, launch, say
from app.evaluation.evaluate import evaluate
from app.rollout.tools import ToolLimits, build_tools, context_for, get_frames, run_call
from app.runtime.models import build_tiny_checkpoint
from app.runtime.plots import plot_accuracy_bars, plot_training

CONFIG = "configs/demo_tools_cpu.yaml"
CALL_REASONING = "<think>Look closer.</think>"  # with it, a call is 31 of the demo tokenizer's tokens


def call_text(start: float, end: float) -> str:
    """A ``get_frames`` call as the model writes it (Qwen's function-call form; compact JSON, whole seconds, the
    tool's default 2 fps)."""
    arguments = {"start": round(start), "end": round(end)}
    return "<tool_call>" + json.dumps({"name": "get_frames", "arguments": arguments}, separators=(",", ":")) \
        + "</tool_call>"


def frames_show_colour(element: dict) -> bool:
    """Whether the frames a ``get_frames`` observation decodes to hold a saturated colour (the glimpse task's answer;
    the clips are otherwise grey and white)."""
    from qwen_vl_utils import fetch_video

    video = fetch_video(element)
    frames = (video[0] if isinstance(video, tuple) else video).float()  # [T, 3, H, W]
    return bool(((frames.max(1).values - frames.min(1).values) > 100).any())


def warm_start_data(train: Path, out: Path, seed: int, data_root: Path, limits: ToolLimits) -> Path:
    """The training records with written trajectories (``turns``, for SFT with tools): a ``get_frames`` call on a
    random two-second window (not the record's: it teaches the call's form, never where to look), run as the
    rollout would run it, then the answer: the record's letter when the returned frames show the colour, a random
    letter when they miss it. So the warm start reads what a call returns but looks at random places."""
    rng = random.Random(seed)
    tools = build_tools(["get_frames"])
    lines = []
    for line in train.read_text().splitlines():
        record = json.loads(line)
        start = rng.uniform(0.0, float(record.get("duration", 8.0)) - 2.0)
        call = f"{CALL_REASONING}\n{call_text(start, start + 2.0)}"
        result = run_call(call, tools, context_for(record, data_root, limits))
        shown = result.error is None and frames_show_colour(result.content[-1])
        letter = record["solution"].removeprefix("<answer>").removesuffix("</answer>") if shown \
            else "ABCD"[rng.randrange(4)]
        turns = [call, f"{FORMAT_REASONING}\n<answer>{letter}</answer>"]
        lines.append(json.dumps({**record, "turns": turns, "window_shows_answer": shown}))
    out.write_text("\n".join(lines) + "\n")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/demo_tools")
    parser.add_argument("--data", default="data/synthetic_tools")
    parser.add_argument("--fresh", action="store_true", help="delete earlier outputs of this demo first")
    parser.add_argument("--train-size", type=int, default=240)
    parser.add_argument("--heldout-size", type=int, default=60)
    parser.add_argument("--warm-steps", type=int, default=600)
    parser.add_argument("--family", default="qwen3_vl", choices=("qwen3_vl", "qwen2_5_vl"),
                        help="the tiny checkpoint's family: Qwen3-VL writes each frame group's time as text in the "
                             "prompt (\"<2.8 seconds>\"), which a call's window can be read from")
    parser.add_argument("overrides", nargs="*", help="extra section.key=value for the GRPO config")
    args = parser.parse_args(argv)
    out, data = Path(args.out), Path(args.data)
    if args.fresh:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    started, timings = time.time(), {}
    init, sft, run, base = demo_paths(out, data, args.family)
    warm = sft / "final"
    cfg = load_config(ROOT / CONFIG, base + args.overrides)

    say("1. tiny checkpoint and the glimpse task (the answer shows only through get_frames)")
    if not (init / "config.json").exists():
        build_tiny_checkpoint(init, args.family, seed=cfg.train.seed, sizes=DEMO_SIZES, tool_tokens=True)
    if not (data / "meta.json").exists():
        generate(data, train=args.train_size, heldout=args.heldout_size, seed=cfg.train.seed, tasks=("glimpse",),
                 frames=32, size=112, fps=4, shuffle_options=False)
    heldout = data / "heldout.jsonl"

    say("2. warm start: scripts/sft.sh with tools (a call on a random window, then what its frames show)")
    t = time.time()
    limits = ToolLimits(max_frames=cfg.rollout.tool_max_frames, min_pixels=cfg.data.min_pixels,
                        max_pixels=cfg.rollout.tool_max_pixels)
    if not (warm / "config.json").exists():
        targets = warm_start_data(data / "train.jsonl", out / "sft_warm_start.jsonl", cfg.train.seed, data, limits)
        launch("sft.sh", CONFIG, [f"model.path={init}", f"data.train_file={targets}", f"data.data_root={data}",
                                  f"train.output_dir={sft}", f"train.max_steps={args.warm_steps}",
                                  "train.prompts_per_rank=4", "train.groups_per_micro_batch=4",
                                  "rollout.group_size=2", "grpo.beta=0.0",  # two copies of each trajectory (G >= 2)
                                  *WARM_START])
    timings["warm_start_s"] = time.time() - t

    settings = eval_settings(cfg, max_new_tokens=cfg.rollout.max_completion_length, batch_size=12)
    with_tools = ["rollout.tools=[get_frames]", f"rollout.max_turns={cfg.rollout.max_turns}",
                  f"rollout.max_total_tokens={cfg.rollout.max_total_tokens}",
                  f"rollout.tool_max_frames={cfg.rollout.tool_max_frames}",
                  f"rollout.tool_max_pixels={cfg.rollout.tool_max_pixels}"]

    def held_out(model_dir: Path, name: str, tools: bool) -> dict:
        folder = out / ("eval-" + name + ("-tools" if tools else ""))
        summary = evaluate(model_dir, heldout, [f"eval.output_dir={folder}", *settings, *(with_tools if tools else [])])
        return {**summary, "tool_calls_per_answer": tool_calls_per_answer(folder),
                "calls_showing_answer": calls_showing_answer(folder, heldout, data, limits)}

    say("3. held-out accuracy before GRPO, without and with tools")
    t = time.time()
    before = {("untrained", False): held_out(init, "untrained", False),
              ("warm start", False): held_out(warm, "warm-start", False),
              ("warm start", True): held_out(warm, "warm-start", True)}
    timings["eval_before_s"] = time.time() - t

    say(f"4. GRPO with tools: scripts/train.sh {CONFIG}")
    t = time.time()
    if not (run / "final" / "config.json").exists():
        launch("train.sh", CONFIG, [*base, "train.resume=true", "logging.wandb_mode=disabled", *args.overrides])
    timings["grpo_s"] = time.time() - t

    say("5. held-out accuracy after GRPO, with tools")
    t = time.time()
    after = held_out(run / "final", "grpo", True)
    timings["eval_after_s"] = time.time() - t

    rows = [("untrained, no tools", before[("untrained", False)]),
            ("warm start, no tools", before[("warm start", False)]),
            ("warm start, with tools", before[("warm start", True)]), ("after GRPO, with tools", after)]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    lines = ["| model | held-out accuracy | tool calls per answer | calls whose frames show the answer |",
             "|---|---|---|---|"]
    result = {"heldout_questions": after["overall"]["count"], "chance": 0.25, "accuracy": {}, "tool_calls": {},
              "calls_showing_answer": {}, "timings_s": {k: round(v, 1) for k, v in timings.items()}}
    for name, summary in rows:
        calls, showing = summary["tool_calls_per_answer"], summary["calls_showing_answer"]
        result["accuracy"][name] = summary["overall"]["accuracy"]
        result["tool_calls"][name] = calls
        result["calls_showing_answer"][name] = showing
        lines.append(f"| {name} | {summary['overall']['accuracy']:.3f} | "
                     f"{'-' if calls is None else f'{calls:.2f}'} | {'-' if showing is None else f'{showing:.3f}'} |")
    first, last = metrics[: len(metrics) // 4 or 1], metrics[-(len(metrics) // 4 or 1):]
    for key in ("reward/accuracy", "tools/valid", "tools/calls"):
        if key in metrics[0]:
            result[f"{key} first quarter"] = sum(m[key] for m in first) / len(first)
            result[f"{key} last quarter"] = sum(m[key] for m in last) / len(last)
    result["total_s"] = round(time.time() - started, 1)
    table = "\n".join(lines)
    (out / "demo_summary.json").write_text(json.dumps(result, indent=2))
    (out / "demo_summary.md").write_text(table + "\n")
    plot_training(run / "metrics.jsonl", out / "training_curves.png", title="GRPO with tools on the glimpse task")
    plot_accuracy_bars(result["accuracy"], out / "heldout_accuracy.png", chance=0.25,
                       title=f"Glimpse task, held-out accuracy ({result['heldout_questions']} questions)")
    say("held-out accuracy")
    print(table)
    print(json.dumps({k: v for k, v in result.items() if "quarter" in k}, indent=2))
    return result


WINDOW = re.compile(r"Frames from ([0-9.]+) s to ([0-9.]+) s")


def calls_showing_answer(folder: Path, heldout: Path, data_root: Path, limits: ToolLimits) -> float | None:
    """Of the get_frames calls that ran in an evaluation's predictions, the fraction whose frames show the colour
    (the window is read back from the observation's text and decoded again as the tool decoded it). None without
    tools or calls."""
    path = folder / "predictions.jsonl"
    if not path.is_file():
        return None
    records = {r["problem_id"]: r for r in map(json.loads, heldout.read_text().splitlines())}
    shown = []
    for row in map(json.loads, path.read_text().splitlines()):
        for sample in row.get("tool_results") or []:
            for call in sample:
                window = WINDOW.match(call["observation"]) if call["error"] is None else None
                if window:
                    context = context_for(records[row["problem_id"]], data_root, limits)
                    shown.append(frames_show_colour(get_frames(context, float(window[1]), float(window[2]))[-1]))
    return sum(shown) / len(shown) if shown else None


def tool_calls_per_answer(folder: Path) -> float | None:
    """Mean tool calls per sampled answer in an evaluation's predictions (None without tools)."""
    path = folder / "predictions.jsonl"
    if not path.is_file():
        return None
    counts = [c for line in path.read_text().splitlines() if line.strip()
              for c in (json.loads(line).get("tool_calls") or [])]
    return sum(counts) / len(counts) if counts else None


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
