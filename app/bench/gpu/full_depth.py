"""The full-depth GPU check: the 7B LoRA configuration at all 28 layers through the real launchers, against the
TRL-style run and with questions sharing a video, each phase beside what the planner says.

    python -m app.bench.gpu.full_depth --out outputs/gpu/full_depth [--quick] [--steps 6]

On one checkpoint of Qwen2.5-VL-7B's width (random weights, 28 decoder layers and 28 vision blocks; ``--quick``:
a tiny one on this CPU), one stage after another, the report written after each:

1. **rehearsal**: ``scripts/train.sh`` with the LoRA settings (rank 16), videos of 64 frames at 448 x 448 (8.4k-token
   prompts), G = 8, completions of 256, ZeRO-3 on one rank, ``--steps`` GRPO steps (default 6); the rollout's
   parts per step (``rollout/*``: tower, prefill, capture, decode and its ms per step, sampling, scoring, the rest;
   whether a kept graph replayed; the decode step's bytes over its time against the card's bandwidth); then
   ``scripts/plan.sh`` and ``scripts/eval.sh`` on 2 held-out records;
2. **trl_style**: the same for 2 steps as TRL-style trainers run it (``forward.grouping=repeated
   rollout.engine=hf``): the whole step against the rehearsal's (goal: grouped >= 3x faster);
3. **k1** and **k4**: 2 videos x 4 questions, 4 questions per step, completions of 128, 2 steps each, at
   ``data.questions_per_video`` 1 and 4;
4. beside every run's step 2 (the steady state): the planner's phases and peaks (``plan.sh`` on its settings).

Checkpoints are deleted once a run is measured (``train.save_every=0``; the final export kept only where ``eval.sh``
needs it, then removed), so the disk used stays within a device's. No figure here is asserted: the report says
what happened; ``docs/gpu/report.md`` records the runs.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path

from app.bench.common import child_env, markdown_table, run_metrics, write_report
from app.bench.gpu import rehearsal
from app.data.synthetic import generate

PARTS = ("gather", "tower", "prefill", "capture", "decode", "sampling", "scoring", "other")


def settings(quick: bool, steps: int) -> dict:
    s = rehearsal.settings(quick, 1 if quick else 28, lora=True)
    return {**s, "steps": 2 if quick else steps}


def train(out: Path, name: str, ckpt: Path, data: dict, s: dict, extra: list[str], *, env: dict) -> dict:
    """One run through scripts/train.sh; its metrics per step, the launch's exit and seconds."""
    run_dir = out / name
    args = rehearsal.overrides(out, ckpt, data, s) + [f"train.output_dir={run_dir}", "train.save_every=0",
                                                      "train.deepspeed_config=deepspeed_configs/zero3.json",
                                                      f"train.max_steps={s['steps']}", *extra]
    launched = rehearsal.launch(name, ["bash", "scripts/train.sh", "configs/qwen2_5_vl_7b_video.yaml", *args],
                                out / f"{name}.log", env)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # measured: the disk back (the final save is 17 GB)
    return {"launch": launched, "steps": run_metrics(run_dir), "args": args}


def planned(out: Path, name: str, args: list[str], env: dict, videos: int = 1, *, here: bool = False) -> dict:
    result = rehearsal.planned(out / f"plan_{name}", "configs/qwen2_5_vl_7b_video.yaml", [*args, "--videos",
                                                                                          str(videos)], env, here=here)
    plan_file = out / f"plan_{name}" / "plan" / "plan.json"
    if plan_file.is_file():
        plan = json.loads(plan_file.read_text())
        result["phases"] = plan["phase_seconds"]["grouped"]
    return result


def beside(run: dict, plan: dict) -> list[dict]:
    """Step 2's measured phases and peaks beside the planner's."""
    steps = run.get("steps") or []
    if len(steps) < 2:
        return []
    m, phases = steps[1], plan.get("phases", {})
    rows = []
    for label, key, planned_key in (("rollout", "time/rollout", "rollout"), ("reference", "time/reference",
                                                                            "reference"),
                                    ("update", "time/policy", "update"), ("step", "time/step", "step")):
        got, want = m.get(key), phases.get(planned_key)
        rows.append({"what": label, "measured": got, "planned": want,
                     "planned_vs_measured": want / got if got and want else None})
    for label, key, planned_key in (("rollout peak GiB", "memory/rollout_peak_gib", "rollout_gib"),
                                    ("update peak GiB", "memory/policy_peak_gib", "training_gib")):
        got, want = m.get(key), plan.get(planned_key)
        rows.append({"what": label, "measured": got, "planned": want,
                     "planned_vs_measured": want / got if got and want else None})
    return rows


def rollout_rows(steps: list[dict]) -> list[dict]:
    """Per step: the rollout's parts, its unaccounted share, the decode step against the bandwidth."""
    rows = []
    for m in steps:
        row = {"step": m["step"], "rollout_s": m.get("time/rollout")}
        for part in PARTS:
            row[part] = m.get(f"rollout/{part}_s")
        rollout = m.get("time/rollout") or 0.0
        row["other_share"] = (m.get("rollout/other_s") or 0.0) / rollout if rollout else None
        for key in ("decode_steps", "decode_ms_per_step", "graph_replayed", "captures", "compiles", "recompiles",
                    "decode_tb_s", "decode_vs_bandwidth_limit"):
            row[key] = m.get(f"rollout/{key}")
        rows.append(row)
    return rows


def run(out: Path, quick: bool = False, steps: int = 6) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    s = settings(quick, steps)
    report: dict = {"settings": s, "stages": {}}
    env = child_env(PYTHONUNBUFFERED="1", WANDB_MODE="disabled")

    def save():
        write_report(out, "full_depth", report, table(report), quiet=True)

    start = time.perf_counter()
    ckpt = rehearsal.checkpoint(out, s, quick)
    report["stages"]["checkpoint"] = {"seconds": time.perf_counter() - start, "exit": 0}
    data = generate(out / "data", train=4, heldout=2, seed=0, frames=s["frames"], size=s["size"], fps=rehearsal.FPS)
    save()
    main = train(out, "rehearsal", ckpt, data, s, ["train.export_hf=true"], env=env)
    report["rehearsal"] = {"launch": main["launch"], "rollouts": rollout_rows(main["steps"])}
    report["rehearsal"]["plan"] = plan = planned(out, "rehearsal", main["args"], env, here=quick)
    report["rehearsal"]["beside_planner"] = beside(main, plan)
    rollouts = [r["rollout_s"] for r in report["rehearsal"]["rollouts"][1:] if r["rollout_s"]]
    if rollouts:
        median = statistics.median(rollouts)
        report["rehearsal"]["rollout_spread"] = max(abs(r / median - 1) for r in rollouts)
    save()
    final = out / "rehearsal" / "final"
    if final.is_dir():
        heldout = out / "data" / "heldout2.jsonl"
        heldout.write_text("".join(Path(data["heldout"]).read_text().splitlines(keepends=True)[:2]))
        report["stages"]["eval"] = rehearsal.launch("eval", [
            "bash", "scripts/eval.sh", str(final), str(heldout), "--protocol", "video_r1",
            f"model.dtype={s['dtype']}", f"eval.max_new_tokens={s['completion']}", f"eval.output_dir={out / 'eval'}"],
            out / "eval.log", env)
        shutil.rmtree(final, ignore_errors=True)  # the disk back: the export is measured
        shutil.rmtree(out / "rehearsal" / "checkpoints", ignore_errors=True)
    save()
    trl = train(out, "trl_style", ckpt, data, {**s, "steps": 2}, ["forward.grouping=repeated", "rollout.engine=hf",
                                                                   "train.export_hf=false"], env=env)
    report["trl_style"] = {"launch": trl["launch"], "rollouts": rollout_rows(trl["steps"])}
    if len(trl["steps"]) > 1 and len(main["steps"]) > 1:
        report["trl_style"]["step_vs_grouped"] = trl["steps"][1]["time/step"] / main["steps"][1]["time/step"]
    report["trl_style"]["plan"] = plan = planned(out, "trl_style", trl["args"], env, here=quick)
    report["trl_style"]["beside_planner"] = beside(trl, plan)
    save()
    shared = generate(out / "shared", train=8, heldout=0, seed=0, frames=s["frames"], size=s["size"],
                      fps=rehearsal.FPS, questions_per_video=4)
    for k in (1, 4):
        name = f"k{k}"
        got = train(out, name, ckpt, shared, {**s, "steps": 2, "completion": 8 if quick else 128},
                    [f"data.questions_per_video={k}", "train.prompts_per_rank=4", "train.groups_per_micro_batch=4",
                     "data.shuffle=false", "train.export_hf=false"], env=env)
        report[name] = {"launch": got["launch"], "rollouts": rollout_rows(got["steps"])}
        report[name]["plan"] = plan = planned(out, name, got["args"], env, here=quick)
        report[name]["beside_planner"] = beside(got, plan)
        report[name]["step2"] = got["steps"][1] if len(got["steps"]) > 1 else {}
        save()
    if report["k1"].get("step2") and report["k4"].get("step2"):
        report["k4_vs_k1"] = {key: report["k4"]["step2"][key] / report["k1"]["step2"][key]
                              for key in ("time/rollout", "time/reference", "time/policy", "time/step")
                              if report["k1"]["step2"].get(key)}
    write_report(out, "full_depth", report, table(report))
    return report


def table(report: dict) -> str:
    s = report["settings"]
    lines = [f"## Full depth: {s['layers']} decoder layers and vision blocks, LoRA, {s['dtype']}, ZeRO-3 on one rank; "
             f"videos of {s['frames']} frames at {s['size']}x{s['size']}, G={s['group']}, completions of "
             f"{s['completion']}"]
    fmt = {k: ".3f" for k in ("rollout_s", *PARTS, "other_share", "decode_ms_per_step", "decode_tb_s",
                              "decode_vs_bandwidth_limit", "measured", "planned", "planned_vs_measured")}
    for name in ("rehearsal", "trl_style", "k1", "k4"):
        part = report.get(name)
        if not part:
            continue
        launch = part["launch"]
        lines += ["", f"### {name}: exit {launch.get('exit')} in {launch.get('seconds', 0):.0f} s"
                  + (f" ({launch['last_error']})" if launch.get("last_error") else "")]
        if part.get("rollouts"):
            lines += ["", markdown_table(part["rollouts"], ["step", "rollout_s", *PARTS, "other_share", "decode_steps",
                                                            "decode_ms_per_step", "graph_replayed", "captures",
                                                            "recompiles", "decode_tb_s",
                                                            "decode_vs_bandwidth_limit"], fmt)]
        if part.get("beside_planner"):
            lines += ["", "Step 2 beside the planner:", "",
                      markdown_table(part["beside_planner"], ["what", "measured", "planned", "planned_vs_measured"],
                                     fmt)]
        if "rollout_spread" in part:
            lines.append(f"\nrollouts after the first: largest distance from their median {part['rollout_spread']:.1%}")
        if "step_vs_grouped" in part:
            lines.append(f"\nTRL-style step / grouped step (step 2): {part['step_vs_grouped']:.2f}x")
    if "k4_vs_k1" in report:
        lines += ["", "k = 4 against k = 1 (step 2): " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                                 report["k4_vs_k1"].items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/gpu/full_depth")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    run(Path(args.out), args.quick, args.steps)


if __name__ == "__main__":
    main()
