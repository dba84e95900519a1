"""The planner's step time fitted to the committed GPU measurements, and checked against them.

    python -m app.bench.planning.calibrate --out docs/bench/planner_calibration [--points docs/gpu/points.json]

Reads ``docs/gpu/points.json`` (each measured point with its source, configuration and per-phase seconds and CUDA
peaks). The decode constants come from the decode steps measured alone (weights at the card's copy bandwidth; the
K/V's share and the per-layer launch cost from the 8k and 16k steps, graph and eager). The others are fitted to the
points' rollout, reference and update times at once: the largest ratio between planned and measured, over every
phase of every point, made as small as it goes (a seeded search over the constants in log space). Prints the
constants (``app/planning/timing.py``'s ``Calibration`` holds them, rounded) and a table of every phase, the step
and the memory, planned against measured, and writes JSON + markdown. No GPU needed: the points are data.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict
from pathlib import Path

from app.bench.common import markdown_table, write_report

FITTED = ("prefill_efficiency", "forward_efficiency", "train_efficiency", "tower_call_ms", "update_layer_s",
          "rollout_s")
BOUNDS = {"prefill_efficiency": (0.05, 0.75), "forward_efficiency": (0.05, 0.75), "train_efficiency": (0.05, 0.75),
          "tower_call_ms": (0.0, 5.0), "update_layer_s": (0.0, 1.0), "rollout_s": (0.0, 30.0)}  # physical ranges
PHASES = (("rollout", "rollout"), ("reference", "reference"), ("update", "update"), ("step", "step"))


def load_points(path: str | Path = "docs/gpu/points.json") -> dict:
    return json.loads(Path(path).read_text())


def planned(point: dict, data: dict, calibration=None) -> dict:
    """The planner on one point's configuration (its model cut to the point's layers): its result dict."""
    from app.config.loading import load_config
    from app.planning.planner import World, plan
    from app.planning.timing import CALIBRATION

    world = World(nodes=1, **data["world"], calibration=calibration or CALIBRATION)
    cfg = load_config(data["config"], point["overrides"])
    return plan(cfg, world, f"qwen2_5_vl_7b@{point['layers']}", videos=point.get("videos"))


def decode_constants(data: dict) -> dict:
    """weight_efficiency, kv_efficiency, graph_launch_ms, eager_launch_ms from the decode steps measured alone."""
    d = data["decode"]
    nominal, layers = d["nominal_tb_s"], d["layers"]
    kv_token = 2 * 4 * 128 * layers * 2  # Qwen2.5-VL-7B: 4 KV heads of 128, bf16
    weight_eff = d["copy_tb_s"] / nominal
    by = {(s["mode"], s["prefix"]): s for s in d["steps"]}
    kv = {p: kv_token * p for p in (8192, 16384)}
    weights = by[("graph", 8192)]["bytes_gb"] * 1e9 - kv[8192]
    extra = by[("graph", 16384)]["step_ms"] - by[("graph", 8192)]["step_ms"]
    kv_eff = (kv[16384] - kv[8192]) / (nominal * 1e12) / (extra / 1e3)

    def launch(mode):
        rest = [by[(mode, p)]["step_ms"] / 1e3 - weights / (nominal * 1e12 * weight_eff)
                - kv[p] / (nominal * 1e12 * kv_eff) for p in (8192, 16384)]
        return sum(rest) / len(rest) / layers * 1e3

    return {"weight_efficiency": weight_eff, "kv_efficiency": kv_eff, "graph_launch_ms": launch("graph"),
            "eager_launch_ms": launch("eager")}


def ratios(results: list[dict], points: list[dict], calibration) -> list[dict]:
    """Per point and phase: planned / measured."""
    from app.planning.timing import seconds

    rows = []
    for result, point in zip(results, points):
        got = seconds(result["phase_terms"]["grouped"], calibration)
        for phase, key in PHASES:
            rows.append({"point": point["name"], "phase": phase, "measured_s": point["measured"][key],
                         "planned_s": got[phase], "ratio": got[phase] / point["measured"][key]})
        states = result["states"]["total"]
        for phase, part, key in (("rollout memory", "rollout", "rollout_peak_gib"),
                                 ("update memory", "training", "update_peak_gib")):
            gib = (states + result[part]["total"]) / 2**30
            rows.append({"point": point["name"], "phase": phase, "measured_gib": point["measured"][key],
                         "planned_gib": gib, "ratio": gib / point["measured"][key]})
    return rows


def fit(data: dict, tries: int = 12, steps: int = 4000, seed: int = 0):
    """The decode constants, then the rest by a seeded search for the smallest largest |log(planned/measured)|
    over the points' rollout, reference and update."""
    from app.planning.timing import CALIBRATION, seconds

    base = CALIBRATION.changed(**decode_constants(data))
    results = [planned(p, data, base) for p in data["points"]]
    measured = [(r["phase_terms"]["grouped"], p["measured"]) for r, p in zip(results, data["points"])]

    def worst(values):
        if any(not BOUNDS[f][0] <= v <= BOUNDS[f][1] for f, v in zip(FITTED, values)):
            return math.inf
        cal = base.changed(**dict(zip(FITTED, values)))
        out = 0.0
        for terms, m in measured:
            got = seconds(terms, cal)
            out = max(out, *(abs(math.log(got[key] / m[key])) for key in ("rollout", "reference", "update")))
        return out

    rng = random.Random(seed)
    best = ([getattr(base, f) for f in FITTED], worst([getattr(base, f) for f in FITTED]))
    for _ in range(tries):
        x = [v * math.exp(rng.gauss(0, 0.7)) for v in best[0]]
        score, width = worst(x), 0.5
        for _ in range(steps // tries):
            trial = [v * math.exp(rng.gauss(0, width)) if rng.random() < 0.5 else v for v in x]
            got = worst(trial)
            if got < score:
                x, score = trial, got
            else:
                width = max(0.01, width * 0.995)
        if score < best[1]:
            best = (x, score)
    return base.changed(**dict(zip(FITTED, best[0]))), math.exp(best[1])


def run(out: Path, points: str = "docs/gpu/points.json") -> dict:
    from app.planning.timing import CALIBRATION, SOURCES

    data = load_points(points)
    fitted, spread = fit(data)
    results = [planned(p, data) for p in data["points"]]
    report = {"points_file": points, "fitted": asdict(fitted), "largest_ratio_fitted": spread,
              "committed": asdict(CALIBRATION), "sources": SOURCES,
              "rows_committed": ratios(results, data["points"], CALIBRATION),
              "rows_fitted": ratios(results, data["points"], fitted)}
    write_report(out, "planner_calibration", report, table(report))
    plot(out, report["rows_committed"])
    return report


def plot(out: Path, rows: list[dict]) -> None:
    """Planned over measured for every phase and memory of every point, against the asserted bands."""
    import matplotlib.pyplot as plt

    from app.runtime import plots  # noqa: F401 - selects matplotlib's Agg backend

    points = list(dict.fromkeys(r["point"] for r in rows))
    phases = list(dict.fromkeys(r["phase"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 3.8))
    width = 0.8 / len(points)
    for i, point in enumerate(points):
        values = [next(r["ratio"] for r in rows if r["point"] == point and r["phase"] == phase) for phase in phases]
        ax.bar([x + i * width for x in range(len(phases))], values, width, label=point[:48])
    for band, style in ((0.25, ":"), (0.20, "--"), (0.15, "-.")):
        ax.axhline(1 + band, color="grey", linestyle=style, linewidth=0.8)
        ax.axhline(1 - band, color="grey", linestyle=style, linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(phases))], phases)
    ax.set_ylabel("planned / measured (H200)")
    ax.set_ylim(0.5, 1.5)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "planner_calibration.png", dpi=120)
    plt.close(fig)


def table(report: dict) -> str:
    names = list(report["committed"])
    constants = [{"constant": n, "committed": report["committed"][n], "fitted now": report["fitted"][n],
                  "source": report["sources"].get(n, "")} for n in names]
    lines = ["## The planner's step-time constants (app/planning/timing.py) and the GPU points they come from", "",
             markdown_table(constants, ["constant", "committed", "fitted now", "source"],
                            {"committed": ".4g", "fitted now": ".4g"}), "",
             f"Largest planned/measured ratio of the fit (rollout, reference, update): "
             f"{report['largest_ratio_fitted']:.3f}", "",
             "### Planned (committed constants) against measured, step 2 of each run", "",
             markdown_table(report["rows_committed"], ["point", "phase", "measured_s", "planned_s", "measured_gib",
                                                       "planned_gib", "ratio"],
                            {k: ".3f" for k in ("measured_s", "planned_s", "measured_gib", "planned_gib", "ratio")})]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/bench/planner_calibration")
    parser.add_argument("--points", default="docs/gpu/points.json")
    parser.add_argument("--quick", action="store_true", help="the same (it takes seconds)")
    args = parser.parse_args(argv)
    report = run(Path(args.out), args.points)
    print(json.dumps({k: round(v, 5) for k, v in report["fitted"].items()}))


if __name__ == "__main__":
    main()
