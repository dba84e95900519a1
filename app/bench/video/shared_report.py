"""The shared-video benchmark's report (``app.bench.video.shared_video``): the table of ratios (family over k
separate groups, the planner's FLOP ratio beside each), the JSON and the plot over k."""

from __future__ import annotations

from pathlib import Path

from app.bench.common import failed_points, markdown_table, write_report

GROUP = 8
PHASES = ("decode", "tower", "prefill", "reference", "policy")
GOALS = {"policy": 0.45, "prefill": 0.30, "decode": 0.30, "tower": 0.30}  # at k = 4, an 8k-token video


def table_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        line = {"size": r["size"], "layers": f"{r.get('layers', '')}{' ckpt' if r.get('checkpointing') else ''}", "video tokens": r.get("visual_tokens", ""),
                "question tokens": r.get("question_tokens", ""), "k": r["k"]}
        for phase in PHASES:
            if f"{phase}_family_s" in r:
                line[f"{phase} time"] = r[f"{phase}_family_s"] / max(r[f"{phase}_apart_s"], 1e-9)
                line[f"{phase} plan"] = r.get(f"planned_{phase}", "")
            if f"{phase}_family_peak_mb" in r:
                line[f"{phase} peak"] = r[f"{phase}_family_peak_mb"] / max(r[f"{phase}_apart_peak_mb"], 1e-9)
        out.append(line)
    return out


def order(row: dict) -> tuple:
    return (row["size"] != "tiny", row.get("layers") or 0, row["prefix"], row["k"])


def write(out: Path, rows: list[dict], failed: list[str], long: dict | None) -> dict:
    columns = ["size", "layers", "video tokens", "question tokens", "k"] + [f"{p} {what}" for p in PHASES
                                                        for what in ("time", "plan", "peak")
                                                        if p != "decode" or what != "peak"]
    table = ("Family of k questions on one video over k separate groups (time ratio; the planner's FLOP ratio; peak "
             "memory of the family over one separate group's)\n\n"
             + markdown_table(table_rows(sorted(rows, key=order)), columns, {c: ".3f" for c in columns[5:]}))
    if long and "runs" in long:
        table += (f"\n\nA 10-minute video at 1 fps ({long['frames']} frames, {long['visual_tokens']} visual tokens) "
                  f"through the data path: {long['seconds_one_question']:.1f} s for one question; k questions as one "
                  "run: " + ", ".join(f"k={k} {v['seconds']:.1f} s ({v['seconds'] / v['seconds_apart']:.2f}x of "
                                     f"{v['seconds_apart']:.1f} s apart)" for k, v in long["runs"].items()))
    table += failed_points(failed)
    payload = {"group_size": GROUP, "goals_at_k4_8k": GOALS, "points": rows, "long_video": long}
    write_report(out, "shared_video", payload, table, quiet=True)
    return payload


def plot(out: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = sorted({(r["size"], r.get("visual_tokens", r["prefix"])) for r in rows
                     if "policy_family_s" in r and r["size"] == "tiny"})  # curves over k: the tiny grid
    if not series:
        return
    fig, axes = plt.subplots(1, len(series), figsize=(4.5 * len(series), 3.6), squeeze=False)
    for ax, (size, tokens) in zip(axes[0], series):
        mine = sorted((r for r in rows if r["size"] == size and r.get("visual_tokens", r["prefix"]) == tokens
                       and "policy_family_s" in r), key=lambda r: r["k"])
        ks = [r["k"] for r in mine]
        for phase, colour in zip(PHASES, ("C0", "C1", "C2", "C3", "C4")):
            measured = [r for r in mine if f"{phase}_family_s" in r]  # a run of some phases only leaves gaps
            ax.plot([r["k"] for r in measured], [r[f"{phase}_family_s"] / r[f"{phase}_apart_s"] for r in measured],
                    "o-", color=colour, label=phase)
            ax.plot([r["k"] for r in measured], [r[f"planned_{phase}"] for r in measured], "--", color=colour,
                    alpha=0.5)
        ax.plot(ks, [1 / k for k in ks], ":", color="grey", label="1/k")
        ax.set_title(f"{size}, {tokens} video tokens")
        ax.set_xlabel("questions per video k")
        ax.set_ylabel("time vs k separate groups")
        ax.set_xticks(ks)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Questions sharing a video: measured (solid) and planned FLOPs (dashed)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "shared_video.png", dpi=110)
    plt.close(fig)
