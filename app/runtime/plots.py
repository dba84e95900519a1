"""PNG plots from the metrics JSONL (training curves) and from evaluation summaries.

    python -m app.runtime.plots outputs/demo/run/metrics.jsonl outputs/demo/training_curves.png

A mixture-of-experts run's router/* metrics go beside it (``training_curves_router.png``), and a routing-replay
run's agreement and mismatch (``training_curves_replay.png``).
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


def router_png(out_png: str | Path) -> Path:
    """Where ``plot_training`` puts a mixture-of-experts run's router curves: beside its curves, ``*_router.png``."""
    out = Path(out_png)
    return out.with_name(f"{out.stem}_router{out.suffix or '.png'}")


def plot_router(metrics_path: str | Path, out_png: str | Path, title: str = "Routers") -> Path | None:
    """A mixture-of-experts run's router/* metrics: each sparse layer's expert load (max over mean tokens per
    expert; 1 is balanced), its mean entropy per token, and the load-balancing loss. None for a dense run."""
    rows = [r for r in read_metrics(metrics_path) if "router/aux_loss" in r]
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    layers = sorted({k.rsplit("_", 1)[1] for r in rows for k in r if k.startswith("router/entropy/layer_")})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
    for ax, (key, label) in zip(axes[:2], (("load_max_over_mean", "expert load, max / mean"),
                                           ("entropy", "router entropy (nats)"))):
        for layer in layers:
            ax.plot(steps, [r.get(f"router/{key}/layer_{layer}", float("nan")) for r in rows], linewidth=0.8,
                    alpha=0.6)
        ax.plot(steps, [r[f"router/{key}"] for r in rows], color="black", linewidth=2,
                label="worst layer" if key == "load_max_over_mean" else "mean over layers")
        ax.set_title(f"{label}: {len(layers)} layers")
        ax.legend(loc="best", fontsize=8)
    axes[2].plot(steps, [r["router/aux_loss"] for r in rows], color="#08519c", linewidth=2)
    axes[2].set_title("load-balancing loss (top_k when balanced)")
    return _finished(fig, axes, title, out_png)


def _finished(fig, axes, title: str, out_png) -> Path:
    """A row of per-step panels labelled, titled, written and closed."""
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.ticklabel_format(axis="y", useOffset=False)
    fig.suptitle(title)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return Path(out_png)


def replay_png(out_png: str | Path) -> Path:
    """Where a routing-replay run's curves go: beside the training curves, ``*_replay.png``."""
    out = Path(out_png)
    return out.with_name(f"{out.stem}_replay{out.suffix or '.png'}")


def plot_replay(metrics_path: str | Path, out_png: str | Path, title: str = "Routing replay") -> Path | None:
    """A run with rollout.routing_replay=r3: the fraction of replayed tokens the update's routers would have sent
    elsewhere (routing/replay_differs) beside the rollout-against-update mismatch (mismatch/*). None without it."""
    rows = [r for r in read_metrics(metrics_path) if "routing/replay_differs" in r]
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
    for ax, (key, label) in zip(axes, (("routing/replay_differs", "replayed tokens the update would route elsewhere"),
                                       ("mismatch/mean_abs_logprob_diff", "mean |rollout - update| log-prob"),
                                       ("mismatch/max_ratio", "largest exp|rollout - update| log-prob"))):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], color="#08519c", linewidth=2, marker="o",
                markersize=3)
        ax.set_title(label, fontsize=10)
    return _finished(fig, axes, title, out_png)


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


AB_STYLES = [dict(color="#08519c", linewidth=2.5), dict(color="#fd8d3c", linewidth=1.2, linestyle="--", marker="."),
             dict(color="#31a354", linewidth=1.0, linestyle=":", marker="x")]


def plot_ab(runs_metrics: dict[str, str | Path], steps: int, out_png: str | Path,
            title: str = "Same GRPO, two layouts") -> dict:
    """The product's claim in one picture: reward and accuracy of several runs of the same GRPO over their first
    ``steps`` steps (the first is the reference: grouped), and the mean seconds per step of each (the first step,
    which runs the one-off self-check, left out). Returns per run its seconds per step, its ratio to the first
    run's, and its largest per-step reward difference from the first run."""
    runs = {name: read_metrics(path)[:steps] for name, path in runs_metrics.items()}
    seconds = {name: sum(r["time/step"] for r in rows[1:]) / max(1, len(rows) - 1) for name, rows in runs.items()}
    names = list(runs)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
    for ax, (key, label) in zip(axes[:2], (("reward/mean", "reward (mean)"), ("accuracy", "accuracy (training)"))):
        for name, style in zip(names, AB_STYLES):
            rows = runs[name]
            ax.plot([r["step"] for r in rows], [r.get(key, float("nan")) for r in rows], label=name, **style)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    bars = axes[2].bar([n.replace(" + ", "\n+ ").replace(" (", "\n(") for n in names], [seconds[n] for n in names],
                       color=[style["color"] for style in AB_STYLES[:len(names)]])
    for bar, name in zip(bars, names):
        axes[2].text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{seconds[name]:.2f} s", ha="center",
                     va="bottom")
    axes[2].set_ylim(0, 1.2 * max(seconds.values()))
    axes[2].set_title("seconds per step")
    fig.suptitle(title)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    first = runs[names[0]]
    training = {name: sum(r["time/reference"] + r["time/policy"] for r in rows[1:]) / max(1, len(rows) - 1)
                for name, rows in runs.items()}
    out = {"steps": min(len(rows) for rows in runs.values()), "runs": {}}
    for name in names:
        pairs = list(zip(first, runs[name]))
        worst = max((abs(a.get("reward/mean", 0) - b.get("reward/mean", 0)) for a, b in pairs), default=0.0)
        # relative to the value, or to 1e-3 for values near 0 (the first step's loss is ~1e-9)
        relative = max((abs(a[k] - b[k]) / max(abs(a[k]), 1e-3) for a, b in pairs for k in ("loss", "kl", "grad_norm")
                        if k in a and k in b), default=0.0)
        out["runs"][name] = {"seconds_per_step": seconds[name], "ratio": seconds[name] / max(seconds[names[0]], 1e-9),
                             "training_seconds_per_step": training[name],
                             "training_ratio": training[name] / max(training[names[0]], 1e-9),
                             "max_reward_difference": worst, "max_relative_difference": relative}
    return out


def plot_reward_curves(runs: dict[str, list[dict]], out_png: str | Path, title: str) -> Path:
    """The mean reward of several runs (their metrics rows) over their steps, smoothed, on one axis."""
    fig, ax = plt.subplots(figsize=(8, 4.5), constrained_layout=True)
    for name, rows in runs.items():
        steps = [r["step"] for r in rows]
        ax.plot(steps, smooth([r["reward/mean"] for r in rows], max(1, len(rows) // 15)), label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("reward (mean, smoothed)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: python -m app.runtime.plots METRICS.jsonl OUT.png")
    print(plot_training(argv[0], argv[1]))
    router = plot_router(argv[0], router_png(argv[1]))  # a mixture-of-experts run: its routers beside
    if router is not None:
        print(router)
    replay = plot_replay(argv[0], replay_png(argv[1]))  # rollout.routing_replay=r3: routing agreement, mismatch
    if replay is not None:
        print(replay)


if __name__ == "__main__":
    main()
