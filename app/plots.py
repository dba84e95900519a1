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


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: python -m app.plots METRICS.jsonl OUT.png")
    print(plot_training(argv[0], argv[1]))


if __name__ == "__main__":
    main()
