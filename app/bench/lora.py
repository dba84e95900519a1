"""Peak memory of one GRPO step: full fine-tuning with a separately loaded reference vs LoRA with the reference as
the policy's adapters off (no second model), on the same model and batch.

    python -m app.bench.lora --out outputs/bench/lora [--quick]      (scripts/bench.sh lora)

Each variant runs the real trainer (``GRPOTrainer``: DeepSpeed ZeRO-2 engine, AdamW, beta > 0) for one step in a
fresh process; peak memory is that process's (peak RSS on CPU, max allocated on CUDA).
"""

from __future__ import annotations

import time
from pathlib import Path

from app.bench.common import ROOT, cli, device, isolated, markdown_table, write_report
from app.runtime.models import TinySizes, build_tiny_checkpoint

SIZES = TinySizes(hidden=768, layers=8, heads=12, kv_heads=2, head_dim=64, intermediate=3072, vision_hidden=64,
                  vision_depth=2, vision_heads=2)
QUICK = TinySizes(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=128, vision_hidden=32,
                  vision_depth=1, vision_heads=1)
VARIANTS = {"full fine-tuning + separate reference": {"lora.rank": 0},
            "LoRA r=16 + adapters-off reference": {"lora.rank": 16, "lora.alpha": 32}}


def one_step(overrides: dict) -> dict:
    from app.bench.common import peak_memory_mb
    from app.config.loading import load_config
    from app.runtime.lora import AdaptersOff
    from app.training.trainer import GRPOTrainer

    cfg = load_config(ROOT / "configs" / "demo_cpu.yaml", [f"{k}={v}" for k, v in overrides.items()])
    trainer = GRPOTrainer(cfg)
    before = peak_memory_mb()
    start = time.perf_counter()
    metrics = trainer.train_step(0)
    seconds = time.perf_counter() - start
    module = trainer.engine.module
    return {"seconds": seconds, "peak_before_step_mb": before, "loss": metrics["loss"], "kl": metrics.get("kl", 0.0),
            "trainable_m": sum(p.numel() for p in module.parameters() if p.requires_grad) / 1e6,
            "parameters_m": sum(p.numel() for p in module.parameters()) / 1e6,
            "separate_reference": trainer.reference is not None and not isinstance(trainer.reference, AdaptersOff)}


def run(out: Path, quick: bool = False) -> dict:
    from app.data.synthetic import generate

    checkpoint = out / ("model-quick" if quick else "model")
    if not (checkpoint / "config.json").exists():
        build_tiny_checkpoint(checkpoint, "qwen2_5_vl", seed=0, sizes=QUICK if quick else SIZES)
    files = generate(out / "data", train=8, heldout=0, seed=0)
    base = {"model.path": checkpoint, "data.train_file": files["train"], "train.output_dir": out / "run",
            "train.prompts_per_rank": 2, "train.groups_per_micro_batch": 2, "rollout.group_size": 4,
            "rollout.max_completion_length": 8 if quick else 32, "grpo.beta": 0.04, "forward.self_check": False,
            "logging.wandb_mode": "disabled", "logging.progress_bar": False, "data.prefetch": 0}
    rows = []
    for name, extra in VARIANTS.items():
        result = isolated("app.bench.lora:one_step", overrides={k: str(v) for k, v in {**base, **extra}.items()})
        rows.append({"variant": name, **result})
    for row in rows:
        row["memory_vs_full"] = row["peak_memory_mb"] / rows[0]["peak_memory_mb"]
    table = markdown_table(rows, ["variant", "peak_memory_mb", "memory_vs_full", "trainable_m", "parameters_m",
                                  "separate_reference", "seconds"],
                           {"peak_memory_mb": ".0f", "memory_vs_full": ".2f", "trainable_m": ".2f",
                            "parameters_m": ".1f", "seconds": ".2f"})
    table = (f"## One GRPO step on {device().type}: {rows[0]['parameters_m']:.0f}M-parameter Qwen2.5-VL, fp32, "
             f"AdamW, beta 0.04\n\n{table}")
    payload = {"rows": rows, "quick": quick}
    write_report(out, "lora", payload, table)
    return payload


def main(argv: list[str] | None = None) -> None:
    cli(run, __doc__, "outputs/bench/lora", argv)


if __name__ == "__main__":
    main()
