"""PNG plots from the metrics JSONL (training curves) and from evaluation summaries.

    python -m app.plots outputs/demo/run/metrics.jsonl outputs/demo/training_curves.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CURVES = (("reward/mean", "reward (mean)"), ("accuracy", "accuracy (training samples)"), ("kl", "KL to reference"),
          ("completion_length", "completion length (tokens)"))


def read_metrics(path: str | Path) -> list[dict]:
    rows = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["step"]] = row  # a resumed run re-logs steps: keep the last
    return [rows[k] for k in sorted(rows)]


def smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_training(metrics_path: str | Path, out_png: str | Path, title: str = "GRPO training") -> Path:
    rows = read_metrics(metrics_path)
    steps = [r["step"] for r in rows]
    window = max(1, len(rows) // 30)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    for ax, (key, label) in zip(axes.flat, CURVES):
        values = [r.get(key, float("nan")) for r in rows]
        ax.plot(steps, values, color="#9ecae1", linewidth=0.8, label="per step")
        ax.plot(steps, smooth(values, window), color="#08519c", linewidth=2, label=f"mean of {window}")
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(loc="lower right")
    fig.suptitle(title)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return Path(out_png)


def plot_accuracy_bars(values: dict[str, float], out_png: str | Path, chance: float | None = None,
                       title: str = "Held-out accuracy") -> Path:
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    names = list(values)
    bars = ax.bar(names, [values[n] for n in names], color=["#bdbdbd", "#9ecae1", "#08519c"][: len(names)])
    for bar, name in zip(bars, names):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.01, f"{values[name]:.2f}", ha="center")
    if chance is not None:
        ax.axhline(chance, color="#d62728", linestyle="--", label=f"chance ({chance:.2f})")
        ax.legend(loc="upper left")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return Path(out_png)


def plot_ab(grouped_metrics: str | Path, repeated_metrics: str | Path, steps: int, out_png: str | Path,
            title: str = "Same GRPO, two layouts") -> dict:
    """The product's claim in one picture: reward and accuracy of the grouped run and of the repeated + HF-generate
    run over their first ``steps`` steps (same seed: the curves should coincide up to float rounding), and the mean
    seconds per step of each (the first step, which runs the one-off self-check, left out). Returns the numbers."""
    runs = {"grouped (Prefix Grouper)": read_metrics(grouped_metrics)[:steps],
            "repeated + HF generate": read_metrics(repeated_metrics)[:steps]}
    seconds = {name: sum(r["time/step"] for r in rows[1:]) / max(1, len(rows) - 1) for name, rows in runs.items()}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
    styles = {"grouped (Prefix Grouper)": dict(color="#08519c", linewidth=2.5),
              "repeated + HF generate": dict(color="#fd8d3c", linewidth=1.2, linestyle="--", marker=".")}
    for ax, (key, label) in zip(axes[:2], (("reward/mean", "reward (mean)"), ("accuracy", "accuracy (training)"))):
        for name, rows in runs.items():
            ax.plot([r["step"] for r in rows], [r.get(key, float("nan")) for r in rows], label=name, **styles[name])
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right")
    names = list(runs)
    bars = axes[2].bar(["grouped", "repeated\n+ HF generate"], [seconds[n] for n in names],
                       color=["#08519c", "#fd8d3c"])
    ratio = seconds[names[1]] / max(seconds[names[0]], 1e-9)
    for bar, name in zip(bars, names):
        axes[2].text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{seconds[name]:.2f} s", ha="center",
                     va="bottom")
    axes[2].set_ylim(0, 1.2 * max(seconds.values()))
    axes[2].set_title(f"seconds per step (repeated / grouped = {ratio:.2f}x)")
    fig.suptitle(title)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    grouped, repeated = (runs[n] for n in names)
    worst = max((abs(a.get("reward/mean", 0) - b.get("reward/mean", 0)) for a, b in zip(grouped, repeated)),
                default=0.0)
    return {"seconds_per_step": {"grouped": seconds[names[0]], "repeated_hf": seconds[names[1]]}, "ratio": ratio,
            "steps": min(len(grouped), len(repeated)), "max_reward_difference": worst}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: python -m app.plots METRICS.jsonl OUT.png")
    print(plot_training(argv[0], argv[1]))


if __name__ == "__main__":
    main()
