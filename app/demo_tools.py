"""The tool-needing demo: a tiny Qwen2.5-VL learns, on CPU, to answer a question whose answer only a tool call shows.

    python -m app.demo_tools [--fresh] [--steps N] [section.key=value ...]

The task (``app.data.synthetic``, ``glimpse``): an 8 s clip in which, for two seconds at a random time, a white bar
lines the top and a 4-pixel coloured square sits below it; the question asks the square's colour. The overview the
prompt holds (``configs/demo_tools_cpu.yaml``: 8 frames of 28 x 28 pixels) shows the bar but hardly the colour;
``get_frames`` returns up to 4 frames of the asked window at 112 x 112, where the square is whole.

1. build the tiny checkpoint and the data, if missing;
2. a format-only warm start through SFT with tools (``scripts/sft.sh`` with ``rollout.tools``, ``app.agent_sft``):
   each record's written trajectory is a ``get_frames`` call on a random two-second window (the call runs, its
   frames become the next turn), then an answer with a random letter: the form of a tool-using answer, not where
   to look nor the colour (accuracy stays at chance);
3. held-out accuracy of the untrained model and of the warm start, without tools and with them;
4. GRPO with tools (``scripts/train.sh configs/demo_tools_cpu.yaml``: multi-turn rollouts as prefix trees);
5. held-out accuracy after GRPO, with tools; a table (``demo_summary.md``), JSON and a bar plot.

What the run shows is written as measured, gain or none. Re-running reuses what is there; ``--fresh`` starts over.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

from app.config import load_config
from app.data.synthetic import generate
from app.demo import DEMO_SIZES, FORMAT_REASONING, ROOT, WARM_START, demo_paths, eval_settings, launch, say
from app.evaluate import evaluate
from app.models import build_tiny_checkpoint
from app.plots import plot_accuracy_bars

CONFIG = "configs/demo_tools_cpu.yaml"
CALL_REASONING = "<think>Look closer.</think>"  # short: the tiny tokenizer spells a call in about 70 tokens


def call_text(start: float, end: float) -> str:
    """A ``get_frames`` call as the model writes it (Qwen's function-call form; compact JSON, whole seconds, the
    tool's default 2 fps)."""
    arguments = {"start": round(start), "end": round(end)}
    return "<tool_call>" + json.dumps({"name": "get_frames", "arguments": arguments}, separators=(",", ":")) \
        + "</tool_call>"


def call_syntax_sft_data(train: Path, out: Path, seed: int) -> Path:
    """The training records with written trajectories (``turns``, for SFT with tools) that teach the FORM only: a
    ``get_frames`` call on a random two-second window (not the record's), then an answer with a random letter;
    neither depends on the video."""
    rng = random.Random(seed)
    lines = []
    for line in train.read_text().splitlines():
        record = json.loads(line)
        start = rng.uniform(0.0, float(record.get("duration", 8.0)) - 2.0)
        turns = [f"{CALL_REASONING}\n{call_text(start, start + 2.0)}",
                 f"{FORMAT_REASONING}\n<answer>{'ABCD'[rng.randrange(4)]}</answer>"]
        lines.append(json.dumps({**record, "turns": turns}))
    out.write_text("\n".join(lines) + "\n")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/demo_tools")
    parser.add_argument("--data", default="data/synthetic_tools")
    parser.add_argument("--fresh", action="store_true", help="delete earlier outputs of this demo first")
    parser.add_argument("--train-size", type=int, default=240)
    parser.add_argument("--heldout-size", type=int, default=60)
    parser.add_argument("--warm-steps", type=int, default=300)
    parser.add_argument("overrides", nargs="*", help="extra section.key=value for the GRPO config")
    args = parser.parse_args(argv)
    out, data = Path(args.out), Path(args.data)
    if args.fresh:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    started, timings = time.time(), {}
    init, sft, run, base = demo_paths(out, data)
    warm = sft / "final"
    cfg = load_config(ROOT / CONFIG, base + args.overrides)

    say("1. tiny checkpoint and the glimpse task (the answer shows only through get_frames)")
    if not (init / "config.json").exists():
        build_tiny_checkpoint(init, "qwen2_5_vl", seed=cfg.train.seed, sizes=DEMO_SIZES)
    if not (data / "meta.json").exists():
        generate(data, train=args.train_size, heldout=args.heldout_size, seed=cfg.train.seed, tasks=("glimpse",),
                 frames=32, size=112, fps=4, shuffle_options=False)
    heldout = data / "heldout.jsonl"

    say("2. format-only warm start: scripts/sft.sh with tools (a call on a random window, then a random letter)")
    t = time.time()
    if not (warm / "config.json").exists():
        targets = call_syntax_sft_data(data / "train.jsonl", out / "sft_call_syntax.jsonl", cfg.train.seed)
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
        return {**summary, "tool_calls_per_answer": tool_calls_per_answer(folder)}

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
    lines = ["| model | held-out accuracy | tool calls per answer |", "|---|---|---|"]
    result = {"heldout_questions": after["overall"]["count"], "chance": 0.25, "accuracy": {}, "tool_calls": {},
              "timings_s": {k: round(v, 1) for k, v in timings.items()}}
    for name, summary in rows:
        calls = summary["tool_calls_per_answer"]
        result["accuracy"][name] = summary["overall"]["accuracy"]
        result["tool_calls"][name] = calls
        lines.append(f"| {name} | {summary['overall']['accuracy']:.3f} | "
                     f"{'-' if calls is None else f'{calls:.2f}'} |")
    first, last = metrics[: len(metrics) // 4 or 1], metrics[-(len(metrics) // 4 or 1):]
    for key in ("reward/accuracy", "tools/valid", "tools/calls"):
        if key in metrics[0]:
            result[f"{key} first quarter"] = sum(m[key] for m in first) / len(first)
            result[f"{key} last quarter"] = sum(m[key] for m in last) / len(last)
    result["total_s"] = round(time.time() - started, 1)
    table = "\n".join(lines)
    (out / "demo_summary.json").write_text(json.dumps(result, indent=2))
    (out / "demo_summary.md").write_text(table + "\n")
    plot_accuracy_bars(result["accuracy"], out / "heldout_accuracy.png", chance=0.25,
                       title=f"Glimpse task, held-out accuracy ({result['heldout_questions']} questions)")
    say("held-out accuracy")
    print(table)
    print(json.dumps({k: v for k, v in result.items() if "quarter" in k}, indent=2))
    return result


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
