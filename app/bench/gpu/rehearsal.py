"""A rehearsal of the first real run on one GPU, through the real launchers.

    python -m app.bench.gpu.rehearsal --out outputs/gpu/rehearsal [--layers 4] [--lora] [--quick]

1. A checkpoint of Qwen2.5-VL-7B's full width with random weights (``shapes.build_real_width_checkpoint``, drawn on
   the GPU): ``--layers`` of the 28 decoder layers and as many of the 32 vision blocks (the depth is cut to fit the
   time; the report states it), Qwen's real tokenizer and processor.
2. Generated videos (``app.data.synthetic``) of 64 frames at 448 x 448 and 2 fps: 32 temporal patches x 16 x 16 =
   8,192 video tokens per prompt, plus the question.
3. ``scripts/train.sh configs/qwen2_5_vl_7b_video.yaml`` with the run's paths and 3 steps: G = 8, completions of 256,
   bfloat16, ZeRO-3 on one rank (deepspeed_configs/zero3.json), the default engine, backend and decode step; the
   rewards of the config plus one that varies with a completion's length (random weights rarely earn a format or
   accuracy reward, and the update should have something to do); the length bonus off (it pays from 320 tokens).
4. ``scripts/plan.sh`` on the same configuration: its memory per rank beside the CUDA peaks the run logged.
5. ``scripts/eval.sh`` on 2 held-out records with the ``video_r1`` protocol preset, in bfloat16.

Per phase (rollout, reference, update, weight sync): seconds, tokens per second and the CUDA peak
(``memory/*_peak_gib``, logged by the trainer on CUDA), from the run's metrics.jsonl. Every stage writes the report
again, so a run cut short still has one. ``--quick``: the same on this CPU at tiny width (a tiny checkpoint with
Qwen's real tokenizer, 8-frame 56 x 56 videos, G = 2, completions of 8, 2 steps, ZeRO-3 on one rank).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import torch

from app.bench.common import ROOT, child_env, device, markdown_table, plan_here, write_report

PRESET, LAYERS, FRAMES, SIZE, FPS = "qwen2_5_vl_7b", 4, 64, 448, 2
PHASES = (("rollout", "rollout"), ("reference", "reference"), ("update", "policy"), ("weight sync", "weight_sync"))


def settings(quick: bool, layers: int, lora: bool) -> dict:
    if quick:
        return {"frames": 8, "size": 56, "group": 2, "completion": 8, "steps": 2, "layers": 1, "dtype": "float32",
                "pixels": (3136, 3136), "lora": lora}
    return {"frames": FRAMES, "size": SIZE, "group": 8, "completion": 256, "steps": 3, "layers": layers,
            "dtype": "bfloat16", "pixels": (100352, SIZE * SIZE), "lora": lora}


def checkpoint(out: Path, s: dict, quick: bool) -> Path:
    from app.planning import shapes
    from app.runtime.models import build_tiny_checkpoint

    path = out / "checkpoint"
    if (path / "config.json").is_file():
        return path
    if quick:  # the path on this CPU: the 640-token tokenizer (Qwen's real one cost each of 9 launches ~8 CPU-s)
        return build_tiny_checkpoint(path, "qwen2_5_vl", seed=0)
    return shapes.build_real_width_checkpoint(path, PRESET, layers=s["layers"], vision_layers=s["layers"],
                                              max_pixels=SIZE * SIZE, device=device())


def overrides(out: Path, ckpt: Path, data: dict, s: dict) -> list[str]:
    plugin = out / "varied_reward.py"
    plugin.write_text("def varied(completions, records):\n    return [len(c) % 7 / 6 for c in completions]\n")
    values = {
        "model.path": ckpt, "model.dtype": s["dtype"], "data.train_file": data["train"], "data.data_root": "",
        "data.max_frames": s["frames"], "data.fps": float(FPS), "data.min_pixels": s["pixels"][0],
        "data.max_pixels": s["pixels"][1], "rollout.group_size": s["group"],
        "rollout.max_completion_length": s["completion"], "train.max_steps": s["steps"],
        "train.output_dir": out / "run", "train.save_every": 0, "logging.wandb_mode": "disabled",
        "logging.progress_bar": False, "rewards.functions": f"[format, accuracy, '{plugin}:varied']",
        "rewards.length": False,  # Video-R1's length bonus needs completions of 320+ tokens; these stop at 256
    }
    if s["lora"]:
        values |= {"lora.rank": 16, "lora.alpha": 32}
    return [f"{k}={v}" for k, v in values.items()]


def launch(name: str, args: list[str], log: Path, env: dict) -> dict:
    """Run a launcher, its output to ``log``; -> seconds, return code and its last error line."""
    start = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(args, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    seconds = time.perf_counter() - start
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    last = next((line for line in reversed(lines) if "Error" in line or "error:" in line), lines[-1] if lines else "")
    print(f"{name}: exit {code} in {seconds:.1f} s", flush=True)
    return {"seconds": seconds, "exit": code, **({"last_error": last[-400:]} if code else {})}


def phases(metrics_file: Path, group: int) -> list[dict]:
    """Per step and phase: seconds, tokens per second, CUDA peak."""
    if not metrics_file.is_file():
        return []
    rows = []
    for line in metrics_file.read_text().splitlines():
        m = json.loads(line)
        if "time/rollout" not in m:
            continue
        generated = m.get("completion_length", 0.0) * m.get("groups/trained", 0.0) * group
        tokens = {"rollout": generated, "reference": m.get("tokens/policy_forward", 0.0),
                  "policy": m.get("tokens/policy_forward", 0.0), "weight_sync": 0.0}
        for label, key in PHASES:
            seconds = m.get(f"time/{key}", float("nan"))
            rows.append({"step": m.get("step"), "phase": label, "seconds": seconds,
                         "tokens_per_second": tokens[key] / seconds if tokens[key] and seconds else None,
                         "cuda_peak_gib": m.get(f"memory/{key}_peak_gib")})
    return rows


def planned(out: Path, config: str, args: list[str], env: dict, *, here: bool = False) -> dict:
    """``scripts/plan.sh`` on the run's settings (``here``: in this process, ``plan_here``)."""
    from app.grouping.decoding.clock import nominal_bandwidth

    gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 80.0
    bandwidth = nominal_bandwidth("cuda") if torch.cuda.is_available() else None
    card = ["--bandwidth-tbs", str(bandwidth)] if bandwidth else []
    out.mkdir(parents=True, exist_ok=True)
    plan_args = [config, *args, "--gpus-per-node", "1", "--gpu-memory-gib", f"{gib:.0f}", *card, "--out",
                 str(out / "plan")]
    result = plan_here(plan_args, out / "plan.log") if here else \
        launch("plan", ["bash", "scripts/plan.sh", *plan_args], out / "plan.log", env)
    path = out / "plan" / "plan.json"
    if path.is_file():
        plan = json.loads(path.read_text())
        states = plan["states"]["total"]
        result.update(peak_gib=plan["peak"] / 2**30, states_gib=states / 2**30,
                      rollout_gib=(states + plan["rollout"]["total"]) / 2**30,
                      training_gib=(states + plan["training"]["total"]) / 2**30, prefix=plan["workload"]["prefix"])
    return result


def run(out: Path, quick: bool = False, layers: int = LAYERS, lora: bool = False) -> dict:
    from app.data.synthetic import generate

    out.mkdir(parents=True, exist_ok=True)
    s = settings(quick, layers, lora)
    report: dict = {"settings": {**s, "preset": "tiny qwen2_5_vl" if quick else PRESET}, "stages": {}}

    def save():
        write_report(out, "rehearsal", report, table(report), quiet=True)

    start = time.perf_counter()
    ckpt = checkpoint(out, s, quick)
    report["stages"]["checkpoint"] = {"seconds": time.perf_counter() - start, "exit": 0}
    print(f"checkpoint: {time.perf_counter() - start:.1f} s", flush=True)
    data = generate(out / "data", train=4, heldout=2, seed=0, frames=s["frames"], size=s["size"], fps=FPS)
    save()
    env = child_env(PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    config = "configs/qwen2_5_vl_7b_video.yaml"
    args = overrides(out, ckpt, data, s)
    report["stages"]["train"] = launch("train", ["bash", "scripts/train.sh", config, *args,
                                                 "train.deepspeed_config=deepspeed_configs/zero3.json"],
                                       out / "train.log", env)
    report["phases"] = phases(out / "run" / "metrics.jsonl", s["group"])
    report["prefix_tokens"] = prompt_tokens(out / "run" / "metrics.jsonl", s["group"])
    save()
    report["stages"]["plan"] = planned(out, config, args, env, here=quick)
    report["memory"] = memory_rows(report)
    save()
    final = out / "run" / "final"
    if final.is_dir():
        heldout = out / "data" / "heldout2.jsonl"
        heldout.write_text("".join(Path(data["heldout"]).read_text().splitlines(keepends=True)[:2]))
        report["stages"]["eval"] = launch("eval", ["bash", "scripts/eval.sh", str(final), str(heldout), "--protocol",
                                                   "video_r1", f"model.dtype={s['dtype']}",
                                                   f"eval.max_new_tokens={s['completion']}",
                                                   f"eval.output_dir={out / 'eval'}"], out / "eval.log", env)
        summary = out / "eval" / "summary.json"
        if summary.is_file():
            report["eval_summary"] = json.loads(summary.read_text())
    save()
    write_report(out, "rehearsal", report, table(report))
    return report


def prompt_tokens(metrics_file: Path, group: int) -> float | None:
    """The mean prompt length over the run's groups: ``tokens/prefix_saved_by_grouping`` counts each prompt's tokens
    G - 1 times (the copies a repeated layout would have encoded)."""
    if not metrics_file.is_file() or group < 2:
        return None
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    saved = [(m["tokens/prefix_saved_by_grouping"], m["groups/trained"]) for m in rows
             if "tokens/prefix_saved_by_grouping" in m and m.get("groups/trained")]
    return sum(tokens / groups / (group - 1) for tokens, groups in saved) / len(saved) if saved else None


def memory_rows(report: dict) -> list[dict]:
    """The planner's memory per rank beside the largest CUDA peak the run logged, for the rollout and the update."""
    plan = report["stages"].get("plan", {})
    rows = []
    for phase, key, planned_key in (("rollout", "rollout", "rollout_gib"), ("update", "update", "training_gib")):
        peaks = [r["cuda_peak_gib"] for r in report.get("phases", []) if r["phase"] == key and r["cuda_peak_gib"]]
        if peaks and plan.get(planned_key):
            rows.append({"phase": phase, "cuda_peak_gib": max(peaks), "planned_gib": plan[planned_key],
                         "planner_vs_cuda": plan[planned_key] / max(peaks)})
    return rows


def table(report: dict) -> str:
    s = report["settings"]
    stages = [{"stage": k, **v} for k, v in report["stages"].items()]
    for row in stages:
        row.setdefault("exit", "")
    lines = [f"## Rehearsal: {s['preset']} at full width, {s['layers']} decoder layers and {s['layers']} vision "
             f"blocks, {s['dtype']}, ZeRO-3 on one rank{', LoRA' if s['lora'] else ''}; videos of {s['frames']} "
             f"frames at {s['size']}x{s['size']} (prompts of {report.get('prefix_tokens') or 0:.0f} tokens), "
             f"G={s['group']}, completions of {s['completion']}, {s['steps']} GRPO steps", "",
             markdown_table(stages, ["stage", "exit", "seconds", "peak_gib", "states_gib", "rollout_gib",
                                     "training_gib", "last_error"],
                            {k: ".2f" for k in ("seconds", "peak_gib", "states_gib", "rollout_gib", "training_gib")})]
    if report.get("phases"):
        lines += ["", "### Per phase, per step (from the run's metrics.jsonl)", "",
                  markdown_table(report["phases"], ["step", "phase", "seconds", "tokens_per_second", "cuda_peak_gib"],
                                 {"seconds": ".2f", "tokens_per_second": ".0f", "cuda_peak_gib": ".2f"})]
    if report.get("memory"):
        lines += ["", "### The planner (scripts/plan.sh, same configuration) against the CUDA peak", "",
                  markdown_table(report["memory"], ["phase", "cuda_peak_gib", "planned_gib", "planner_vs_cuda"],
                                 {"cuda_peak_gib": ".2f", "planned_gib": ".2f", "planner_vs_cuda": ".3f"})]
    if report.get("eval_summary"):
        lines += ["", "### Evaluation (2 held-out records, --protocol video_r1)", "",
                  "```", json.dumps(report["eval_summary"], indent=1)[:1500], "```"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/gpu/rehearsal")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--lora", action="store_true")
    args = parser.parse_args(argv)
    run(Path(args.out), args.quick, args.layers, args.lora)


if __name__ == "__main__":
    main()
