"""A GRPO step with the frozen vision tower's cache on and off (``forward.vision_cache``), 64-frame videos.

    python -m app.bench.video.vision_cache --out outputs/bench/vision_cache [--quick]

Runs the real trainer (`python -m app.training.trainer`, one process) four times on the same data and seed: the tower and
projector frozen (what LoRA runs do; the cache keeps the tower's outputs) and the tower frozen with the projector
training (the cache keeps what the projector reads), each with the cache kept for the step (``step``) and with every
forward encoding its own items (``off``). A step here makes three tower passes per video without the cache: the
rollout's prefill, the reference forward (grpo.beta > 0) and the policy forward.

The tiny model's tower is sized so that its cost per merged token relative to the language model is near
Qwen2.5-VL-7B's (4 blocks of width 64 against 2 decoder layers of width 256). Timings are from the last step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from app.bench.common import ROOT, cli, markdown_table, write_report
from app.bench.e2e import prepare
from app.runtime.models import TinySizes

SIZES = TinySizes(hidden=256, layers=2, heads=4, kv_heads=1, head_dim=64, intermediate=704, vision_hidden=64,
                  vision_depth=4, vision_heads=2, init_std=0.02)
SETUPS = {"tower+projector frozen": ["model.freeze_vision_tower=true", "model.freeze_projector=true"],
          "tower frozen, projector trains": ["model.freeze_vision_tower=true"]}


def run(out: Path, quick: bool = False) -> dict:
    frames, side, group, completion, steps = (8, 56, 2, 4, 2) if quick else (64, 224, 8, 32, 2)
    checkpoint, train = prepare(out, records=2, frames=frames, side=side, sizes=SIZES)
    rows = []
    setups = dict(list(SETUPS.items())[:1]) if quick else SETUPS  # --quick (the suite's smoke run): one setup
    for setup, flags in setups.items():
        for setting in ("off", "step"):
            run_dir = out / f"run-{len(rows)}"
            command = [sys.executable, "-m", "app.training.trainer", str(ROOT / "configs" / "demo_cpu.yaml"),
                       f"model.path={checkpoint}", f"data.train_file={train}", f"train.output_dir={run_dir}",
                       f"data.min_pixels={side * side}", f"data.max_pixels={side * side}", f"data.max_frames={frames}",
                       "data.fps=8", "data.max_prompt_length=32768", f"rollout.group_size={group}",
                       f"rollout.max_completion_length={completion}", "grpo.beta=0.04", f"train.max_steps={steps}",
                       "train.prompts_per_rank=1", "train.groups_per_micro_batch=1", "train.save_every=0",
                       "train.export_hf=false", "logging.wandb_mode=disabled", "logging.progress_bar=false",
                       "forward.self_check=false", f"forward.vision_cache={setting}", *flags,
                       "train.deepspeed_config=deepspeed_configs/zero2.json"]
            result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600)
            if result.returncode != 0:
                raise RuntimeError(f"{setup} / {setting} failed:\n{result.stderr[-3000:]}")
            last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
            rows.append({"setup": setup, "vision_cache": setting, "rollout_s": last["time/rollout"],
                         "reference_s": last["time/reference"], "policy_s": last["time/policy"],
                         "step_s": last["time/step"], "tower_passes_per_item": last["vision/tower_passes_per_item"],
                         "loss": last["loss"]})
    for off, on in zip(rows[::2], rows[1::2]):
        on["step_speedup"] = off["step_s"] / on["step_s"]
        on["same_loss"] = on["loss"] == off["loss"]
    columns = ["setup", "vision_cache", "tower_passes_per_item", "rollout_s", "reference_s", "policy_s", "step_s",
               "step_speedup", "same_loss"]
    formats = {c: ".3f" for c in columns if c.endswith("_s")} | {"step_speedup": ".2f",
                                                                   "tower_passes_per_item": ".1f"}
    table = (f"## One GRPO step with the vision cache off and on: {frames}-frame {side}x{side} videos, G={group}, "
             f"{completion}-token completions, reference forward on (speed-up: off / on)\n\n"
             + markdown_table(rows, columns, formats))
    payload = {"frames": frames, "side": side, "group": group, "completion": completion, "sizes": SIZES.__dict__,
               "rows": rows}
    write_report(out, "vision_cache", payload, table)
    return payload


def main(argv: list[str] | None = None) -> None:
    cli(run, __doc__, "outputs/bench/vision_cache", argv)


if __name__ == "__main__":
    main()
