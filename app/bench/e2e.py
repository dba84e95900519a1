"""One GRPO step end to end (rollout, reference log-probs, policy update), long video prefix, per phase.

    python -m app.bench.e2e --out outputs/bench/e2e [--quick]

Three runs of the real trainer (`python -m app.training.trainer`, one process) on the same data and seed:
- grouped:  shared-prefix rollouts + grouped forward for reference and policy (this project's default);
- repeated: shared-prefix rollouts + the ordinary [P;Ri] forward;
- hf+repeated: HF generate(num_return_sequences) rollouts + the ordinary forward (what most peers run).
Timings are from the last step (the first one also runs the one-off self-check). ``--quick`` (a smoke run on tiny
sizes) runs grouped and hf+repeated only.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from app.bench.common import ROOT, cli, markdown_table, write_report
from app.runtime.models import TinySizes, build_tiny_checkpoint

VARIANTS = {"grouped": ("grouped", "grouped"), "repeated": ("grouped", "repeated"), "hf+repeated": ("hf", "repeated")}
BENCH_SIZES = TinySizes(hidden=256, layers=2, heads=4, kv_heads=1, head_dim=64, intermediate=704, vision_hidden=64,
                        init_std=0.02)


def prepare(root: Path, records: int, frames: int, side: int, sizes: TinySizes = BENCH_SIZES) -> tuple[Path, Path]:
    from app.data.video import write_mp4

    checkpoint = root / "tiny-qwen2_5_vl"
    if not (checkpoint / "config.json").exists():
        build_tiny_checkpoint(checkpoint, "qwen2_5_vl", seed=0, sizes=sizes, max_pixels=side * side)
    data = root / "data"
    (data / "videos").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(records):
        path = data / "videos" / f"long{i}.mp4"
        if not path.exists():
            write_mp4(path, rng.integers(0, 255, (frames, side, side, 3), dtype=np.uint8), fps=8)
        lines.append(json.dumps({"problem_id": i, "problem": "What colour dominates the video?", "data_type": "video",
                                 "problem_type": "multiple choice", "options": ["A. red", "B. green", "C. blue"],
                                 "solution": "<answer>A</answer>", "path": f"videos/long{i}.mp4",
                                 "data_source": "bench"}))
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    return checkpoint, data / "train.jsonl"


def run(out: Path, quick: bool = False) -> dict:
    frames, side, group, completion, steps = (8, 56, 4, 8, 2) if quick else (64, 224, 8, 64, 2)
    checkpoint, train = prepare(out, records=4, frames=frames, side=side)
    rows = []
    for name, (engine, grouping) in VARIANTS.items():
        if quick and name == "repeated":
            continue
        run_dir = out / f"run-{name}"
        command = [sys.executable, "-m", "app.training.trainer", str(ROOT / "configs" / "demo_cpu.yaml"),
                   f"model.path={checkpoint}", f"data.train_file={train}", f"train.output_dir={run_dir}",
                   f"data.min_pixels={side * side}", f"data.max_pixels={side * side}", f"data.max_frames={frames}",
                   "data.fps=8", "data.max_prompt_length=32768", f"rollout.group_size={group}",
                   f"rollout.max_completion_length={completion}", f"rollout.engine={engine}",
                   f"forward.grouping={grouping}", "grpo.beta=0.04", f"train.max_steps={steps}",
                   "train.prompts_per_rank=1", "train.groups_per_micro_batch=1", "train.save_every=0",
                   "train.export_hf=false", "logging.wandb_mode=disabled", "logging.progress_bar=false",
                   "train.deepspeed_config=deepspeed_configs/zero2.json"]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if result.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{result.stderr[-3000:]}")
        last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        rows.append({"variant": name, "rollout_s": last["time/rollout"], "reference_s": last["time/reference"],
                     "policy_s": last["time/policy"], "step_s": last["time/step"],
                     "policy_tokens": last["tokens/policy_forward"]})
    base = rows[-1]
    for row in rows:
        for phase in ("rollout_s", "reference_s", "policy_s", "step_s"):
            row[f"{phase[:-2]}_speedup"] = base[phase] / row[phase] if row[phase] else float("nan")
    columns = ["variant", "rollout_s", "reference_s", "policy_s", "step_s", "policy_tokens", "rollout_speedup",
               "reference_speedup", "policy_speedup", "step_speedup"]
    formats = {c: ".3f" for c in columns if c.endswith("_s")} | {c: ".2f" for c in columns if c.endswith("speedup")}
    table = (f"## One GRPO step, {frames}-frame {side}x{side} videos, G={group}, {completion}-token completions "
             f"(speed-up relative to hf+repeated)\n\n" + markdown_table(rows, columns, formats))
    payload = {"frames": frames, "side": side, "group": group, "completion": completion, "rows": rows}
    write_report(out, "e2e", payload, table)
    return payload


def main(argv: list[str] | None = None) -> None:
    cli(run, __doc__, "outputs/bench/e2e", argv)


if __name__ == "__main__":
    main()
