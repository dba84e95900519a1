"""The planner's step time fitted to the committed GPU measurements, and checked against them, also where it was
not fitted (leave-one-out).

    scripts/bench.sh planner_calibration      # = python -m app.bench.planning.calibrate [--points FILE] [--out DIR]

Reads ``docs/gpu/points.json`` (each measured point with its source, configuration and per-phase seconds and CUDA
peaks). The decode constants come from the decode steps measured alone (weights at the card's copy bandwidth; the
K/V's share and the per-layer launch cost from the 8k and 16k steps, graph and eager). The others are fitted to the
points' rollout, reference and update times at once: the largest ratio between planned and measured, over every
phase of every point, made as small as it goes (a seeded search over the constants in log space, from the committed
constants: a refit with no new point finds them again).

Leave-one-out: for each point, the same fit on the other points alone, then that point predicted (its phases and
its step, planned over measured). A constant the other points do not pin down is named: one whose value can move
by more than ``LOOSE``x either way without the others' worst ratio growing by 2% (``ranges``).

Writes the constants, rounded, with the leave-one-out summary to ``app/planning/calibration.json`` (what
``app.planning.timing.CALIBRATION`` and the planner's printout read; ``--no-write`` leaves it), and a report (JSON,
markdown, a plot) under ``--out``. No GPU needed: the points are data. Adding a GPU run's points to
``points.json`` and running this command again refits both.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict
from pathlib import Path

from app.bench.common import markdown_table, write_report

CALIBRATION_FILE = Path(__file__).resolve().parents[2] / "planning" / "calibration.json"
LOOSE = 2.0  # a constant free to move by more than this factor (within 2% of the fit) is not pinned down
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


KV_TOKEN = 2 * 4 * 128 * 2  # bytes of K and V per token and layer: Qwen2.5-VL-7B's 4 KV heads of 128, bf16


def decode_constants(data: dict) -> dict:
    """weight_efficiency, kv_efficiency, graph_launch_ms, eager_launch_ms from the decode steps measured alone (the
    two-bmm path); varlen_kv_efficiency from torch's varlen kernel's steps where a GPU run added them
    (``merge``), else the bmm path's."""
    d = data["decode"]
    nominal, layers = d["nominal_tb_s"], d["layers"]
    kv_token = KV_TOKEN * layers
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

    out = {"weight_efficiency": weight_eff, "kv_efficiency": kv_eff, "graph_launch_ms": launch("graph"),
           "eager_launch_ms": launch("eager"), "varlen_kv_efficiency": kv_eff}
    varlen = [s for s in data.get("varlen", {}).get("decode_steps", []) if s["mode"] == "varlen"
              and s["questions"] == 1]
    if len({s["prefix"] for s in varlen}) >= 2:  # the slope between the shortest and the longest prefix
        low, high = min(varlen, key=lambda s: s["prefix"]), max(varlen, key=lambda s: s["prefix"])
        seconds = (high["step_ms"] - low["step_ms"]) / 1e3
        if seconds > 0:
            out["varlen_kv_efficiency"] = kv_token * (high["prefix"] - low["prefix"]) / (nominal * 1e12) / seconds
    return out


def tower_constants(data: dict) -> dict:
    """tower_call_ms measured directly where a GPU run timed a tower pass both ways (``merge``): the per-chunk
    loop's extra time over the one-call pass, per extra call (the mean over the passes)."""
    passes = data.get("varlen", {}).get("tower_passes", [])
    per_call = []
    for frames in {p["frames"] for p in passes}:
        both = {p["attention"]: p for p in passes if p["frames"] == frames}
        if "sdpa" in both and len(both) == 2:
            loop, one = both["sdpa"], next(p for a, p in both.items() if a != "sdpa")
            if loop["calls"] > one["calls"]:
                per_call.append((loop["seconds"] - one["seconds"]) / (loop["calls"] - one["calls"]) * 1e3)
    return {"tower_call_ms": sum(per_call) / len(per_call)} if per_call else {}


def measured_sources(data: dict) -> dict:
    """The sources of the constants a merged GPU run measured (what ``timing.SOURCES`` says otherwise)."""
    run = data.get("varlen")
    if not run:
        return {}
    where = f"{run.get('source', 'a gpu_check varlen run')} ({run.get('card', '')}, torch {run.get('torch', '')})"
    out = {}
    if "varlen_kv_efficiency" in decode_constants(data) and any(s["mode"] == "varlen" for s in run["decode_steps"]):
        out["varlen_kv_efficiency"] = f"the varlen kernel's decode steps at several prefixes: {where}"
    if tower_constants(data):
        out["tower_call_ms"] = f"the tower's per-chunk loop against one call per block, measured: {where}"
    return out


def merge(points: Path, result: Path) -> dict:
    """A gpu_check varlen run's points (``app.bench.gpu.varlen``: its JSON's ``points``) into points.json, under
    ``varlen`` (a later run replaces an earlier one)."""
    data = json.loads(Path(points).read_text())
    run = json.loads(Path(result).read_text())["points"]
    data["varlen"] = {"source": str(result), **run}
    Path(points).write_text(json.dumps(data, indent=1) + "\n")
    return data


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


def _worst(measured: list[tuple[dict, dict]], calibration) -> float:
    """The largest |log(planned / measured)| over the rollout, reference and update of the points."""
    from app.planning.timing import seconds

    out = 0.0
    for terms, m in measured:
        got = seconds(terms, calibration)
        out = max(out, *(abs(math.log(got[key] / m[key])) for key in ("rollout", "reference", "update")))
    return out


def _terms(data: dict, calibration) -> list[tuple[dict, dict]]:
    return [(planned(p, data, calibration)["phase_terms"]["grouped"], p["measured"]) for p in data["points"]]


def fit(data: dict, tries: int = 12, steps: int = 4000, seed: int = 0):
    """The decode constants, then the rest by a seeded search for the smallest largest |log(planned/measured)|
    over the points' rollout, reference and update. Returns (the calibration, its largest ratio)."""
    from app.planning.timing import CALIBRATION

    base = CALIBRATION.changed(**decode_constants(data), **tower_constants(data))
    measured = _terms(data, base)
    fitted = fitted_names(data)

    def worst(values):
        if any(not BOUNDS[f][0] <= v <= BOUNDS[f][1] for f, v in zip(fitted, values)):
            return math.inf
        return _worst(measured, base.changed(**dict(zip(fitted, values))))

    rng = random.Random(seed)
    best = ([getattr(base, f) for f in fitted], worst([getattr(base, f) for f in fitted]))
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
    return base.changed(**dict(zip(fitted, best[0]))), math.exp(best[1])


def fitted_names(data: dict) -> tuple[str, ...]:
    """The constants fitted to the points' phases: ``FITTED`` less those a GPU run measured directly."""
    return tuple(f for f in FITTED if f not in tower_constants(data))


def ranges(data: dict, calibration) -> dict:
    """Per fitted constant, the factors (low, high) it can be multiplied by, the others held, while the points'
    largest ratio stays within 2% of the fit's (scanned in steps of 5% out to 20x or the physical bound): how
    tightly these points pin it down."""
    measured = _terms(data, calibration)
    best = math.exp(_worst(measured, calibration))
    out = {}
    for name in fitted_names(data):
        value, (low, high) = getattr(calibration, name), BOUNDS[name]
        kept = [1.0]
        for sign in (-1, 1):
            for step in range(1, 61):
                factor = math.exp(sign * 0.05 * step)
                if not low <= value * factor <= high or value == 0:
                    break
                if math.exp(_worst(measured, calibration.changed(**{name: value * factor}))) > best + 0.02:
                    break
                kept.append(factor)
        out[name] = (min(kept), max(kept))
    return out


def loose(spans: dict) -> list[str]:
    """The constants ``ranges`` leaves free by more than ``LOOSE``x either way."""
    return [name for name, (low, high) in spans.items() if low < 1 / LOOSE or high > LOOSE]


def leave_one_out(data: dict, tries: int = 12, steps: int = 4000) -> list[dict]:
    """For each point: the fit on the others, that point planned with it (phase and step ratios), the constants
    the others leave loose, and how far the fitted constants moved from the fit on every point."""
    from app.planning.timing import seconds

    everything, _ = fit(data, tries, steps)
    rows = []
    for i, point in enumerate(data["points"]):
        others = dict(data, points=[p for j, p in enumerate(data["points"]) if j != i])
        calibration, spread = fit(others, tries, steps)
        got = seconds(planned(point, data, calibration)["phase_terms"]["grouped"], calibration)
        row = {"point": point["name"], "fitted_on": len(others["points"]), "others_worst": spread,
               **{phase: got[phase] / point["measured"][phase] for phase in ("rollout", "reference", "update",
                                                                             "step")},
               "constants": {f: getattr(calibration, f) for f in fitted_names(data)},
               "moved": {f: getattr(calibration, f) / getattr(everything, f) for f in fitted_names(data)
                         if getattr(everything, f)},
               "loose": loose(ranges(others, calibration))}
        rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict:
    """What the planner prints of the leave-one-out: the step ratios' range and the worst (farthest from 1)."""
    steps = [r["step"] for r in rows]
    worst = max(steps, key=lambda r: abs(math.log(r)))
    return {"points": len(rows), "step_low": min(steps), "step_high": max(steps), "worst_step": worst,
            "worst_point": rows[steps.index(worst)]["point"],
            "phase_low": min(r[p] for r in rows for p in ("rollout", "reference", "update")),
            "phase_high": max(r[p] for r in rows for p in ("rollout", "reference", "update"))}


def _rounded(value: float) -> float:
    return float(f"{value:.3g}")


def committed_file(data: dict, fitted, spread: float, rows: list[dict], points: str) -> dict:
    """``app/planning/calibration.json``: the constants rounded, where they come from, and the leave-one-out."""
    return {"what": "the planner's step-time constants, fitted by python -m app.bench.planning.calibrate "
                    "(scripts/bench.sh planner_calibration); do not edit by hand: add points and rerun",
            "card": data.get("card", ""), "points_file": points, "points": [p["name"] for p in data["points"]],
            "constants": {name: _rounded(value) for name, value in asdict(fitted).items()},
            "largest_ratio_fitted": round(spread, 4), "sources": measured_sources(data),
            "leave_one_out": {**{k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary(rows).items()},
                              "loose": {r["point"]: r["loose"] for r in rows}}}


def run(out: Path, points: str = "docs/gpu/points.json", write: Path | None = CALIBRATION_FILE) -> dict:
    from app.planning.timing import CALIBRATION, SOURCES

    data = load_points(points)
    fitted, spread = fit(data)
    rows = leave_one_out(data)
    results = [planned(p, data) for p in data["points"]]
    report = {"points_file": points, "fitted": asdict(fitted), "largest_ratio_fitted": spread,
              "committed": asdict(CALIBRATION), "sources": SOURCES,
              "ranges_all_points": ranges(data, fitted), "leave_one_out": rows,
              "leave_one_out_summary": summary(rows),
              "rows_committed": ratios(results, data["points"], CALIBRATION),
              "rows_fitted": ratios(results, data["points"], fitted)}
    if write is not None:
        Path(write).write_text(json.dumps(committed_file(data, fitted, spread, rows, points), indent=1) + "\n")
    write_report(out, "planner_calibration", report, table(report))
    plot(out, report["rows_committed"], rows)
    return report


def plot(out: Path, rows: list[dict], held_out: list[dict]) -> None:
    """Planned over measured for every phase and memory of every point (the committed fit), and beside it each
    point's phases and step predicted by the fit on the other points (leave-one-out), against the asserted bands."""
    import matplotlib.pyplot as plt

    from app.runtime import plots  # noqa: F401 - selects matplotlib's Agg backend

    points = list(dict.fromkeys(r["point"] for r in rows))
    phases = list(dict.fromkeys(r["phase"] for r in rows))
    fig, (ax, other) = plt.subplots(1, 2, figsize=(14, 4), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(points)
    for i, point in enumerate(points):
        values = [next(r["ratio"] for r in rows if r["point"] == point and r["phase"] == phase) for phase in phases]
        ax.bar([x + i * width for x in range(len(phases))], values, width, label=point[:48])
        loo = next(r for r in held_out if r["point"] == point)
        other.bar([x + i * width for x in range(4)], [loo[p] for p in ("rollout", "reference", "update", "step")],
                  width)
    for axis in (ax, other):
        for band, style in ((0.25, ":"), (0.20, "--"), (0.15, "-.")):
            axis.axhline(1 + band, color="grey", linestyle=style, linewidth=0.8)
            axis.axhline(1 - band, color="grey", linestyle=style, linewidth=0.8)
        axis.set_ylim(0.5, 1.5)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(phases))], phases)
    other.set_xticks([x + 0.4 - width / 2 for x in range(4)], ["rollout", "reference", "update", "step"])
    ax.set_ylabel("planned / measured (H200)")
    ax.set_title("fitted on every point", fontsize=9)
    other.set_title("each point left out of the fit, then predicted", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "planner_calibration.png", dpi=120)
    plt.close(fig)


def loo_table(rows: list[dict]) -> str:
    """The leave-one-out table: each point predicted by the fit on the others."""
    shown = [{"point left out": r["point"], "rollout": r["rollout"], "reference": r["reference"],
              "update": r["update"], "step": r["step"], "others' worst": r["others_worst"],
              "not pinned down without it": ", ".join(r["loose"]) or "-"} for r in rows]
    return markdown_table(shown, list(shown[0]), {k: ".2f" for k in ("rollout", "reference", "update", "step",
                                                                     "others' worst")})


def table(report: dict) -> str:
    names = list(report["committed"])
    constants = [{"constant": n, "committed": report["committed"][n], "fitted now": report["fitted"][n],
                  "pinned (x low-high)": ("{:.2f}-{:.2f}".format(*report["ranges_all_points"][n])
                                          if n in report["ranges_all_points"] else "measured alone"),
                  "source": report["sources"].get(n, "")} for n in names]
    s = report["leave_one_out_summary"]
    lines = ["## The planner's step-time constants (app/planning/calibration.json) and the GPU points they come from",
             "",
             markdown_table(constants, ["constant", "committed", "fitted now", "pinned (x low-high)", "source"],
                            {"committed": ".4g", "fitted now": ".4g"}), "",
             f"Largest planned/measured ratio of the fit (rollout, reference, update): "
             f"{report['largest_ratio_fitted']:.3f}. \"pinned\": the factors a constant can be multiplied by, the "
             "others held, with the largest ratio within 2% of the fit's.", "",
             "### Leave-one-out: each point predicted by the fit on the others", "",
             loo_table(report["leave_one_out"]), "",
             f"Step planned/measured on a point the fit did not see: {s['step_low']:.2f}-{s['step_high']:.2f} over "
             f"{s['points']} points (worst {s['worst_step']:.2f}, {s['worst_point']}); phases "
             f"{s['phase_low']:.2f}-{s['phase_high']:.2f}. \"Not pinned down\": the constants the other points "
             f"leave free by more than {LOOSE:g}x either way (their values there are whatever the search ended on).",
             "",
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
    parser.add_argument("--merge", default="",
                        help="first add a gpu_check varlen run's points (its gpu_varlen.json) to --points")
    parser.add_argument("--write-to", default=str(CALIBRATION_FILE),
                        help="where the constants and the leave-one-out summary go (what the planner reads)")
    parser.add_argument("--no-write", action="store_true", help="write only the report")
    parser.add_argument("--quick", action="store_true", help="the same (it takes seconds)")
    args = parser.parse_args(argv)
    if args.merge:
        merge(Path(args.points), Path(args.merge))
    report = run(Path(args.out), args.points, write=None if args.no_write else Path(args.write_to))
    print(json.dumps({k: round(v, 5) for k, v in report["fitted"].items()}))


if __name__ == "__main__":
    main()
