"""`make demo`: GRPO teaches a tiny Qwen2.5-VL to answer questions about videos, on CPU, in minutes.

1. build the tiny checkpoint (random weights; save_pretrained) and the synthetic video QA data, if missing;
2. a short format-only warm start through the SFT recipe (`scripts/sft.sh`, targets with random answer letters:
   accuracy stays at chance);
3. evaluate the untrained and the warm-started model on held-out videos;
4. GRPO with `scripts/train.sh configs/demo_cpu.yaml` (grouped attention, shared-prefix rollouts);
5. evaluate again;
6. the same GRPO for its first steps with the repeated layout (`forward.grouping=repeated`, same seed) on the
   grouped run's own rollouts (`rollout.engine=replay` of its `rollout.record`: only the training layout differs,
   so rewards are equal and loss, KL and gradient norm agree to float rounding for the whole comparison), then with
   HF generate sampling its own (`rollout.engine=hf`: the baseline's whole cost; the same sampler on logits that
   agree to float rounding, so its rewards match until rounding flips a draw): one figure overlays the curves and
   compares seconds per step;
7. print the before/after table; write PNG plots.

Re-running reuses what is already there (an interrupted training resumes); `--fresh` starts over.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from app.config.loading import load_config
from app.data.synthetic import generate
from app.evaluation.evaluate import evaluate
from app.runtime.models import TinySizes, build_tiny_checkpoint
from app.runtime.plots import plot_ab, plot_accuracy_bars, plot_training

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/demo_cpu.yaml"
DEMO_SIZES = TinySizes(init_std=0.1)  # a larger init than transformers' 0.02 so the random model is not uniform
FORMAT_REASONING = "<think>I look at the video and the options.</think>"


REPLAYED = "repeated layout, same rollouts"  # the like-with-like A/B: only the training layout differs
HF = "repeated + HF generate"  # the baseline's whole cost; it samples its own rollouts


def format_only_sft_data(train: Path, out: Path, seed: int) -> Path:
    """The training records with SFT targets that teach the answer FORMAT only: the same reasoning sentence and an
    option letter drawn at random, independent of the video (so accuracy stays at chance; any gain is GRPO's)."""
    import random

    rng = random.Random(seed)
    lines = []
    for line in train.read_text().splitlines():
        record = json.loads(line)
        letter = "ABCDEFGHIJ"[rng.randrange(len(record.get("options") or "ABCD"))]
        lines.append(json.dumps({**record, "process": FORMAT_REASONING, "solution": f"<answer>{letter}</answer>"}))
    out.write_text("\n".join(lines) + "\n")
    return out


def say(text: str) -> None:
    print(f"\n== {text}", flush=True)


# The warm start's settings (a few hundred small steps, no checkpoints but the export; resumable), shared by the demos.
# Its schedule is its own: cosine to zero, whatever the GRPO config's train.min_lr_ratio.
WARM_START = ["train.learning_rate=2e-3", "train.warmup_steps=0", "train.min_lr_ratio=0.0", "train.save_every=0",
              "train.resume=true", "logging.wandb_mode=disabled", "logging.sample_table_every=0"]


def launch(script: str, config: str, overrides: list[str], nproc: int = 1) -> None:
    """``scripts/<script> CONFIG overrides`` as a user runs it, on ``nproc`` processes; stops the demo if it fails."""
    command = ["bash", str(ROOT / "scripts" / script), str(ROOT / config), *overrides]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True, env={**os.environ, "NPROC_PER_NODE": str(nproc)})


def demo_paths(out: Path, data: Path, family: str = "qwen2_5_vl") -> tuple[Path, Path, Path, list[str]]:
    """The demo's folders (tiny checkpoint of ``family``, warm start, GRPO run) and the overrides that point a config
    at them."""
    init, sft, run = out / f"tiny-{family}", out / "sft", out / "run"
    base = [f"model.path={sft / 'final'}", f"data.train_file={data / 'train.jsonl'}", f"train.output_dir={run}"]
    return init, sft, run, base


def eval_settings(cfg, *, max_new_tokens: int, batch_size: int) -> list[str]:
    """Evaluation overrides that see the prompts as training did: frames, pixels, prompt template, system prompt."""
    out = [f"data.{k}={getattr(cfg.data, k)}" for k in ("fps", "max_frames", "min_pixels", "max_pixels")]
    return out + [f"data.system_prompt={cfg.data.system_prompt}", f"data.prompt_template={cfg.data.prompt_template}",
                  f"eval.max_new_tokens={max_new_tokens}", f"eval.batch_size={batch_size}"]


def prepare(cfg, out: Path, data: Path, *, train_size: int, heldout_size: int, tasks: tuple[str, ...],
            heldout_tasks: tuple[str, ...], warm_steps: int) -> None:
    """Steps 1 and 2, each skipped when its output exists: the tiny checkpoint, the synthetic data (training mixes
    ``tasks``, a curriculum; held-out questions are ``heldout_tasks`` on videos never seen in training) and the
    format-only warm start (``scripts/sft.sh``)."""
    init, sft, _, _ = demo_paths(out, data)
    say("1. tiny checkpoint and synthetic video QA data")
    if not (init / "config.json").exists():
        build_tiny_checkpoint(init, "qwen2_5_vl", seed=cfg.train.seed, sizes=DEMO_SIZES)
    if not (data / "meta.json").exists():
        generate(data, train=train_size, heldout=heldout_size, seed=cfg.train.seed, tasks=tasks,
                 heldout_tasks=heldout_tasks, shuffle_options=False)
    print(f"checkpoint {init}; data {data} (held-out questions use videos never seen in training)")
    say("2. format-only warm start: scripts/sft.sh (answer letters drawn at random)")
    if not (sft / "final" / "config.json").exists():
        targets = format_only_sft_data(data / "train.jsonl", out / "sft_format_only.jsonl", cfg.train.seed)
        launch("sft.sh", CONFIG, [f"model.path={init}", f"data.train_file={targets}", f"data.data_root={data}",
                                  f"train.output_dir={sft}", f"train.max_steps={warm_steps}",
                                  "train.prompts_per_rank=8", "train.groups_per_micro_batch=8", *WARM_START])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/demo")
    parser.add_argument("--data", default="data/synthetic")
    parser.add_argument("--fresh", action="store_true", help="delete earlier demo outputs first")
    parser.add_argument("--nproc", type=int, default=int(os.environ.get("NPROC_PER_NODE", "1")))
    parser.add_argument("--train-size", type=int, default=400)
    parser.add_argument("--heldout-size", type=int, default=120)
    parser.add_argument("--warm-steps", type=int, default=60)
    parser.add_argument("--mix", nargs="*", default=["colour"], help="tasks mixed into training (a curriculum)")
    parser.add_argument("--ab-steps", type=int, default=30, help="steps of the grouped-vs-repeated comparison runs")
    parser.add_argument("--task", default="order", choices=("order", "motion", "colour", "direction", "count"),
                        help="order: which of two colours, shown one after the other, appears first (needs time)")
    parser.add_argument("overrides", nargs="*", help="extra section.key=value for the training config")
    args = parser.parse_args(argv)
    out, data = Path(args.out), Path(args.data)
    if args.fresh:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    timings = {}

    init, sft, run, base = demo_paths(out, data)
    warm = sft / "final"
    cfg = load_config(ROOT / CONFIG, base + args.overrides)
    t = time.time()
    prepare(cfg, out, data, train_size=args.train_size, heldout_size=args.heldout_size,
            tasks=tuple(args.mix) + (args.task,), heldout_tasks=(args.task,), warm_steps=args.warm_steps)
    timings["warm_start_s"] = time.time() - t
    heldout = data / "heldout.jsonl"

    eval_overrides = eval_settings(cfg, max_new_tokens=32, batch_size=24)

    def held_out(model_dir: Path, name: str) -> dict:
        return evaluate(model_dir, heldout, [f"eval.output_dir={out / ('eval-' + name)}", *eval_overrides])

    say("3. held-out accuracy before GRPO")
    t = time.time()
    untrained, warmed = held_out(init, "untrained"), held_out(warm, "warm-start")
    timings["eval_before_s"] = time.time() - t

    say(f"4. GRPO: scripts/train.sh {CONFIG} (NPROC_PER_NODE={args.nproc})")
    t = time.time()
    if not (run / "final" / "config.json").exists():
        launch("train.sh", CONFIG, [*base, "train.resume=true", "rollout.record=true", *args.overrides],  # its
               args.nproc)  # rollouts, for the A/B's replay
    timings["grpo_s"] = time.time() - t

    say("5. held-out accuracy after GRPO")
    t = time.time()
    trained = held_out(run / "final", "grpo")
    timings["eval_after_s"] = time.time() - t

    say(f"6. A/B: the first {args.ab_steps} steps again with forward.grouping=repeated on the grouped run's own "
        "rollouts (rollout.engine=replay), then with HF generate sampling its own")
    t = time.time()
    ab_runs = {"grouped (Prefix Grouper)": run}
    for name, folder, engine in ((REPLAYED, "run-repeated", ["rollout.engine=replay", f"rollout.replay_dir={run}"]),
                                 (HF, "run-repeated-hf", ["rollout.engine=hf"])):
        ab = out / folder
        if not (ab / "final" / "config.json").exists():
            launch("train.sh", CONFIG, [*base, *args.overrides, f"train.output_dir={ab}", "forward.grouping=repeated",
                                        "rollout.record=false", *engine, f"train.stop_at_step={args.ab_steps}",
                                        "train.resume=true"], args.nproc)
        ab_runs[name] = ab
    timings["ab_repeated_s"] = time.time() - t
    comparison = plot_ab({name: folder / "metrics.jsonl" for name, folder in ab_runs.items()}, args.ab_steps,
                         out / "grouped_vs_repeated.png",
                         title=f"The same GRPO, first {args.ab_steps} steps: grouped vs repeated")
    comparison["max_reward_difference"] = comparison["runs"][REPLAYED]["max_reward_difference"]  # 0 by construction
    comparison["max_relative_difference"] = comparison["runs"][REPLAYED]["max_relative_difference"]

    chance = 0.25
    rows = [("untrained", untrained), ("format warm start", warmed), ("after GRPO", trained)]
    sources = sorted(trained["by_data_source"])
    header = f"| model | held-out accuracy | {' | '.join(sources)} |"
    lines = [header, "|" + "---|" * (2 + len(sources))]
    for name, summary in rows:
        per = " | ".join(f"{summary['by_data_source'].get(s, {}).get('accuracy', 0):.3f}" for s in sources)
        lines.append(f"| {name} | {summary['overall']['accuracy']:.3f} | {per} |")
    lines += ["", f"| first {comparison['steps']} steps | seconds per step | training seconds per step | largest "
              "reward difference | largest relative loss / KL / grad-norm difference |", "|---|---|---|---|---|"]
    for name, numbers in comparison["runs"].items():
        lines.append(f"| {name} | {numbers['seconds_per_step']:.2f} ({numbers['ratio']:.2f}x) | "
                     f"{numbers['training_seconds_per_step']:.2f} ({numbers['training_ratio']:.2f}x) | "
                     f"{numbers['max_reward_difference']:.3g} | {numbers['max_relative_difference']:.2g} |")
    table = "\n".join(lines)
    plot_training(run / "metrics.jsonl", out / "training_curves.png", title="GRPO on synthetic video QA (tiny Qwen2.5-VL, CPU)")
    plot_accuracy_bars({name: s["overall"]["accuracy"] for name, s in rows}, out / "heldout_accuracy.png",
                       chance=chance, title=f"Held-out accuracy ({trained['overall']['count']} questions)")
    result = {
        "heldout_questions": trained["overall"]["count"], "chance": chance,
        "accuracy": {name: s["overall"]["accuracy"] for name, s in rows},
        "gain_over_untrained": trained["overall"]["accuracy"] - untrained["overall"]["accuracy"],
        "gain_over_warm_start": trained["overall"]["accuracy"] - warmed["overall"]["accuracy"],
        "timings_s": {k: round(v, 1) for k, v in timings.items()}, "total_s": round(time.time() - started, 1),
        "ab": comparison, "task": args.task,
    }
    (out / "demo_summary.json").write_text(json.dumps(result, indent=2))
    (out / "demo_summary.md").write_text(table + "\n")
    say("before / after")
    print(table)
    print(f"\nchance {chance:.2f}; gain over untrained {result['gain_over_untrained']:+.3f}, over the warm start "
          f"{result['gain_over_warm_start']:+.3f}; {result['heldout_questions']} held-out questions")
    same, hf = comparison["runs"][REPLAYED], comparison["runs"][HF]
    print(f"over the first {comparison['steps']} steps: the repeated layout on the same rollouts trained with loss, KL "
          f"and gradient norm within {same['max_relative_difference']:.2g} (relative) of the grouped run's, in "
          f"{same['training_ratio']:.2f}x its training seconds; repeated + HF generate took {hf['ratio']:.2f}x the "
          f"seconds per step, its own draws within {hf['max_reward_difference']:.2g} of the grouped run's rewards")
    print(f"plots: {out / 'training_curves.png'}, {out / 'heldout_accuracy.png'}, {out / 'grouped_vs_repeated.png'}; "
          f"total {result['total_s']:.0f} s")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
