"""How much `make demo`'s result varies: its GRPO over several seeds and torch thread counts, each run whole.

    python -m app.demos.spread [--seeds 0 1 2] [--threads 1 2] [--out outputs/demo_spread] [section.key=value ...]

For each seed s and thread count t, in its own folder: the demo's checkpoint and synthetic data for ``train.seed=s``
(random weights, videos and questions all follow the seed), its format-only warm start, its GRPO run
(``scripts/train.sh configs/demo_cpu.yaml``) and the held-out accuracy after it, every process on t threads
(``OMP_NUM_THREADS``; the run's own arithmetic then differs by thread count, as it does between machines). The
demo's A/B comparison is left out. Writes ``spread.json``, ``spread.md`` (one row per run: held-out accuracy before
and after GRPO, training accuracy over the last 50 steps, minutes) and ``spread.png``; reruns reuse finished runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from app.demos.video import CONFIG, ROOT, demo_paths, eval_settings, say

FLOOR = 0.8  # the held-out accuracy after GRPO every run must reach (docs/quickstart.md)


def run_one(out: Path, seed: int, threads: int, args, overrides: list[str]) -> dict:
    """One whole demo run of ``seed`` on ``threads`` threads, in a child process (its threads set before torch
    loads); its summary, read back."""
    summary = out / "result.json"
    if summary.is_file():
        return json.loads(summary.read_text())
    command = [sys.executable, "-m", "app.demos.spread", "--one",
               str(out), "--seed", str(seed), "--train-size", str(args.train_size), "--heldout-size",
               str(args.heldout_size), "--warm-steps", str(args.warm_steps), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    started = time.time()
    subprocess.run(command, check=True, env=env, cwd=ROOT)
    result = json.loads(summary.read_text())
    result.update(seed=seed, threads=threads, minutes=round((time.time() - started) / 60, 1))
    summary.write_text(json.dumps(result, indent=2))
    return result


def one(out: Path, seed: int, train_size: int, heldout_size: int, warm_steps: int, overrides: list[str]) -> None:
    """The child: prepare, GRPO, evaluate (the demo's steps 1-5) for ``train.seed=seed`` in ``out``."""
    import torch

    from app.config.loading import load_config
    from app.demos.video import launch, prepare
    from app.evaluation.evaluate import evaluate

    data = out / "data"
    _, sft, run, base = demo_paths(out, data)
    settings = [f"train.seed={seed}", *overrides]
    cfg = load_config(ROOT / CONFIG, base + settings)
    prepare(cfg, out, data, train_size=train_size, heldout_size=heldout_size, tasks=("colour", "order"),
            heldout_tasks=("order",), warm_steps=warm_steps)
    heldout = data / "heldout.jsonl"
    evals = eval_settings(cfg, max_new_tokens=32, batch_size=24)
    warm = evaluate(sft / "final", heldout, [f"eval.output_dir={out / 'eval-warm-start'}", *evals])
    say(f"GRPO, seed {seed}, {torch.get_num_threads()} thread(s)")
    if not (run / "final" / "config.json").exists():
        launch("train.sh", CONFIG, [*base, "train.resume=true", "logging.wandb_mode=disabled", *settings])
    trained = evaluate(run / "final", heldout, [f"eval.output_dir={out / 'eval-grpo'}", *evals])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    tail = [r["accuracy"] for r in rows[-50:]]
    (out / "result.json").write_text(json.dumps({
        "heldout_warm_start": warm["overall"]["accuracy"], "heldout_after_grpo": trained["overall"]["accuracy"],
        "train_accuracy_last_50": sum(tail) / len(tail), "steps": len(rows),
        "torch_threads": torch.get_num_threads()}, indent=2))


def provenance() -> dict:
    """Where the runs were made: commit, date, machine, torch."""
    import platform

    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout.strip()
    return {"commit": commit, "date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__}


def report(results: list[dict], out: Path, floor: float, overrides: list[str] = ()) -> dict:
    after = [r["heldout_after_grpo"] for r in results]
    summary = {"runs": results, "floor": floor, "min": min(after), "median": statistics.median(after),
               "max": max(after), "all_at_or_above_floor": all(a >= floor for a in after),
               "config": CONFIG, "overrides": list(overrides), "environment": provenance()}
    env = summary["environment"]
    lines = [" ".join([f"`{CONFIG}`", *overrides]) + f", commit {env['commit']}, {env['date']}", "",
             "| seed | threads | held-out: warm start | held-out: after GRPO | training accuracy, last 50 steps | "
             "minutes |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['seed']} | {r['threads']} | {r['heldout_warm_start']:.3f} | {r['heldout_after_grpo']:.3f} | "
              f"{r['train_accuracy_last_50']:.3f} | {r.get('minutes', 0):.1f} |" for r in results]
    lines += ["", f"after GRPO: min {summary['min']:.3f}, median {summary['median']:.3f}, max {summary['max']:.3f} "
              f"over {len(results)} runs; floor {floor}: {'every run reaches it' if summary['all_at_or_above_floor'] else 'NOT every run reaches it'}"]
    (out / "spread.json").write_text(json.dumps(summary, indent=2))
    (out / "spread.md").write_text("\n".join(lines) + "\n")
    plot(results, out / "spread.png", floor)
    print("\n".join(lines))
    return summary


def plot(results: list[dict], path: Path, floor: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.2, 3.4))
    labels = [f"seed {r['seed']}\n{r['threads']} thr" for r in results]
    x = range(len(results))
    ax.bar([i - 0.2 for i in x], [r["heldout_warm_start"] for r in results], width=0.4, label="warm start")
    ax.bar([i + 0.2 for i in x], [r["heldout_after_grpo"] for r in results], width=0.4, label="after GRPO")
    ax.axhline(floor, color="grey", linestyle="--", linewidth=0.8, label=f"floor {floor}")
    ax.axhline(0.25, color="grey", linestyle=":", linewidth=0.8, label="chance")
    ax.set_xticks(list(x), labels)
    ax.set_ylim(0, 1)
    ax.set_ylabel("held-out accuracy")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.set_title("make demo over seeds and thread counts")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--out", default="outputs/demo_spread")
    parser.add_argument("--train-size", type=int, default=400)
    parser.add_argument("--heldout-size", type=int, default=120)
    parser.add_argument("--warm-steps", type=int, default=60)
    parser.add_argument("--floor", type=float, default=FLOOR)
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)  # the child's own folder
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    if args.one:
        one(Path(args.one), args.seed, args.train_size, args.heldout_size, args.warm_steps, overrides)
        return None
    out = Path(args.out)
    results = []
    for seed in args.seeds:
        for threads in args.threads:
            folder = out / f"seed{seed}_threads{threads}"
            folder.mkdir(parents=True, exist_ok=True)
            say(f"seed {seed}, {threads} thread(s): {folder}")
            results.append(run_one(folder, seed, threads, args, overrides))
            report(results, out, args.floor, overrides)
    return report(results, out, args.floor, overrides)


if __name__ == "__main__":
    main()
