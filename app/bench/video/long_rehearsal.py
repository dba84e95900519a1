"""The hour-long plan rehearsed at reduced width: questions sharing a long video under sequence parallelism, through
``scripts/train.sh`` on 4 processes.

    python -m app.bench.video.long_rehearsal --out docs/bench/long_rehearsal [--quick]     (scripts/bench.sh long_rehearsal)

Generated videos of 640 frames at 224 x 224 (2 fps: 320 temporal patches x 64 = 20,480 visual tokens a prompt), each
asked 6 questions; a tiny Qwen2.5-VL (hidden 256, 2 layers, 4 query and 4 KV heads of 64, so S = 4 shares out every
KV head; a 2-block tower of width 64) whose tower is frozen, with the vision cache; chunked prefill
(``rollout.prefill_chunk_size=4096``) and vision chunking (``forward.vision_chunk_frames=16``); G = 2, completions of
8; ZeRO-3 over 4 ranks, fp32, the split backend. For S = 1 (4 replicas), S = 2 (2) and S = 4 (1), at k = 6 (one
family a replica: the video once; at S > 1 spread over the group's ranks) and at k = 1 (each question its own
prompt, one a micro-batch, 3 a replica a step: at S = 2 whole families per rank, at S = 4 spread), two runs each:

- **time and work**: 2 GRPO steps; step 2's time per question, ``data/media_decoded``, and each rank's rollout:
  its work (``rollout/work/*``: the tower's patch rows, the prompt positions it ran through the layers, the
  prompts' K/V it held) and its CPU time (``rollout/cpu_s``, ``time.process_time``: four processes on two cores
  share them, so CPU time, not wall time, says what each rank did);
- **memory**: 1 step with the heap's peak recorded (``PREFIX_GRPO_ALLOCATOR_PEAK=1``, ``app.runtime.heap``: a thread
  samples glibc's count of the bytes malloc holds): the rollout engine's peak and the policy update's on each rank,
  above what the stage began with, beside what ``scripts/plan.sh`` plans on top of the states for the same
  configuration and world (4 ranks; the planner plans the busiest rank).

Against S = 1 at the same k: each rank's work (``*_vs_s1``: the busiest rank's over S = 1's, goal 1/S within one
chunk) and the group's summed work (equal to S = 1's), the busiest rank's rollout CPU time (goal 0.6x at S = 2, 0.4x
at S = 4). Data prefetch is off (a prefetch thread's allocations would land in the stage it overlaps). Writes
JSON, the table and a plot. ``--quick``: 64 frames, 1 question pair, 2 processes, S = 1 and 2 at k = 2, one launch
a point (the suite's smoke test).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from app.bench.common import ROOT, child_env, markdown_table, plan_here, run_metrics, write_report

SIZES = dict(hidden=256, layers=2, heads=4, kv_heads=4, head_dim=64, intermediate=512, vision_hidden=64,
             vision_depth=2, vision_heads=2, max_positions=65536)
WORK = ("tower_patches", "prefill_tokens", "kv_bytes")
FRAMES, SIZE, FPS, QUESTIONS, CLIPS = 640, 224, 2, 6, 4
RANKS = 4
RANK_KEY = "memory/policy_above_start_gib/rank0"


def quick_points(k: int) -> tuple:
    """The smoke run's points: S = 1 and 2 at k (a family spread over S = 2 against one rank's)."""
    return (1, k), (2, k)


def assets(out: Path, quick: bool) -> dict:
    """The tiny checkpoint (64 merged tokens a temporal patch), the long clips and their questions, a reward."""
    from app.data.synthetic import generate
    from app.runtime.models import TinySizes, build_tiny_checkpoint

    ckpt = out / "checkpoint"
    if not (ckpt / "config.json").is_file():
        build_tiny_checkpoint(ckpt, "qwen2_5_vl", seed=0, sizes=TinySizes(**SIZES), max_pixels=SIZE * SIZE)
    frames, questions = (64, 2) if quick else (FRAMES, QUESTIONS)
    data = out / "data"
    if not (data / "train.jsonl").is_file():
        generate(data, train=questions * CLIPS, heldout=0, seed=0, frames=frames, size=SIZE, fps=FPS,
                 questions_per_video=questions)
    plugin = out / "varied_reward.py"
    plugin.write_text("def varied(completions, records):\n    return [len(c) % 5 / 4 for c in completions]\n")
    return {"checkpoint": ckpt, "train": data / "train.jsonl", "plugin": f"{plugin}:varied", "frames": frames,
            "questions": questions, "ranks": 2 if quick else RANKS}


def overrides(a: dict, run: Path, size: int, k: int, steps: int) -> list[str]:
    values = {
        "model.path": a["checkpoint"], "model.freeze_vision_tower": True, "data.train_file": a["train"],
        "data.shuffle": False, "data.fps": float(FPS), "data.max_frames": a["frames"], "data.min_pixels": SIZE * SIZE,
        "data.max_pixels": SIZE * SIZE, "data.max_prompt_length": 65536, "data.prefetch": 0,
        "data.questions_per_video": k, "train.sequence_parallel_size": size,
        "train.prompts_per_rank": prompts_of(a, k), "train.groups_per_micro_batch": a["questions"] if k > 1 else 1,
        "train.max_steps": steps,
        "train.save_every": 0, "train.export_hf": False, "train.output_dir": run, "train.learning_rate": 1e-3,
        "train.deepspeed_config": "deepspeed_configs/zero3.json", "rollout.group_size": 2,
        "rollout.max_completion_length": 8, "rollout.prefill_chunk_size": 4096, "forward.vision_chunk_frames": 16,
        "forward.vision_cache": "step",
        "forward.attention_backend": "split", "forward.self_check": False, "logging.wandb_mode": "disabled",
        "logging.progress_bar": False, "rewards.functions": f"[format, accuracy, '{a['plugin']}']",
    }
    return [f"{key}={value}" for key, value in values.items()]


def prompts_of(a: dict, k: int) -> int:
    """A replica's questions a step: a family of them at k > 1; at k = 1 half as many (each its own prompt, its video's
    pixels collated once per question: 6 of them on 4 processes do not fit this 24 GiB machine)."""
    return a["questions"] if k > 1 else max(1, a["questions"] // 2)


def launch(args: list[str], log: Path, ranks: int, **env: str) -> tuple[int, float]:
    start = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(["bash", "scripts/train.sh", "configs/demo_cpu.yaml", *args], cwd=ROOT, stdout=f,
                              stderr=subprocess.STDOUT,
                              env=child_env(NPROC_PER_NODE=str(ranks), PYTHONUNBUFFERED="1", **env)).returncode
    return code, time.perf_counter() - start


def planned(a: dict, out: Path, size: int, k: int, quick: bool = False) -> dict:
    """What plan.sh plans on top of the states, per rank, for the same configuration on as many ranks (``quick``: its
    command line in this process, ``app.planning.plan.main``)."""
    target = out / f"plan-S{size}-k{k}"
    args = ["configs/demo_cpu.yaml", *overrides(a, out / "unused", size, k, 1), "--gpus-per-node", str(a["ranks"]),
            "--gpu-memory-gib", "24", "--device", "cpu", "--out", str(target)]
    if quick:
        target.mkdir(parents=True, exist_ok=True)
        done = plan_here(args, target / "plan.log")
        if done["exit"]:
            return {"error": done.get("last_error", f"plan exited {done['exit']}")}
    else:
        done = subprocess.run(["bash", "scripts/plan.sh", *args], cwd=ROOT, capture_output=True, text=True,
                              env=child_env())
        if done.returncode != 0:
            return {"error": done.stderr[-500:]}
    plan = json.loads((target / "plan.json").read_text())
    # each peak is measured above what its stage began with: the prompts' pixels, collated before (the update's) or
    # as the engine begins (the rollout's), are not in it
    training = plan["training"]["total"] - plan["training"].get("inputs", 0.0)
    rollout = plan["rollout"]["total"] - plan["rollout"].get("inputs", 0.0)
    return {"rollout_gib": rollout / 2**30, "training_gib": training / 2**30,
            "states_gib": plan["states"]["total"] / 2**30, "visual_tokens": plan["workload"]["visual"]}


def point(a: dict, out: Path, size: int, k: int, quick: bool = False) -> dict:
    """``quick``: one launch, its heap's peak recorded (a smoke run's times mean nothing, so the sampling thread may
    share it), where a measurement runs the timed steps and the memory step apart."""
    row = {"S": size, "k": k, "questions_a_replica": prompts_of(a, k)}
    timed = out / f"S{size}-k{k}"
    if len(run_metrics(timed)) < 2:  # a point already measured is read back (re-planning costs nothing)
        code, seconds = launch(overrides(a, timed, size, k, 2), out / f"S{size}-k{k}.log", a["ranks"],
                               **({"PREFIX_GRPO_ALLOCATOR_PEAK": "1"} if quick else {}))
        row.update(exit=code, launch_s=seconds)
    else:
        row.update(exit=0)
    rows = run_metrics(timed)
    if len(rows) == 2:
        step = rows[1]
        row.update(steps=2, step_s=step["time/step"], per_question_s=step["time/step"] / prompts_of(a, k),
                   rollout_s=step["time/rollout"], policy_s=step["time/policy"], reference_s=step["time/reference"],
                   media_decoded=step["data/media_decoded"], shared_video_tokens=step["tokens/shared_video"],
                   prefill_tokens=step["rollout/prefill_tokens"], prompt_tokens=step["rollout/prompt_tokens"],
                   cpu_s_ranks=[step.get(f"rollout/cpu_s/rank{r}") for r in range(a["ranks"])],
                   **{f"{key}_ranks": [step.get(f"rollout/work/{key}/rank{r}") for r in range(a["ranks"])]
                      for key in WORK})
    memory = timed if quick else out / f"S{size}-k{k}-memory"
    if RANK_KEY not in (run_metrics(memory) or [{}])[0]:  # not measured, or before each rank's peak was logged
        shutil.rmtree(memory, ignore_errors=True)
        launch(overrides(a, memory, size, k, 1), out / f"S{size}-k{k}-memory.log", a["ranks"],
               PREFIX_GRPO_ALLOCATOR_PEAK="1")
    mrows = run_metrics(memory)
    plan = planned(a, out, size, k, quick)
    row.update({f"planned_{key}": value for key, value in plan.items()})
    for stage, metric, planned_key in (("rollout", "rollout_engine", "planned_rollout_gib"),
                                       ("policy", "policy", "planned_training_gib")):
        ranks = [mrows[0].get(f"memory/{metric}_above_start_gib/rank{r}") for r in range(a["ranks"])] if mrows else []
        if not ranks or None in ranks:
            continue
        row[f"{stage}_above_gib_ranks"] = ranks  # each rank's peak above what the stage began with
        row[f"{stage}_above_gib"] = max(ranks)
        if row.get(planned_key):
            each = [row[planned_key] / value for value in ranks]
            row[f"{stage}_planned_vs_measured_ranks"] = each
            row[f"{stage}_planned_vs_measured"] = row[planned_key] / max(ranks)
            row[f"{stage}_each_rank"] = " / ".join(f"{value:.3f} ({ratio:.2f})" for value, ratio in zip(ranks, each))
            # the planner plans the busiest rank (a rank given fewer prompts than it holds less)
            row[f"{stage}_within_15pct"] = 0.85 <= row[f"{stage}_planned_vs_measured"] <= 1.15
    return row


def run(out: Path, quick: bool = False) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    a = assets(out, quick)
    report = {"settings": {"frames": a["frames"], "size": SIZE, "fps": FPS, "questions": a["questions"],
                           "model": SIZES, "ranks": a["ranks"]}, "rows": []}
    points = quick_points(a["questions"]) if quick else [(s, k) for s in (1, 2, 4) for k in (a["questions"], 1)]
    for size, k in points:
        report["rows"].append(point(a, out, size, k, quick))
        ratios(report)
        write_report(out, "long_rehearsal", report, table(report), quiet=True)
    plot(out, report)
    write_report(out, "long_rehearsal", report, table(report))
    return report


def ratios(report: dict) -> None:
    """Per S: step time per question at k = questions over k = 1; per k: each rank's rollout work and CPU time
    against S = 1's (the busiest rank's over S = 1's, and the group's summed work over S = 1's one replica)."""
    by = {(r["S"], r["k"]): r for r in report["rows"]}
    for r in report["rows"]:
        one = by.get((r["S"], 1))
        if r["k"] > 1 and one and r.get("per_question_s") and one.get("per_question_s"):
            r["per_question_vs_k1"] = r["per_question_s"] / one["per_question_s"]
        alone = by.get((1, r["k"]))
        if not alone or r["S"] == 1 or not r.get("cpu_s_ranks") or not alone.get("cpu_s_ranks"):
            continue
        group = r["S"]
        for key in WORK:
            ranks, base = r[f"{key}_ranks"], alone[f"{key}_ranks"]
            if None in ranks or None in base or not max(base):
                continue
            r[f"{key}_vs_s1"] = max(ranks) / max(base)  # goal 1/S
            r[f"{key}_group_vs_s1"] = sum(ranks[:group]) / base[0]  # one replica (the first group) against one rank
        r["cpu_s_vs_s1"] = max(r["cpu_s_ranks"]) / max(alone["cpu_s_ranks"])
        r["cpu_goal"] = {2: 0.6, 4: 0.4}.get(group)
        r["cpu_within_goal"] = r["cpu_goal"] is not None and r["cpu_s_vs_s1"] <= r["cpu_goal"]


def table(report: dict) -> str:
    s = report["settings"]
    rows = report["rows"]
    columns = ["S", "k", "questions_a_replica", "exit", "step_s", "per_question_s", "per_question_vs_k1", "media_decoded",
               "shared_video_tokens", "planned_rollout_gib", "rollout_each_rank", "planned_training_gib",
               "policy_each_rank", "rollout_within_15pct", "policy_within_15pct"]
    fmt = {c: ".3f" for c in ("step_s", "per_question_s", "per_question_vs_k1", "planned_rollout_gib",
                              "planned_training_gib")}
    work_columns = ["S", "k", *[f"{key}_vs_s1" for key in WORK], *[f"{key}_group_vs_s1" for key in WORK],
                    "cpu_s_vs_s1", "cpu_goal", "cpu_within_goal"]
    work_fmt = {c: ".3f" for c in work_columns if c.endswith("s1")}
    tokens = next((r.get("planned_visual_tokens") for r in rows if r.get("planned_visual_tokens")), "?")
    return "\n".join([
        f"## A long video's questions under sequence parallelism: {s['frames']} frames at {s['size']}x{s['size']} "
        f"({tokens} visual tokens a prompt), {s['questions']} questions a video, {s['ranks']} processes (ZeRO-3, fp32, CPU)", "",
        markdown_table(rows, columns, fmt), "",
        "step_s / per_question_s: step 2 of a 2-step run (questions_a_replica a step). The memory columns: what "
        "plan.sh plans on top of the states for the same run (without the prompts' pixel values, collated before each "
        "measure begins), and each rank's allocator peak above what the stage began with (rollout engine, policy "
        "update; GiB, from a 1-step run with the heap's peak recorded), with planned / measured in brackets; "
        "within_15pct: planned / measured for the busiest rank in 0.85-1.15.", "",
        "### Each rank's rollout against S = 1 (the same k)", "",
        markdown_table([r for r in rows if r["S"] > 1], work_columns, work_fmt), "",
        "*_vs_s1: the busiest rank's work (the tower's patch rows, the prompt positions it ran through the layers, "
        "the prompts' K/V it held after the prefill) over S = 1's rank (goal 1/S within one chunk); *_group_vs_s1: "
        "the group's ranks summed over S = 1's rank (goal 1); cpu_s_vs_s1: the busiest rank's rollout CPU time "
        f"(time.process_time, every thread) over S = 1's: {s['ranks']} processes share this machine's cores, so CPU "
        "time stands in for wall time (goal 0.6 at S = 2, 0.4 at S = 4)."])


def plot(out: Path, report: dict) -> None:
    """Four panels: seconds per question; the busiest rank's rollout CPU time and work against S = 1's (goal 1/S);
    the rollout's and the update's peaks, planned over measured for the busiest rank (goal 0.85-1.15)."""
    import matplotlib.pyplot as plt

    from app.runtime import plots  # noqa: F401 - selects the Agg backend

    rows = [r for r in report["rows"] if r.get("per_question_s")]
    if not rows:
        return
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    labels = [f"S={r['S']} k={r['k']}" for r in rows]
    ax = axes[0][0]
    ax.bar(labels, [r["per_question_s"] for r in rows], color=["C0" if r["k"] > 1 else "C7" for r in rows])
    ax.set_ylabel("seconds per question (step 2)")
    ax.set_title("k = 6 (blue) against k = 1 (grey)", fontsize=9)
    ax = axes[0][1]
    spread = [r for r in rows if r["S"] > 1 and r.get("cpu_s_vs_s1") is not None]
    sx = list(range(len(spread)))
    width = 0.2
    for i, (key, name) in enumerate([("cpu_s_vs_s1", "rollout CPU time"), ("tower_patches_vs_s1", "tower patches"),
                                     ("prefill_tokens_vs_s1", "prefill positions"), ("kv_bytes_vs_s1", "K/V held")]):
        ax.bar([x + (i - 1.5) * width for x in sx], [r.get(key) or 0 for r in spread], width, label=name)
    for x, r in zip(sx, spread):
        ax.hlines([r["cpu_goal"] or 0], x - 0.45, x + 0.45, colors="k", linestyles="dashed")
    ax.set_xticks(sx, [f"S={r['S']} k={r['k']}" for r in spread])
    ax.set_ylabel("busiest rank over S = 1's rank")
    ax.set_title("the rollout spread (dashed: the CPU-time goal)", fontsize=9)
    ax.legend(fontsize=7)
    for ax, key, name in ((axes[1][0], "rollout_planned_vs_measured", "rollout engine"),
                          (axes[1][1], "policy_planned_vs_measured", "update")):
        ax.bar(labels, [r.get(key) or 0 for r in rows], color="C1")
        ax.axhspan(0.85, 1.15, color="C2", alpha=0.15)
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_ylim(0, 1.5)
        ax.set_ylabel(f"{name} peak: planned / measured")
        ax.set_title("the busiest rank (band: within 15%)", fontsize=9)
    for ax in axes.flat:
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(out / "long_rehearsal.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/bench/long_rehearsal")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run(Path(args.out), args.quick)


if __name__ == "__main__":
    main()
