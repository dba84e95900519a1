"""Each policy objective on the demo: the same GRPO run with ``grpo.policy_loss`` = clip, gspo, gspo_token, cispo,
sapo, side by side.

    python -m app.demos.objectives [--steps N] [--iterations MU] [--fresh] [section.key=value ...]

It reuses ``make demo``'s tiny checkpoint, data and format warm start (``app.demos.video.prepare`` builds what is missing),
then runs ``scripts/train.sh configs/demo_cpu.yaml`` once per objective from that warm start with the same seed, for
N steps of MU update passes each (MU > 1, so the ratios leave 1 and each objective's clipping or gating acts), and
evaluates each result on the held-out videos. Each objective runs with its paper's settings where the paper fixes
them (``OBJECTIVES``); everything else is the demo's. Writes ``objectives_summary.md`` / ``.json`` (training reward
over the first and last tenth of the steps, the ratio statistics and clip fractions the trainer logs, held-out
accuracy, seconds per step) and ``objectives_reward.png`` (the reward curves overlaid). Re-running reuses finished
runs and resumes interrupted ones; ``--fresh`` starts the objective runs over (not the warm start).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from app.config.loading import load_config
from app.demos.video import CONFIG, ROOT, demo_paths, eval_settings, launch, prepare, say
from app.evaluation.evaluate import evaluate
from app.runtime.plots import plot_reward_curves, read_metrics

# Each objective's settings beside the demo's: none, so selecting it gives it its source's epsilons and loss type
# (app.objectives.grpo.OBJECTIVE_DEFAULTS; docs/grpo.md has the sources); SAPO's temperatures are the config's (1.0 /
# 1.05, its paper's). The values that ran are resolved from the config and written beside each result.
OBJECTIVES = {"clip": [], "gspo": [], "gspo_token": [], "cispo": [], "sapo": []}


def resolved(cfg) -> dict:
    """What the loss of a run of ``cfg`` uses (``LossOptions.settings``: the objective's source values unless set)."""
    return cfg.grpo.to_options(cfg.rollout.max_completion_length, cfg.rollout.engine).settings()


def tenth_means(rows: list[dict], key: str) -> tuple[float, float]:
    """The mean of ``key`` over the first and over the last tenth of the steps (at least one step each)."""
    values = [r[key] for r in rows if key in r]
    if not values:
        return float("nan"), float("nan")
    n = max(1, len(values) // 10)
    return sum(values[:n]) / n, sum(values[-n:]) / n


def summarise(rows: list[dict]) -> dict:
    """One run's figures from its metrics.jsonl rows: reward at the start and end, the ratio's range over the run,
    its mean and the clip fractions averaged over steps, seconds per step (the first step, with the self-check, left
    out)."""
    first, last = tenth_means(rows, "reward/mean")
    mean = lambda key: sum(r.get(key, 0.0) for r in rows) / max(1, len(rows))  # noqa: E731
    return {"steps": len(rows), "reward_first_tenth": first, "reward_last_tenth": last,
            "ratio_min": min(r.get("ratio/min", 1.0) for r in rows), "ratio_max": max(r.get("ratio/max", 1.0) for r in rows),
            "ratio_mean": mean("ratio/mean"), "clip_fraction_low": mean("clip_fraction_low"),
            "clip_fraction_high": mean("clip_fraction_high"),
            "seconds_per_step": sum(r["time/step"] for r in rows[1:]) / max(1, len(rows) - 1)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/demo", help="make demo's folder (its warm start is reused)")
    parser.add_argument("--data", default="data/synthetic")
    parser.add_argument("--train-size", type=int, default=400, help="as make demo's (used only to build it)")
    parser.add_argument("--heldout-size", type=int, default=120)
    parser.add_argument("--warm-steps", type=int, default=60)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--iterations", type=int, default=2, help="grpo.num_iterations (mu): update passes per step")
    parser.add_argument("--objectives", nargs="*", default=list(OBJECTIVES), choices=list(OBJECTIVES))
    parser.add_argument("--fresh", action="store_true", help="start the objective runs over (not the warm start)")
    parser.add_argument("overrides", nargs="*", help="extra section.key=value for every run")
    args = parser.parse_args(argv)
    out, data = Path(args.out), Path(args.data)
    runs_dir = out / "objectives"
    if args.fresh:
        shutil.rmtree(runs_dir, ignore_errors=True)
    runs_dir.mkdir(parents=True, exist_ok=True)
    _, _, _, base = demo_paths(out, data)
    cfg = load_config(ROOT / CONFIG, base + args.overrides)
    prepare(cfg, out, data, train_size=args.train_size, heldout_size=args.heldout_size, tasks=("colour", "order"),
            heldout_tasks=("order",), warm_steps=args.warm_steps)
    settings = eval_settings(cfg, max_new_tokens=32, batch_size=24)
    started, results, curves = time.time(), {}, {}
    for name in args.objectives:
        folder = runs_dir / name
        say(f"{name}: scripts/train.sh {CONFIG} grpo.policy_loss={name} {' '.join(OBJECTIVES[name])}")
        if not (folder / "final" / "config.json").exists():
            launch("train.sh", CONFIG, [*base, f"train.output_dir={folder}", f"grpo.policy_loss={name}",
                                        f"grpo.num_iterations={args.iterations}", f"train.max_steps={args.steps}",
                                        "train.save_every=50", "train.resume=true", "logging.wandb_mode=disabled",
                                        "logging.sample_table_every=0", *OBJECTIVES[name], *args.overrides])
        curves[name] = read_metrics(folder / "metrics.jsonl")
        heldout = evaluate(folder / "final", data / "heldout.jsonl",
                           [f"eval.output_dir={runs_dir / ('eval-' + name)}", *settings])
        ran = resolved(load_config(ROOT / CONFIG, [*base, f"grpo.policy_loss={name}", *OBJECTIVES[name],
                                                   *args.overrides]))
        results[name] = {**summarise(curves[name]), "heldout_accuracy": heldout["overall"]["accuracy"],
                         "settings": ran}
    lines = ["| objective | reward, first / last tenth | ratio min / mean / max | clip fraction low / high | "
             "held-out accuracy | s / step |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        ran = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in r["settings"].items())
        lines.append(f"| `{name}` ({ran}) | {r['reward_first_tenth']:.3f} / {r['reward_last_tenth']:.3f}"
                     f" | {r['ratio_min']:.3f} / {r['ratio_mean']:.4f} / {r['ratio_max']:.3f} | "
                     f"{r['clip_fraction_low']:.3f} / {r['clip_fraction_high']:.3f} | {r['heldout_accuracy']:.3f} | "
                     f"{r['seconds_per_step']:.2f} |")
    table = "\n".join(lines)
    plot_reward_curves(curves, runs_dir / "objectives_reward.png",
                 title=f"Each policy objective on the demo ({args.steps} steps, mu = {args.iterations})")
    summary = {"steps": args.steps, "num_iterations": args.iterations, "objectives": results,
               "total_s": round(time.time() - started, 1)}
    (runs_dir / "objectives_summary.json").write_text(json.dumps(summary, indent=2))
    (runs_dir / "objectives_summary.md").write_text(table + "\n")
    say("each objective, same warm start and seed")
    print(table)
    print(f"plot: {runs_dir / 'objectives_reward.png'}; total {summary['total_s']:.0f} s")
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
